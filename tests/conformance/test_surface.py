"""HF Accelerate's public surface resolves in accel: a frozen list, checked without HF installed.

tests/conformance/hf_accelerate_surface.json is written by tools/hf_surface.py from an install of HF Accelerate
and a checkout of its examples. Every name, member, launch option, subcommand, module path and name a module path
defines there must resolve in accel with `accelerate` renamed to `accel`, except the few `accelerate.utils` names
listed in NOT_PROVIDED, each with its reason (the README's conformance section lists them too).

So must every `accelerate` name transformers, TRL and PEFT use (frozen at the versions the test set-up pins), and,
where those libraries are installed, every name their installed source uses, with the switch on (`import
accelerate` served by accel): a newer release that uses a name accel lacks fails here, naming it and where.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

import accel
import accel.utils

SURFACE = json.loads((pathlib.Path(__file__).parent / "hf_accelerate_surface.json").read_text())
README = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
TOOL = pathlib.Path(__file__).parents[2] / "tools" / "hf_surface.py"
LIBRARIES = sorted(SURFACE["libraries"])

# accelerate.utils names accel does not provide, and why (also listed in the README).
NOT_PROVIDED: dict[str, str] = {}


def _renamed(module: str) -> str:
    return "accel" + module[len("accelerate") :]


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


@functools.cache
def _tool():
    """tools/hf_surface.py: what freezes the surface also scans a library and resolves its references."""
    spec = importlib.util.spec_from_file_location("hf_surface", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    table["`accelerate launch` options"] = (
        SURFACE["launch_options"],
        lambda o: o in _launch_parser()._option_string_actions,
    )
    table["subcommands"] = (SURFACE["subcommands"], lambda name: name in _subcommands())
    table["module paths"] = (SURFACE["module_paths"], lambda path: _resolves(f"accelerate.{path}", None))
    table["names each module path defines"] = (
        [f"{path}:{name}" for path, names in SURFACE["module_names"].items() for name in names],
        lambda entry: hasattr(importlib.import_module("accel." + entry.split(":")[0]), entry.split(":")[1]),
    )
    for library, used in SURFACE["libraries"].items():
        table[f"`accelerate` names {library} {used['version']} uses"] = (
            sorted(used["references"]),
            lambda reference: _tool().resolves(reference, _renamed),
        )
    for kind in ("examples", "test_scripts"):
        table[f"HF's {kind} whose unconditional imports resolve"] = (
            sorted(SURFACE[kind]),
            lambda file, kind=kind: _file_imports_resolve(SURFACE[kind][file]),
        )
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
    missing = {
        file: [f"{module}.{name}" for module, name in imports if not _resolves(module, name)]
        for file, imports in SURFACE[kind].items()
    }
    assert {file: names for file, names in missing.items() if names} == {}


@pytest.mark.parametrize("library", LIBRARIES)
def test_names_libraries_built_on_hf_accelerate_use(library):
    """Frozen: every `accelerate` name the pinned release uses resolves in accel (conditional uses included)."""
    tool, used = _tool(), SURFACE["libraries"][library]
    missing = {
        reference: places for reference, places in used["references"].items() if not tool.resolves(reference, _renamed)
    }
    assert missing == {}, _lacking(library, used["version"], missing)


def test_the_scan_finds_every_kind_of_use():
    source = (
        "import accelerate\n"
        "if is_accelerate_available():\n"
        "    from accelerate.utils import gather, reduce as r\n"
        "try:\n"
        "    import accelerate.hooks as hooks\n"
        "except ImportError:\n"
        "    pass\n"
        "def f(m):\n"
        "    accelerate.utils.memory.release_memory(m)\n"
        "    hooks.remove_hook_from_module(m).x\n"
        "    return accelerate.__version__, other.accelerate.thing\n"
    )
    assert _tool().accelerate_references(source) == {
        "accelerate": [1],
        "accelerate.utils:gather": [3],
        "accelerate.utils:reduce": [3],
        "accelerate.hooks": [5],
        "accelerate:utils.memory.release_memory": [9],
        "accelerate.hooks:remove_hook_from_module": [10],
        "accelerate:__version__": [11],
    }
    assert _tool().resolves("accelerate:utils.memory.release_memory", _renamed)
    assert not _tool().resolves("accelerate.utils:no_such_name", _renamed)
    assert not _tool().resolves("accelerate.no_such_module", _renamed)


def _lacking(library: str, version: str, missing: dict) -> str:
    lines = [
        f"{library} {version} uses `accelerate` names accel lacks, so it breaks under the switch "
        "(ACCEL_AS_ACCELERATE / --as_accelerate):"
    ]
    lines += [
        f"  {reference}  (used at {', '.join(places[:3])}{', ...' if len(places) > 3 else ''})"
        for reference, places in sorted(missing.items())
    ]
    lines.append(
        "Add each to accel with HF Accelerate 1.15's semantics, then refreeze the surface: "
        "python tools/hf_surface.py --libraries-only --out tests/conformance/hf_accelerate_surface.json"
    )
    return "\n".join(lines)


@functools.cache
def _scanned(library: str) -> dict:
    return _tool().library_references(library)


def _installed(library: str) -> str:
    if importlib.util.find_spec(library) is None:
        pytest.skip(f"{library} is not installed")
    return importlib.metadata.version(library)


# Resolves references (JSON on stdin) with `import accelerate` served by accel; prints those that do not resolve.
_RESOLVE_WITH_THE_SWITCH = """
import importlib.util, json, sys
import accel
accel.as_accelerate()
spec = importlib.util.spec_from_file_location("hf_surface", sys.argv[1])
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)
print(json.dumps([reference for reference in json.load(sys.stdin) if not tool.resolves(reference)]))
"""


@pytest.mark.parametrize("library", LIBRARIES)
def test_the_installed_release_uses_only_names_accel_serves(library):
    """Live: the installed release's every `accelerate` name resolves with the switch on, in a fresh interpreter
    (so HF Accelerate, installed beside accel for the comparisons, is never what answers)."""
    version = _installed(library)
    used = _scanned(library)["references"]
    env = {k: v for k, v in os.environ.items() if k not in ("ACCEL_AS_ACCELERATE", "ACCELERATE_AS_ACCELERATE")}
    done = subprocess.run(
        [sys.executable, "-c", _RESOLVE_WITH_THE_SWITCH, str(TOOL)],
        input=json.dumps(sorted(used)),
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    missing = {reference: used[reference] for reference in json.loads(done.stdout.strip().splitlines()[-1])}
    assert missing == {}, _lacking(library, version, missing)


@pytest.mark.parametrize("library", LIBRARIES)
def test_the_frozen_uses_are_the_installed_releases(library):
    """The frozen list is the pinned release's, scanned as the tool scans: refreeze after changing a pin."""
    version, frozen = _installed(library), SURFACE["libraries"][library]
    if version != frozen["version"]:
        pytest.skip(f"{library} {version} installed, the surface froze {frozen['version']} (the live test checks it)")
    assert _scanned(library) == frozen


def test_the_report_counts_every_surface():
    assert all(len(_missing(entries, check)) == 0 for entries, check in surfaces().values())


if __name__ == "__main__":  # the README's conformance table: python tests/conformance/test_surface.py
    print(f"HF Accelerate {SURFACE['version']} surface | resolves in accel")
    for title, (entries, check) in surfaces().items():
        missing = _missing(entries, check)
        print(
            f"{title} | {len(entries) - len(missing)} / {len(entries)}" + (f"  missing: {missing}" if missing else "")
        )
