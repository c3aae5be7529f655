"""Freeze HF Accelerate's public surface into tests/conformance/hf_accelerate_surface.json.

Run with HF Accelerate installed (any venv) and a checkout of its repository for the examples:

    python tools/hf_surface.py --examples PATH/TO/accelerate/examples --out tests/conformance/hf_accelerate_surface.json

The JSON is what tests/conformance/test_surface.py checks accel against, so a regression is caught without HF
installed. It records: the names `accelerate/__init__.py` imports; the public names of `accelerate.utils`
(submodules left out); the public members of `Accelerator`, `PartialState`, `AcceleratorState` and
`GradientState`; every `accelerate launch` option (its longest spelling); the subcommands; the module paths
users import, and per module path the public names it defines (see `module_names`); and, per HF example and per
test script, the unconditional `from accelerate... import ...` statements (not under `if` or `try`).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import logging
import pathlib
import types

MODULE_PATHS = [
    "logging", "state", "data_loader", "hooks", "big_modeling", "utils", "utils.operations", "utils.dataclasses",
    "utils.modeling", "utils.memory", "tracking", "local_sgd", "inference", "checkpointing", "test_utils",
    "optimizer", "scheduler", "launchers",
]  # fmt: skip
SUBCOMMANDS = ["config", "env", "launch", "test", "estimate-memory", "merge-weights", "to-fsdp2", "tpu-config"]


def top_level_names(accelerate) -> list[str]:
    tree = ast.parse(pathlib.Path(accelerate.__file__).read_text())
    return sorted({alias.asname or alias.name for node in tree.body if isinstance(node, ast.ImportFrom)
                   for alias in node.names})  # fmt: skip


def utils_names() -> list[str]:
    utils = importlib.import_module("accelerate.utils")
    return sorted(n for n in dir(utils) if not n.startswith("_") and not isinstance(getattr(utils, n), types.ModuleType))


def members(cls) -> list[str]:
    return sorted(n for n in dir(cls) if not n.startswith("_"))


def assigned_names(module: types.ModuleType) -> set[str]:
    """The names a module's own source assigns at its top level (its constants and aliases)."""
    source = getattr(module, "__file__", None)
    if source is None or not source.endswith(".py"):
        return set()
    names = set()
    for node in ast.parse(pathlib.Path(source).read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        names.update(target.id for target in targets if isinstance(target, ast.Name))
    return names


def module_names(path: str) -> list[str]:
    """The public names `accelerate.<path>` defines: functions and classes whose `__module__` is it, names its
    source assigns at top level, and its `__all__`; module-level loggers (not an API) are left out."""
    name = f"accelerate.{path}"
    module = importlib.import_module(name)
    defined = {n for n in dir(module) if getattr(getattr(module, n), "__module__", None) == name}
    defined |= {n for n in assigned_names(module) if hasattr(module, n)}
    defined |= set(getattr(module, "__all__", []))
    loggers = (logging.Logger, logging.LoggerAdapter)
    return sorted(n for n in defined if not n.startswith("_") and not isinstance(getattr(module, n, None), loggers))


def launch_options() -> list[str]:
    from accelerate.commands.launch import launch_command_parser

    return sorted(max(action.option_strings, key=len) for action in launch_command_parser()._actions
                  if action.option_strings and "--help" not in action.option_strings)  # fmt: skip


def unconditional_imports(source: str) -> list[list]:
    """[module, name] for every `from accelerate... import name` outside `if` and `try` blocks."""
    found = []

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.If, ast.Try)):
                continue
            if isinstance(child, ast.ImportFrom) and (child.module or "").split(".")[0] == "accelerate":
                found.extend([child.module, alias.name] for alias in child.names)
            elif isinstance(child, ast.Import):
                found.extend([alias.name, None] for alias in child.names if alias.name.split(".")[0] == "accelerate")
            visit(child)

    visit(ast.parse(source))
    return found


def imports_of(folder: pathlib.Path, root: pathlib.Path) -> dict[str, list]:
    return {str(path.relative_to(root)): unconditional_imports(path.read_text()) for path in sorted(folder.rglob("*.py"))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--examples", type=pathlib.Path, required=True, help="HF Accelerate's examples/ folder")
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args()
    accelerate = importlib.import_module("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState

    scripts = pathlib.Path(accelerate.__file__).parent / "test_utils" / "scripts"
    surface = {
        "version": accelerate.__version__,
        "top_level": top_level_names(accelerate),
        "utils": utils_names(),
        "members": {cls.__name__: members(cls) for cls in (Accelerator, PartialState, AcceleratorState, GradientState)},
        "launch_options": launch_options(),
        "subcommands": SUBCOMMANDS,
        "module_paths": MODULE_PATHS,
        "module_names": {path: module_names(path) for path in MODULE_PATHS},
        "examples": imports_of(args.examples, args.examples),
        "test_scripts": imports_of(scripts, scripts),
    }
    args.out.write_text(json.dumps(surface, indent=1) + "\n")


if __name__ == "__main__":
    main()
