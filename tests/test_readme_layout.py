"""The README's layout map is true: every path it names exists, and it names everything at the top of the tree."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Build products and caches, never in the map.
_IGNORED = re.compile(r"(__pycache__|\.so$|_build_info\.json$|\.egg-info$)")


def _layout_block() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Layout\n", 1)[1]
    return section.split("```", 2)[1]


def _named_paths(block: str) -> list[str]:
    """The paths at the start of the map's lines (`accel/ops.py`, `csrc/shm/`, `setup.py, pyproject.toml`)."""
    paths = []
    for line in block.splitlines():
        head = line[:29].strip()
        for item in head.split(","):
            item = item.strip()
            if "/" in item or "." in item:
                paths.append(item)
    return paths


def _entries(folder: str) -> list[str]:
    return sorted(p.name for p in (ROOT / folder).iterdir() if not _IGNORED.search(p.name))


def test_every_path_the_map_names_exists():
    missing = [path for path in _named_paths(_layout_block()) if not (ROOT / path).exists()]
    assert not missing, f"README's layout map names paths that do not exist: {missing}"


def test_the_map_names_every_top_level_module_and_folder():
    block = _layout_block()
    unnamed = []
    folders = (
        "accel",
        "accel/data",
        "accel/collectives",
        "accel/wire",
        "accel/checkpoint",
        "accel/big_modeling",
        "accel/cli",
        "accel/strategies",
        "accel/precision",
        "csrc",
        "csrc/cpu",
        "benchmarks",
        "benchmarks/report",
        "tools",
        "examples",
        "tests",
    )
    for folder in folders:
        for name in _entries(folder):
            if name == "__init__.py" and folder != "accel":
                continue
            if (ROOT / folder / name).is_file() and folder == "tests" and name.startswith("test_"):
                continue  # test files mirror accel/; the map describes the folder
            stem = name.rsplit(".", 1)[0] if (ROOT / folder / name).is_file() else name
            if not re.search(rf"(?<![\w.]){re.escape(stem)}(?![\w])", block):
                unnamed.append(f"{folder}/{name}")
    assert not unnamed, f"README's layout map does not mention: {unnamed}"
