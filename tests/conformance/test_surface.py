"""HF Accelerate's public surface resolves in accel: a frozen list, checked without HF installed.

tests/conformance/hf_accelerate_surface.json is written by tools/hf_surface.py from an install of HF Accelerate
and a checkout of its examples. Every name, member, launch option, subcommand, module path and name a module path
defines there must resolve in accel with `accelerate` renamed to `accel`, except the few `accelerate.utils` names
listed in NOT_PROVIDED, each with its reason (the README's conformance section lists them too).
"""

from __future__ import annotations

import importlib
import json
import pathlib

import pytest

import accel
import accel.utils

SURFACE = json.loads((pathlib.Path(__file__).parent / "hf_accelerate_surface.json").read_text())
README = (pathlib.Path(__file__).parents[2] / "README.md").read_text()

# accelerate.utils names accel does not provide, and why (also listed in the README).
NOT_PROVIDED: dict[str, str] = {}


def _renamed(module: str) -> str:
    return "accel" + module[len("accelerate"):]


def _resolves(module: str, name: str | None) -> bool:
    try:
        imported = importlib.import_module(_renamed(module))
    except ImportError:
        return False
    if name is None or name == "*":
        return True
    if hasattr(imported, name):
        return True
    try:  # `from accelerate.utils import operations` names a submodule
        importlib.import_module(f"{_renamed(module)}.{name}")
    except ImportError:
        return False
    return True


def _missing(names, check) -> list[str]:
    return [name for name in names if not check(name)]


def _launch_parser():
    from accel.cli.main import build_parser

    return build_parser()._subparsers._group_actions[0].choices["launch"]


def _subcommands() -> dict:
    from accel.cli.main import build_parser

    return build_parser()._subparsers._group_actions[0].choices


def _state_class(name: str):
    return getattr(accel, name) if hasattr(accel, name) else getattr(importlib.import_module("accel.state"), name)


def _file_imports_resolve(imports: list) -> bool:
    return all(_resolves(module, name) for module, name in imports)


def surfaces() -> dict[str, tuple[list, object]]:
    """Each surface of the table in the README: (the entries HF has, a check that one resolves in accel)."""
    table = {
        "names exported by `accelerate/__init__.py`": (SURFACE["top_level"], lambda n: hasattr(accel, n)),
        "public names of `accelerate.utils`": (SURFACE["utils"], lambda n: hasattr(accel.utils, n)),
    }
    for cls, names in SURFACE["members"].items():
        table[f"public members of `{cls}`"] = (names, lambda n, cls=cls: hasattr(_state_class(cls), n))
    table["`accelerate launch` options"] = (SURFACE["launch_options"], lambda o: o in _launch_parser()._option_string_actions)
    table["subcommands"] = (SURFACE["subcommands"], lambda name: name in _subcommands())
    table["module paths"] = (SURFACE["module_paths"], lambda path: _resolves(f"accelerate.{path}", None))
    table["names each module path defines"] = (
        [f"{path}:{name}" for path, names in SURFACE["module_names"].items() for name in names],
        lambda entry: hasattr(importlib.import_module("accel." + entry.split(":")[0]), entry.split(":")[1]))
    for kind in ("examples", "test_scripts"):
        table[f"HF's {kind} whose unconditional imports resolve"] = (
            sorted(SURFACE[kind]), lambda file, kind=kind: _file_imports_resolve(SURFACE[kind][file]))
    return table


def test_top_level_names():
    assert _missing(SURFACE["top_level"], lambda n: hasattr(accel, n)) == []


def test_utils_names():
    expected = [n for n in SURFACE["utils"] if n not in NOT_PROVIDED]
    assert _missing(expected, lambda n: hasattr(accel.utils, n)) == []
    assert len(expected) >= 0.95 * len(SURFACE["utils"])


def test_not_provided_names_are_documented():
    assert [name for name in NOT_PROVIDED if f"`{name}`" not in README] == []


@pytest.mark.parametrize("cls", sorted(SURFACE["members"]))
def test_class_members(cls):
    assert _missing(SURFACE["members"][cls], lambda n: hasattr(_state_class(cls), n)) == []


def test_launch_options():
    launch = _launch_parser()
    assert _missing(SURFACE["launch_options"], lambda option: option in launch._option_string_actions) == []


def test_subcommands():
    choices = _subcommands()
    assert _missing(SURFACE["subcommands"], lambda name: name in choices) == []
    assert "update" in choices["config"]._subparsers._group_actions[0].choices


@pytest.mark.parametrize("path", SURFACE["module_paths"])
def test_module_path(path):
    assert _resolves(f"accelerate.{path}", None)


@pytest.mark.parametrize("path", sorted(SURFACE["module_names"]))
def test_names_each_module_path_defines(path):
    module = importlib.import_module(f"accel.{path}")
    assert _missing(SURFACE["module_names"][path], lambda name: hasattr(module, name)) == []


@pytest.mark.parametrize("kind", ["examples", "test_scripts"])
def test_unconditional_imports_of_hf_files(kind):
    missing = {file: [f"{module}.{name}" for module, name in imports if not _resolves(module, name)]
               for file, imports in SURFACE[kind].items()}  # fmt: skip
    assert {file: names for file, names in missing.items() if names} == {}


def test_the_report_counts_every_surface():
    assert all(len(_missing(entries, check)) == 0 for entries, check in surfaces().values())


if __name__ == "__main__":  # the README's conformance table: python tests/conformance/test_surface.py
    print(f"HF Accelerate {SURFACE['version']} surface | resolves in accel")
    for title, (entries, check) in surfaces().items():
        missing = _missing(entries, check)
        print(f"{title} | {len(entries) - len(missing)} / {len(entries)}" + (f"  missing: {missing}" if missing else ""))
