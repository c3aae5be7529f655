"""`import accelerate` served by accel: the opt-in switch that lets libraries built on HF Accelerate (transformers'
`Trainer`, TRL, PEFT, diffusers' scripts) run on accel unchanged.

Turned on by `ACCEL_AS_ACCELERATE=1` in the environment (what `accel launch --as_accelerate` and the config key
`as_accelerate: true` export to every rank), or in a notebook by `import accel; accel.as_accelerate()` before
anything imports `accelerate`. A one-line `.pth` file that accel installs into site-packages calls `install_if_asked`
at every interpreter start, so every process of a job (ranks, spawned DataLoader workers, a plain `python` or
`torchrun`) is covered; it costs one environment lookup when the switch is off.

With it on, a finder placed first on `sys.meta_path` answers every `accelerate` and `accelerate.X` import with
accel's module of the same path (`accelerate.utils` is `accel.utils`, the same object), so none of HF Accelerate's
code runs even where it is installed. `accelerate` itself is a small module of its own that forwards every name
to `accel` but reports `__version__` as the HF Accelerate release accel stands in for (`STANDS_IN_FOR`); the
installed-distribution checks libraries make (`importlib.metadata.version("accelerate")`,
`importlib.util.find_spec("accelerate")`) see that version too, with metadata naming accel.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import pathlib
import sys
import types

# The HF Accelerate release whose public surface accel serves (tests/conformance/hf_accelerate_surface.json).
STANDS_IN_FOR = "1.15.0"
ENV_VARIABLE = "ACCEL_AS_ACCELERATE"
_ALIASED = "accelerate"
_TRUE = ("1", "true", "yes", "on")


def asked() -> bool:
    """Whether the environment asks for the switch (`ACCEL_AS_ACCELERATE`, or HF's spelling of accel's variables,
    `ACCELERATE_AS_ACCELERATE`, as every other setting)."""
    for name in (ENV_VARIABLE, "ACCELERATE_AS_ACCELERATE"):
        value = os.environ.get(name)
        if value is not None:
            return value.strip().lower() in _TRUE
    return False


def describe() -> str:
    """What a library sees, in one line (for `accel env` and the launcher)."""
    from accel import __version__

    return f"accel {__version__} standing in for HF Accelerate {STANDS_IN_FOR}; {ENV_VARIABLE}=1"


def install_if_asked() -> None:
    """What the `.pth` file runs at interpreter start: `install()` when the environment asks for it."""
    if asked():
        install()


def installed() -> bool:
    return any(isinstance(finder, AccelerateFinder) for finder in sys.meta_path)


def install() -> None:
    """Makes `import accelerate` (and every `accelerate.X`) resolve to accel in this process; idempotent. Also sets
    `ACCEL_AS_ACCELERATE=1`, so processes this one starts are served too.

    Raises:
        RuntimeError: HF Accelerate was imported already: its objects would live beside accel's, so the switch
            must come before anything imports `accelerate` (restart, and call it first).
    """
    if installed():
        return
    loaded = sorted(
        name
        for name, module in sys.modules.items()
        if _is_aliased(name) and not isinstance(module, _StandIn) and not _is_accel_module(module)
    )
    if loaded:
        raise RuntimeError(
            f"HF Accelerate is imported already ({', '.join(loaded[:3])}): accel can stand in for "
            "`accelerate` only when switched on before anything imports it (restart, then call "
            "accel.as_accelerate() first, or set ACCEL_AS_ACCELERATE=1)"
        )
    sys.meta_path.insert(0, AccelerateFinder())
    os.environ[ENV_VARIABLE] = "1"


def _is_aliased(name: str) -> bool:
    return name == _ALIASED or name.startswith(_ALIASED + ".")


def _is_accel_module(module: object) -> bool:
    name = getattr(module, "__name__", "")
    return name == "accel" or name.startswith("accel.")


def accel_name(name: str) -> str:
    """`accelerate.utils.operations` -> `accel.utils.operations`."""
    return "accel" + name[len(_ALIASED) :]


class _StandIn(types.ModuleType):
    """`accelerate` itself: every name is accel's, but `__version__` is the HF release accel stands in for (what
    libraries compare against their minimum version)."""

    def __getattr__(self, name: str) -> object:
        return getattr(importlib.import_module("accel"), name)

    def __dir__(self) -> list[str]:
        return sorted(set(dir(importlib.import_module("accel"))) | set(self.__dict__))


class _AliasLoader(importlib.abc.Loader):
    """Loads `accelerate.X` as accel's `accel.X`: the import machinery creates a placeholder, and executing it puts
    accel's own module in its place in `sys.modules` (which the import returns), so accel's modules keep their
    names and specs."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        name = module.__name__
        if name == _ALIASED:
            sys.modules[name] = _stand_in()
            return
        try:
            sys.modules[name] = importlib.import_module(accel_name(name))
        except ModuleNotFoundError as error:
            if error.name != accel_name(name):
                raise
            raise ModuleNotFoundError(
                f"No module named '{name}': accel stands in for accelerate "
                f"(ACCEL_AS_ACCELERATE) and has no {accel_name(name)}",
                name=name,
            ) from None


def _stand_in() -> _StandIn:
    accel = importlib.import_module("accel")
    module = _StandIn(_ALIASED, f"accel {accel.__version__}, standing in for HF Accelerate {STANDS_IN_FOR}")
    module.__version__ = STANDS_IN_FOR
    module.__file__ = accel.__file__
    module.__path__ = list(accel.__path__)
    module.__spec__ = importlib.machinery.ModuleSpec(_ALIASED, _AliasLoader(), is_package=True)
    module.__loader__ = module.__spec__.loader
    return module


class AccelerateFinder(importlib.abc.MetaPathFinder):
    """First on `sys.meta_path`: finds `accelerate[.X]` as accel's modules, and the `accelerate` distribution as
    accel standing in for HF Accelerate `STANDS_IN_FOR`."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not _is_aliased(fullname):
            return None
        if fullname != _ALIASED and importlib.util.find_spec(accel_name(fullname)) is None:
            return None  # the import fails with Python's own ModuleNotFoundError, as for any missing module
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(), is_package=True)

    def find_distributions(self, context: importlib.metadata.DistributionFinder.Context = None) -> list:
        name = getattr(context, "name", None)
        if name is not None and name.replace("-", "_").lower() != _ALIASED:
            return []
        return [StandInDistribution()]


class StandInDistribution(importlib.metadata.Distribution):
    """The `accelerate` distribution a library sees while the switch is on: version `STANDS_IN_FOR`, metadata
    naming accel."""

    def read_text(self, filename: str) -> str | None:
        if filename == "METADATA":
            accel = importlib.import_module("accel")
            return (
                f"Metadata-Version: 2.1\nName: {_ALIASED}\nVersion: {STANDS_IN_FOR}\n"
                f"Summary: accel {accel.__version__} standing in for HF Accelerate {STANDS_IN_FOR} "
                f"({ENV_VARIABLE}=1)\n"
            )
        if filename == "top_level.txt":
            return _ALIASED + "\n"
        return None

    def locate_file(self, path: str | os.PathLike) -> os.PathLike:
        return pathlib.Path(importlib.import_module("accel").__file__).parent / path
