"""`make test-fast` stays fast: a test not marked slow that runs longer than UNMARKED_LIMIT_S fails it,
named in a section of its own."""

import os
import subprocess
import sys

import pytest
from conftest import ROOT

LIMIT_S = 1.0  # the limit of the suites run here, so that their sleepy test is quick


@pytest.mark.slow
def test_an_unmarked_slow_test_fails_the_fast_suite(tmp_path):
    (tmp_path / "test_sleepy.py").write_text(
        "import time\nimport pytest\n\n\n"
        f"def test_unmarked():\n    time.sleep({LIMIT_S + 0.5})\n\n\n"
        f"@pytest.mark.slow\ndef test_marked():\n    time.sleep({LIMIT_S + 0.5})\n\n\n"
        "def test_quick():\n    pass\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), "UNMARKED_LIMIT_S": str(LIMIT_S)}
    run = {
        marks: subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "conftest", "-c", os.devnull, "-q", *marks, str(tmp_path)],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
        )  # fmt: skip
        for marks in (("-m", "not slow"), ("-k", "quick or unmarked"))
    }
    fast = run[("-m", "not slow")]
    assert fast.returncode == pytest.ExitCode.TESTS_FAILED, fast.stdout
    assert "2 passed, 1 deselected" in fast.stdout
    assert "test_sleepy.py::test_unmarked took 1" in fast.stdout
    assert "mark it @pytest.mark.slow" in fast.stdout
    assert run[("-k", "quick or unmarked")].returncode == 0  # the full suite is not timed
