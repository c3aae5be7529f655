"""Freeze HF Accelerate's public surface into tests/conformance/hf_accelerate_surface.json.

Run with HF Accelerate installed (any venv) and a checkout of its repository for the examples:

    python tools/hf_surface.py --examples PATH/TO/accelerate/examples --out tests/conformance/hf_accelerate_surface.json

The JSON is what tests/conformance/test_surface.py checks accel against, so a regression is caught without HF
installed. It records: the names `accelerate/__init__.py` imports; the public names of `accelerate.utils`
(submodules left out); the public members of `Accelerator`, `PartialState`, `AcceleratorState` and
`GradientState`; every `accelerate launch` option (its longest spelling); the subcommands; the module paths
users import, and per module path the public names it defines (see `module_names`); per HF example and per
test script, the unconditional `from accelerate... import ...` statements (not under `if` or `try`); and, per
library built on it (transformers, TRL, PEFT, as installed), every `accelerate` name its source uses, with where.
After upgrading one of those libraries, `--libraries-only` refreezes just that part (no HF checkout needed):

    python tools/hf_surface.py --libraries-only --out tests/conformance/hf_accelerate_surface.json
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import logging
import pathlib
import types
from collections.abc import Callable

MODULE_PATHS = [
    "logging",
    "state",
    "data_loader",
    "hooks",
    "big_modeling",
    "utils",
    "utils.operations",
    "utils.dataclasses",
    "utils.modeling",
    "utils.memory",
    "tracking",
    "local_sgd",
    "inference",
    "checkpointing",
    "test_utils",
    "optimizer",
    "scheduler",
    "launchers",
]
SUBCOMMANDS = ["config", "env", "launch", "test", "estimate-memory", "merge-weights", "to-fsdp2", "tpu-config"]
# Libraries built on HF Accelerate whose every use of an `accelerate` name is frozen (at the versions the test
# set-up pins: the Makefile's TEST_DEPS).
LIBRARIES = ["transformers", "trl", "peft"]


def top_level_names(accelerate) -> list[str]:
    tree = ast.parse(pathlib.Path(accelerate.__file__).read_text())
    return sorted(
        {alias.asname or alias.name for node in tree.body if isinstance(node, ast.ImportFrom) for alias in node.names}
    )


def utils_names() -> list[str]:
    utils = importlib.import_module("accelerate.utils")
    return sorted(
        n for n in dir(utils) if not n.startswith("_") and not isinstance(getattr(utils, n), types.ModuleType)
    )


def members(cls) -> list[str]:
    return sorted(n for n in dir(cls) if not n.startswith("_"))


def assigned_names(module: types.ModuleType) -> set[str]:
    """The names a module's own source assigns at its top level (its constants and aliases)."""
    source = getattr(module, "__file__", None)
    if source is None or not source.endswith(".py"):
        return set()
    names = set()
    for node in ast.parse(pathlib.Path(source).read_text()).body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
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

    return sorted(
        max(action.option_strings, key=len)
        for action in launch_command_parser()._actions
        if action.option_strings and "--help" not in action.option_strings
    )


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


def accelerate_references(source: str) -> dict[str, list[int]]:
    """{reference: [line, ...]} for every use of an `accelerate` name in `source`, conditional ones included
    (libraries import under `if is_accelerate_available()`). A reference is `module:name` for `from module import
    name`, `module` for `import module`, and `module:attr.attr` for an attribute chain on a name `import`
    bound to an accelerate module (`accelerate.utils.memory.release_memory` after `import accelerate`)."""
    tree = ast.parse(source)
    found: dict[str, list[int]] = {}
    bound = {}  # local name -> the accelerate module it is
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and _is_accelerate(node.module or ""):
            for alias in node.names:
                found.setdefault(f"{node.module}:{alias.name}", []).append(node.lineno)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _is_accelerate(alias.name):
                    found.setdefault(alias.name, []).append(node.lineno)
                    bound[alias.asname or "accelerate"] = alias.name if alias.asname else "accelerate"
    chains = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in chains:  # the whole chain, once
            parts, root = [], node
            while isinstance(root, ast.Attribute):
                parts.append(root.attr)
                root = root.value
            if isinstance(root, ast.Name) and root.id in bound:
                found.setdefault(f"{bound[root.id]}:{'.'.join(reversed(parts))}", []).append(node.lineno)
    return found


def _is_accelerate(module: str) -> bool:
    return module == "accelerate" or module.startswith("accelerate.")


def resolves(reference: str, rename: Callable[[str], str] = str) -> bool:
    """Whether `reference` (see accelerate_references) resolves, its module renamed by `rename` (accel's tests:
    `accelerate` to `accel`): the module imports and each attribute of the chain is there or is a submodule."""
    module, _, chain = reference.partition(":")
    path = rename(module)
    try:
        found = importlib.import_module(path)
    except ImportError:
        return False
    for attr in filter(None, chain.split(".")):
        if attr == "*":
            return True
        path = f"{path}.{attr}"
        if hasattr(found, attr):
            found = getattr(found, attr)
            continue
        try:
            found = importlib.import_module(path)
        except ImportError:
            return False
    return True


def library_references(package: str) -> dict:
    """What the installed `package` (transformers, trl, peft) uses of accelerate: its version, and per reference
    (see accelerate_references) the `file:line` places, files relative to site-packages."""
    import importlib.metadata
    import importlib.util

    root = pathlib.Path(importlib.util.find_spec(package).origin).parent
    references: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        if "accelerate" not in source:  # most files: no parse needed
            continue
        for reference, lines in accelerate_references(source).items():
            where = path.relative_to(root.parent).as_posix()
            references.setdefault(reference, []).extend(f"{where}:{line}" for line in lines)
    return {"version": importlib.metadata.version(package), "references": dict(sorted(references.items()))}


def imports_of(folder: pathlib.Path, root: pathlib.Path) -> dict[str, list]:
    return {
        str(path.relative_to(root)): unconditional_imports(path.read_text()) for path in sorted(folder.rglob("*.py"))
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--examples", type=pathlib.Path, help="HF Accelerate's examples/ folder")
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument(
        "--libraries", nargs="*", default=LIBRARIES, help="installed libraries whose uses of accelerate are frozen too"
    )
    parser.add_argument(
        "--libraries-only",
        action="store_true",
        help="refreeze only what the libraries use (after upgrading one), keeping the rest of --out",
    )
    args = parser.parse_args()
    if args.libraries_only:
        surface = json.loads(args.out.read_text())
        surface["libraries"] = {package: library_references(package) for package in args.libraries}
        args.out.write_text(json.dumps(surface, indent=1) + "\n")
        return
    if args.examples is None:
        parser.error("--examples is required (unless --libraries-only)")
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
        "libraries": {package: library_references(package) for package in args.libraries},
    }
    args.out.write_text(json.dumps(surface, indent=1) + "\n")


if __name__ == "__main__":
    main()
