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
    owner = getattr(accel, cls) if hasattr(accel, cls) else getattr(importlib.import_module("accel.state"), cls)
    assert _missing(SURFACE["members"][cls], lambda n: hasattr(owner, n)) == []


def test_launch_options():
    from accel.cli.main import build_parser

    launch = build_parser()._subparsers._group_actions[0].choices["launch"]
    assert _missing(SURFACE["launch_options"], lambda option: option in launch._option_string_actions) == []


def test_subcommands():
    from accel.cli.main import build_parser

    choices = build_parser()._subparsers._group_actions[0].choices
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
