"""The accel config file: HF Accelerate's `default_config.yaml`, same keys, same defaults.

`ClusterConfig` holds every key HF Accelerate writes, so an existing Accelerate config loads unchanged.
Loading checks each key's type and value and says which file, which key and what is allowed. Whether accel
can *run* what a file describes (TPU, Megatron-LM, ...) is a separate check,
`ClusterConfig.check_supported()`, so such a file can still be loaded and shown.

Where the default file lives (DESIGN.md §1):

- accel's own: `$ACCEL_CONFIG_FILE`, else `$XDG_CACHE_HOME/accel/default_config.yaml`, else
  `~/.cache/accel/default_config.yaml` (`default_config_path()`);
- HF Accelerate's, read when accel has none: `$HF_HOME/accelerate/default_config.yaml`, else
  `$XDG_CACHE_HOME/huggingface/accelerate/default_config.yaml`, else
  `~/.cache/huggingface/accelerate/default_config.yaml` (`hf_default_config_path()`).

Differences from HF Accelerate, all deliberate:

- Values are checked at load time (HF checks none); `distributed_type`, `compute_environment` and
  `dynamo_backend` are matched case-insensitively; numbers written as strings (`main_process_port: '29500'`)
  are accepted, and so is an unquoted `NO` / `no` (which YAML reads as false) for `distributed_type` and
  `mixed_precision`.
- `ipex_config` and `mpirun_config` (written by HF Accelerate before 1.0) are accepted.
- `fsdp_config`'s keys and values are checked too (HF's keys, with or without their `fsdp_` prefix, and the
  older `fsdp_backward_prefetch_policy`); the file keeps them as written. So are `deepspeed_config`'s (HF's keys,
  accel/cli/deepspeed_options.py) and `parallelism_config`'s (accel/cli/parallelism_options.py), which HF copies
  onto its launch arguments unchecked.
- `compute_environment: AMAZON_SAGEMAKER` is refused at load time: its keys are SageMaker's, not a cluster's.
- Files are written atomically (temporary file + rename).
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from accel.accelerator_config import DynamoBackend  # torch-free, so the CLI still starts without torch
from accel.backends import fsdp_options
from accel.cli import deepspeed_options, parallelism_options
from accel.env_vars import MIXED_PRECISIONS

COMPUTE_ENVIRONMENTS = ("LOCAL_MACHINE",)
DISTRIBUTED_TYPES = (
    "NO",
    "MULTI_CPU",
    "MULTI_GPU",
    "MULTI_NPU",
    "MULTI_MLU",
    "MULTI_SDAA",
    "MULTI_MUSA",
    "MULTI_XPU",
    "MULTI_HPU",
    "MULTI_NEURON",
    "DEEPSPEED",
    "FSDP",
    "XLA",
    "MEGATRON_LM",
)
DYNAMO_BACKENDS = tuple(backend.value for backend in DynamoBackend)
# The modes torch.compile accepts; HF's questionnaire offers the first three.
DYNAMO_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CONFIG_FILE_NAME = "default_config.yaml"


class ConfigError(ValueError):
    """A config file that cannot be read, parsed or used; the message names the file and the key.

    Attributes:
        path: the file (or `"<dict>"`) the bad value came from.
        key: the offending key, `None` when the problem is the file as a whole.
    """

    def __init__(self, message: str, path: str | os.PathLike | None = None, key: str | None = None):
        super().__init__(message)
        self.path = None if path is None else str(path)
        self.key = key


class _Invalid(Exception):
    """Raised by a value parser; `from_dict` turns it into a ConfigError naming the file and key."""

    def __init__(self, expected: str, subkey: str | None = None, value: Any = None, has_value: bool = False):
        super().__init__(expected)
        self.expected = expected
        self.subkey = subkey
        self.value = value
        self.has_value = has_value


# --- value parsers: each returns the normalised value or raises _Invalid(what is allowed) ---------------


def _allowed(values: tuple[str, ...]) -> str:
    return "allowed values: " + ", ".join(repr(value) for value in values)


def _boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise _Invalid("expected true or false")


def _integer(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        return int(value)
    raise _Invalid("expected an integer")


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    raise _Invalid("expected a string")


def _optional(parse: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: None if value is None else parse(value)


def _choice(allowed: tuple[str, ...], fold: Callable[[str], str] = str.upper) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if isinstance(value, str) and fold(value) in allowed:
            return fold(value)
        raise _Invalid(_allowed(allowed))

    return parse


def _compute_environment(value: Any) -> str:
    if isinstance(value, str) and value.upper() == "AMAZON_SAGEMAKER":
        raise _Invalid("Amazon SageMaker configs are not supported by accel yet; " + _allowed(COMPUTE_ENVIRONMENTS))
    return _choice(COMPUTE_ENVIRONMENTS)(value)


def _distributed_type(value: Any) -> str:
    # An unquoted `NO` is YAML 1.1 for false.
    return "NO" if value is False else _choice(DISTRIBUTED_TYPES)(value)


def _mixed_precision(value: Any) -> str | None:
    # An unquoted `no` is YAML 1.1 for false. HF leaves the key unset (None) for DeepSpeed configs that name a
    # deepspeed_config_file: the file holds the precision, and a key here would contradict it (see launch.py).
    if value is None:
        return None
    if value is False:
        return "no"
    return _choice(MIXED_PRECISIONS, fold=str.lower)(value)


def _process_count(value: Any) -> int:
    count = _integer(value)
    if count == -1 or count >= 1:
        return count
    raise _Invalid("expected a positive integer (or -1: let the launcher decide)")


def _machine_count(value: Any) -> int:
    count = _integer(value)
    if count >= 1:
        return count
    raise _Invalid("expected a positive integer")


def _machine_rank(value: Any) -> int:
    rank = _integer(value)
    if rank >= 0:
        return rank
    raise _Invalid("expected an integer >= 0")


def _port(value: Any) -> int | None:
    if value is None:
        return None
    port = _integer(value)
    if 1 <= port <= 65535:
        return port
    raise _Invalid("expected a port number between 1 and 65535")


def _gpu_ids(value: Any) -> str | None:
    # YAML reads `gpu_ids: 0` as an int and a JSON file may hold a list; HF stores a string.
    if value is None:
        return None
    if isinstance(value, list) and all(isinstance(item, int) and not isinstance(item, bool) for item in value):
        value = ",".join(str(item) for item in value)
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if isinstance(value, str) and (value.strip().lower() == "all" or re.fullmatch(r"\s*\d+(\s*,\s*\d+)*\s*", value)):
        return value.strip()
    raise _Invalid("expected 'all' or a comma-separated list of device ids such as '0,1'")


def _yes_no_or_bool(value: Any) -> bool | str:
    # HF's questionnaire writes `downcast_bf16: 'no'`; its dataclass default is False.
    if isinstance(value, bool) or (isinstance(value, str) and value.lower() in ("yes", "no")):
        return value
    raise _Invalid("expected true, false, 'yes' or 'no'")


def _string_list(value: Any) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return list(value)
    raise _Invalid("expected a list of strings")


def _mapping(value: Any) -> dict:
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return copy.deepcopy(dict(value))
    raise _Invalid("expected a mapping of keys to values")


def _checked_mapping(subparsers: dict[str, Callable[[Any], Any]]) -> Callable[[Any], dict]:
    """A parser for a nested mapping whose keys are known and whose values are checked one by one."""

    def parse(value: Any) -> dict:
        result = {}
        for subkey, subvalue in _mapping(value).items():
            if subkey not in subparsers:
                close = difflib.get_close_matches(str(subkey), list(subparsers), n=1)
                hint = f"unknown key (did you mean {close[0]!r}?); " if close else "unknown key; "
                raise _Invalid(hint + "allowed keys: " + ", ".join(map(repr, subparsers)), str(subkey), subvalue, True)
            try:
                result[subkey] = subparsers[subkey](subvalue)
            except _Invalid as invalid:
                raise _Invalid(invalid.expected, subkey, subvalue, True) from None
        return result

    return parse


_dynamo_config = _checked_mapping(
    {
        "dynamo_backend": _choice(DYNAMO_BACKENDS),
        "dynamo_mode": _choice(DYNAMO_MODES, fold=str.lower),
        "dynamo_use_fullgraph": _boolean,
        "dynamo_use_dynamic": _boolean,
        "dynamo_use_regional_compilation": _boolean,
    }
)
# `use_xpu` was written by HF Accelerate 0.2x on Intel GPU machines.
_ipex_config = _checked_mapping({"ipex": _boolean, "use_xpu": _boolean})


def _entries_checked_by(parse_entry: Callable[[str, Any], Any]) -> Callable[[Any], dict]:
    """A parser for a backend's nested mapping: each key and value checked by `parse_entry` (which raises ValueError
    saying what is allowed) and kept as written, so that the file round-trips unchanged; null values mean unset."""

    def parse(value: Any) -> dict:
        result = _mapping(value)
        for subkey, subvalue in result.items():
            try:
                parse_entry(str(subkey), subvalue)
            except ValueError as error:
                raise _Invalid(str(error), str(subkey), subvalue, True) from None
        return result

    return parse


# HF's nested backend configs; their keys and values: accel/backends/fsdp_options.py, accel/cli/deepspeed_options.py,
# accel/cli/parallelism_options.py.
_fsdp_config = _entries_checked_by(fsdp_options.parse_entry)
_deepspeed_config = _entries_checked_by(deepspeed_options.parse_entry)
_parallelism_config = _entries_checked_by(parallelism_options.parse_entry)


def _key(default: Any, parse: Callable[[Any], Any]) -> Any:
    return field(default=default, metadata={"parse": parse})


def _mapping_key(parse: Callable[[Any], dict] = _mapping) -> Any:
    return field(default_factory=dict, metadata={"parse": parse})


@dataclass(frozen=True)
class ClusterConfig:
    """HF Accelerate's `default_config.yaml`, one attribute per key, with HF's defaults.

    Enum-like values are plain upper-case strings (`distributed_type == "MULTI_CPU"`), so they compare equal
    to str-based enums such as `DistributedType.MULTI_CPU`. Nested configs are plain dicts; treat them as
    read-only (use `dataclasses.replace` to derive a changed config). The constructor trusts its arguments;
    `from_dict` and `load_config` check them.
    """

    compute_environment: str = _key("LOCAL_MACHINE", _compute_environment)
    distributed_type: str = _key("NO", _distributed_type)
    # None: the file has no key (launching then uses "no"); HF's questionnaire leaves it out for DeepSpeed configs
    # that name a deepspeed_config_file.
    mixed_precision: str | None = _key(None, _mixed_precision)
    use_cpu: bool = _key(False, _boolean)
    debug: bool = _key(False, _boolean)
    # -1 lets the launcher decide (HF's default); a file with distributed_type NO and no key gets 1.
    num_processes: int = _key(-1, _process_count)
    machine_rank: int = _key(0, _machine_rank)
    num_machines: int = _key(1, _machine_count)
    gpu_ids: str | None = _key(None, _gpu_ids)
    main_process_ip: str | None = _key(None, _optional(_text))
    main_process_port: int | None = _key(None, _port)
    rdzv_backend: str | None = _key("static", _optional(_text))
    same_network: bool | None = _key(False, _optional(_boolean))
    main_training_function: str = _key("main", _text)
    enable_cpu_affinity: bool = _key(False, _boolean)
    # accel's own: `import accelerate` resolves to accel in every rank. Written only when set (None), since HF's
    # loader refuses keys it does not know.
    as_accelerate: bool | None = _key(None, _optional(_boolean))
    downcast_bf16: bool | str = _key(False, _yes_no_or_bool)
    ipex_config: dict = _mapping_key(_ipex_config)
    mpirun_config: dict = _mapping_key()
    dynamo_config: dict = _mapping_key(_dynamo_config)
    fp8_config: dict = _mapping_key()
    deepspeed_config: dict = _mapping_key(_deepspeed_config)
    fsdp_config: dict = _mapping_key(_fsdp_config)
    parallelism_config: dict = _mapping_key(_parallelism_config)
    megatron_lm_config: dict = _mapping_key()
    tpu_name: str | None = _key(None, _optional(_text))
    tpu_zone: str | None = _key(None, _optional(_text))
    tpu_use_cluster: bool = _key(False, _boolean)
    tpu_use_sudo: bool = _key(False, _boolean)
    command_file: str | None = _key(None, _optional(_text))
    commands: list[str] | None = _key(None, _string_list)
    tpu_vm: list[str] | None = _key(None, _string_list)
    tpu_env: list[str] | None = _key(None, _string_list)
    # Where the values came from, for error messages; not a key of the file.
    source: str | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_dict(cls, data: Any, source: str | os.PathLike = "<dict>") -> ClusterConfig:
        """Build a config from a file's parsed contents, checking every key.

        Args:
            data: the mapping read from the YAML or JSON file.
            source: where `data` came from; error messages start with it.

        Returns:
            The config. HF's legacy keys (`fp16`, top-level `dynamo_backend`) are converted.

        Raises:
            ConfigError: `data` is not a mapping, has unknown keys, lacks `distributed_type`, or holds a value
                of the wrong type or outside the allowed values.
        """
        source = str(source)
        if not isinstance(data, Mapping):
            found = "an empty file" if data is None else f"a {type(data).__name__}"
            raise ConfigError(f"{source}: the top level must be a mapping of keys to values, found {found}.", source)
        data = _upgrade_legacy_keys(dict(data))
        # A SageMaker file's keys are all unknown here: say that SageMaker is the problem, not its keys.
        _parse_value("compute_environment", data.get("compute_environment", "LOCAL_MACHINE"), source)
        _reject_unknown_keys(data, source)
        if "distributed_type" not in data:
            message = f"{source}: the key 'distributed_type' is missing; {_allowed(DISTRIBUTED_TYPES)}."
            raise ConfigError(message, source, "distributed_type")
        values = {key: _parse_value(key, value, source) for key, value in data.items()}
        if "num_processes" not in values and values["distributed_type"] == "NO":
            values["num_processes"] = 1
        config = cls(**values, source=source)
        _check_machine_rank(config)
        return config

    def to_dict(self) -> dict[str, Any]:
        """The file's contents: every key except those that are None or an empty mapping (as HF writes it)."""
        result = {}
        for key in config_keys():
            value = getattr(self, key)
            if value is not None and value != {}:
                result[key] = copy.deepcopy(value)
        return result

    def check_supported(self) -> None:
        """Raise UnsupportedFeatureError when accel cannot run this setup; the error names the file and key.

        Refused: a `distributed_type` accel does not run (XLA, Megatron-LM, other devices) and an
        `mpirun_config` naming a hostfile (HF then launches through mpirun). A `parallelism_config` asking for
        more than data parallelism is refused when the launch settings are resolved (accel/cli/launch.py), where
        flags can override its keys. Loading accepts every value HF Accelerate writes; call this before acting on
        the config.
        """
        from accel.cli.refusals import DISTRIBUTED_TYPE_BACKENDS, refuse_backend

        source = self.source or "<config>"
        if self.distributed_type in DISTRIBUTED_TYPE_BACKENDS:
            backend = DISTRIBUTED_TYPE_BACKENDS[self.distributed_type]
            raise refuse_backend(backend, f"{source}: distributed_type: {self.distributed_type}")
        if self.mpirun_config.get("mpirun_hostfile"):
            raise refuse_backend("mpirun", f"{source}: mpirun_config.mpirun_hostfile")


_PARSERS = {f.name: f.metadata["parse"] for f in fields(ClusterConfig) if "parse" in f.metadata}


def config_keys() -> tuple[str, ...]:
    """The keys a config file may hold, in declaration order."""
    return tuple(_PARSERS)


def _upgrade_legacy_keys(data: dict) -> dict:
    # The conversions HF Accelerate applies to files written by its older versions.
    if "fp16" in data:
        fp16 = data.pop("fp16")
        data.setdefault("mixed_precision", "fp16" if fp16 is True else "no")
    if "dynamo_backend" in data:
        backend = data.pop("dynamo_backend")
        is_off = isinstance(backend, str) and backend.upper() == "NO"
        data.setdefault("dynamo_config", {} if is_off else {"dynamo_backend": backend})
    return data


def _reject_unknown_keys(data: dict, source: str) -> None:
    known = config_keys()
    unknown = sorted((key for key in data if key not in known), key=str)
    if not unknown:
        return
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(str(key), known, n=1)
        hints.append(f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key))
    message = f"{source}: unknown keys: {', '.join(hints)}; allowed keys: {', '.join(sorted(known))}."
    raise ConfigError(message, source, str(unknown[0]))


def _parse_value(key: str, value: Any, source: str) -> Any:
    try:
        return _PARSERS[key](value)
    except _Invalid as invalid:
        name = f"{key}.{invalid.subkey}" if invalid.subkey else key
        shown = invalid.value if invalid.has_value else value
        message = f"{source}: {name}: {shown!r} is not valid; {invalid.expected}."
        raise ConfigError(message, source, name) from None


def _check_machine_rank(config: ClusterConfig) -> None:
    if config.machine_rank >= config.num_machines:
        raise ConfigError(
            f"{config.source}: machine_rank: {config.machine_rank} is not valid; with num_machines "
            f"{config.num_machines} the rank must be between 0 and {config.num_machines - 1}.",
            config.source,
            "machine_rank",
        )


# --- files --------------------------------------------------------------------------------------------


def load_config(path: str | os.PathLike) -> ClusterConfig:
    """Read a config file: YAML, or JSON when the name ends in `.json` (as HF Accelerate does).

    Args:
        path: the file.

    Returns:
        The checked config; `config.source` is `path`.

    Raises:
        ConfigError: the file is missing or unreadable, is not valid YAML/JSON, or its contents are invalid
            (see `ClusterConfig.from_dict`).
    """
    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file; create one with `accel config`.", path) from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: cannot read the config file: {error}.", path) from None
    return ClusterConfig.from_dict(_parse_text(text, path), source=path)


def _parse_text(text: str, path: Path) -> Any:
    if path.suffix.lower() == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError(f"{path}: invalid JSON: {error}.", path) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: invalid YAML: {error}", path) from None


def save_config(config: ClusterConfig, path: str | os.PathLike) -> Path:
    """Write `config` to `path` atomically: YAML with sorted keys, or JSON when the name ends in `.json`.

    Parent folders are created. The text goes to a temporary file in the same folder, which then replaces
    `path`, so a reader never sees half a file and a failed write leaves the old file intact.

    Args:
        config: the config to write.
        path: the destination file.

    Returns:
        The path written.

    Raises:
        ConfigError: the file or its folder cannot be written.
    """
    path = Path(path).expanduser()
    if path.suffix.lower() == ".json":
        text = json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n"
    else:
        text = yaml.safe_dump(config.to_dict(), sort_keys=True, default_flow_style=False)
    try:
        _write_atomically(path, text)
    except OSError as error:
        raise ConfigError(f"{path}: cannot write the config file: {error}.", path) from None
    return path


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    # os.open with 0o666 lets the umask decide the final mode, as a plain open() would.
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


# --- default locations --------------------------------------------------------------------------------


def _cache_home() -> str:
    return os.environ.get("XDG_CACHE_HOME") or "~/.cache"


def default_config_path() -> Path:
    """Where accel reads and writes its config by default.

    Returns:
        `$ACCEL_CONFIG_FILE`, else `$XDG_CACHE_HOME/accel/default_config.yaml`, else
        `~/.cache/accel/default_config.yaml`. The file need not exist.
    """
    explicit = os.environ.get("ACCEL_CONFIG_FILE")
    if explicit:
        return Path(explicit).expanduser()
    return Path(_cache_home()).expanduser() / "accel" / CONFIG_FILE_NAME


def hf_default_config_path() -> Path:
    """Where HF Accelerate keeps its default config.

    Returns:
        `$HF_HOME/accelerate/default_config.yaml`, else
        `$XDG_CACHE_HOME/huggingface/accelerate/default_config.yaml`, else
        `~/.cache/huggingface/accelerate/default_config.yaml`. The file need not exist.
    """
    hf_home = os.environ.get("HF_HOME") or os.path.join(_cache_home(), "huggingface")
    return Path(hf_home).expanduser() / "accelerate" / CONFIG_FILE_NAME


def find_config_file() -> Path | None:
    """The config file to use when none is given: accel's default, else HF Accelerate's, else None."""
    for candidate in (default_config_path(), hf_default_config_path()):
        if candidate.is_file():
            return candidate
    return None
