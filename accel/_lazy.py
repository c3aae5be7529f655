"""Packages whose public names are imported on first use (a module `__getattr__`, PEP 562).

`accel` and `accel.utils` use it so that the CLI starts without importing torch; `accel.collectives` so that
importing one of its modules (the process state imports the uneven-step protocol) does not import all the others.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Callable


def lazy_names(
    package: str, names: dict[str, str], also: tuple[str, ...] = (), submodules: bool = False
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """(`__getattr__`, `__dir__`) for `package`, whose public `names` live in the modules they map to.

    Args:
        package: The package's name (`__name__`).
        names: Public name -> the module that defines it.
        also: Names the package defines itself, listed by `__dir__` too.
        submodules: Resolve any other public name that is a submodule of `package` by importing it.
    """

    def __getattr__(name: str) -> object:
        if name in names:
            value = getattr(importlib.import_module(names[name]), name)
            # Bound in the package, so later reads are plain attribute reads (Accelerator's collectives read
            # theirs on every call) rather than an import lookup each.
            setattr(sys.modules[package], name, value)
            return value
        if submodules and not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
            return importlib.import_module(f"{package}.{name}")  # binds the submodule as an attribute too
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return [*names, *also]

    return __getattr__, __dir__
