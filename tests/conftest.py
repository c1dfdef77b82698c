"""Shared paths and helpers: tests run on the real structures and pairs under ../shared and data/."""

import gzip
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
STRUCTURES = SHARED / "structures"
SHARED_DATA = SHARED / "data"
EXAMPLE = ROOT / "data"


def gunzip(path: Path, directory: Path) -> Path:
    """Plain-text copy of a gzipped structure (the reference parser reads only plain PDB)."""
    target = directory / path.name.removesuffix(".gz")
    with gzip.open(path, "rb") as src, open(target, "wb") as dst:
        shutil.copyfileobj(src, dst)
    return target


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    return tmp_path / "cache"
