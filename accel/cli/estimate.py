"""`accel estimate-memory MODEL`: how much memory a model needs, from its config alone.

The model is built on the meta device (`accel.big_modeling.init_empty_weights`), so no weights are downloaded
or allocated; the table is HF Accelerate's: per dtype, the largest layer (what `device_map="auto"` must fit on
one device), the total size, and training with Adam (float32: 4x the model, for weights, gradients and the two
Adam states; float16: HF's mixed-precision estimate of 2x the float32 size; int8/int4: N/A).

MODEL is a local folder holding a `config.json` (no network needed), or a Hugging Face Hub name. Differences
from HF Accelerate, which takes Hub names only: local folders work; without `--library_name` the library of a
local folder is read from its config.json (timm configs carry an `architecture` key), and that of a Hub name
from the Hub, with a clear error when the Hub cannot be reached. The table's last column is widened just
enough for a long title (HF widens it by twice the overflow).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from accel.cli.errors import CommandError
from accel.formatting import convert_bytes

DTYPES = ("float32", "float16", "int8", "int4")
_BYTES_DIVISOR = {"float32": 1, "float16": 2, "int8": 4, "int4": 8}
HEADERS = ("dtype", "Largest Layer", "Total Size", "Training using Adam")


# --- the model ------------------------------------------------------------------------------------------------


def _library_of_folder(folder: str) -> str:
    path = os.path.join(folder, "config.json")
    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except FileNotFoundError:
        raise CommandError(f"{folder}: no config.json; expected a model folder saved by transformers or timm") from None
    except (OSError, ValueError) as error:
        raise CommandError(f"{path}: cannot read the model config: {error}") from None
    return "timm" if "architecture" in config and "model_type" not in config else "transformers"


def _library_on_hub(model_name: str, access_token: str | None) -> Any:
    from huggingface_hub import model_info

    try:
        return model_info(model_name, token=access_token)
    except Exception as error:  # no network, unknown or gated repo: all end here with the reason
        raise CommandError(
            f"cannot look up {model_name!r} on the Hugging Face Hub ({type(error).__name__}: {error}). Give a local "
            "model folder, or --library_name with a model in the local Hub cache."
        ) from None


def _transformers_model(model_name: str, trust_remote_code: bool, access_token: str | None) -> Any:
    try:
        import transformers
    except ImportError:
        raise CommandError(f"to check {model_name!r}, install transformers (pip install transformers)") from None
    import torch

    from accel.big_modeling import init_empty_weights

    try:
        config = transformers.AutoConfig.from_pretrained(
            model_name, trust_remote_code=trust_remote_code, token=access_token
        )
    except (OSError, ValueError) as error:
        raise CommandError(f"cannot load the transformers config of {model_name!r}: {error}") from None
    auto_map = getattr(config, "auto_map", None) or {}
    # Remote code may name its own class; HF Accelerate takes the first AutoModelFor* entry too.
    name = next((key for key in auto_map if key.startswith("AutoModelFor")), "AutoModel")
    with init_empty_weights():
        # dtype: otherwise the config's own torch_dtype would halve the sizes of a half-precision checkpoint.
        return getattr(transformers, name).from_config(config, dtype=torch.float32, trust_remote_code=trust_remote_code)


def _timm_model(model_name: str) -> Any:
    try:
        import timm
    except ImportError:
        raise CommandError(f"to check {model_name!r}, install timm (pip install timm)") from None
    from accel.big_modeling import init_empty_weights

    if os.path.isdir(model_name):
        with open(os.path.join(model_name, "config.json"), encoding="utf-8") as handle:
            name = json.load(handle)["architecture"]
    else:
        name = model_name if ":" in model_name or "/" not in model_name else f"hf-hub:{model_name}"
    with init_empty_weights():
        return timm.create_model(name, pretrained=False)


def create_empty_model(
    model_name: str, library_name: str | None, trust_remote_code: bool = False, access_token: str | None = None
) -> Any:
    """The model `model_name` (a local folder or a Hub name) on the meta device, in float32.

    Args:
        model_name: a folder with a config.json, or a model name on the Hugging Face Hub.
        library_name: "transformers" or "timm"; None reads it from the folder's config or the Hub.
        trust_remote_code: allow transformers to run the modeling code of the repository.
        access_token: for private or gated Hub models.

    Raises:
        CommandError: the model, its library or its config cannot be found or read.
    """
    if library_name is None:
        if os.path.isdir(model_name):
            library_name = _library_of_folder(model_name)
        else:
            library_name = getattr(_library_on_hub(model_name, access_token), "library_name", None)
            if not library_name:
                raise CommandError(
                    f"{model_name!r} has no library on the Hub; pass --library_name (transformers, timm)"
                )
    print(f"Loading pretrained config for `{model_name}` from `{library_name}`...")
    if library_name == "transformers":
        return _transformers_model(model_name, trust_remote_code, access_token)
    if library_name == "timm":
        return _timm_model(model_name)
    raise CommandError(f"library {library_name!r} is not supported; use transformers or timm")


# --- the sizes ------------------------------------------------------------------------------------------------


def estimate_training_usage(bytes: int, mixed_precision: str, msamp_config: str | None = None) -> dict[str, int]:
    """HF Accelerate's training estimate for a model of `bytes` (float32 size), batch size 1: bytes per part
    ("model", "optimizer", "gradients", "step"); -1 where there is no estimate (int8, int4)."""
    sizes = {"model": -1, "optimizer": -1, "gradients": -1, "step": -1}
    if mixed_precision == "float32":
        sizes.update(model=bytes, gradients=bytes, optimizer=2 * bytes, step=4 * bytes)
    elif mixed_precision in ("float16", "bfloat16") or (mixed_precision == "fp8" and msamp_config is None):
        # Weights kept in fp32 and fp16; gradients 1.5x (weight gradient + the GEMM's); Adam's two fp32 states.
        sizes.update(model=bytes, gradients=bytes + bytes // 2, optimizer=2 * bytes, step=2 * bytes)
    return sizes


def gather_data(args: argparse.Namespace) -> list[list[Any]]:
    """Rows of [dtype, largest layer bytes, total bytes, training estimate dict], one per `args.dtypes`."""
    from accel.big_modeling import calculate_maximum_sizes

    model = create_empty_model(
        args.model_name, library_name=args.library_name, trust_remote_code=args.trust_remote_code
    )
    total, (largest, _) = calculate_maximum_sizes(model)
    return [
        [dtype, largest / _BYTES_DIVISOR[dtype], total / _BYTES_DIVISOR[dtype], estimate_training_usage(total, dtype)]
        for dtype in args.dtypes
    ]


# --- the table ------------------------------------------------------------------------------------------------


def render_table(headers: list[str] | tuple[str, ...], rows: list[list[str]], title: str) -> str:
    """A box-drawn table: the title, the centred headers, then the rows, HF Accelerate's layout."""
    widths = [max(len(text) for text in column) for column in zip(headers, *rows)]
    widths[-1] += max(0, len(title) - (sum(widths) + len(widths) - 1))

    def line(left: str, middle: str, right: str) -> str:
        return left + middle.join("─" * width for width in widths) + right

    def cells(texts: list[str] | tuple[str, ...]) -> str:
        return "│" + "│".join(text.center(width) for text, width in zip(texts, widths)) + "│"

    inner = sum(widths) + len(widths) - 1
    return "\n".join(
        [
            line("┌", "─", "┐"),
            "│" + title.center(inner) + "│",
            line("├", "┬", "┤"),
            cells(headers),
            line("├", "┼", "┤"),
            *(cells(row) for row in rows),
            line("└", "┴", "┘"),
        ]
    )


def _as_text(row: list[Any]) -> list[str]:
    dtype, largest, total, training = row
    usage = max(training.values())
    return [dtype, convert_bytes(largest), convert_bytes(total), convert_bytes(usage) if usage != -1 else "N/A"]


def run_estimate(args: argparse.Namespace) -> int:
    rows = [_as_text(row) for row in gather_data(args)]
    print(render_table(HEADERS, rows, f"Memory Usage for loading `{args.model_name}`"))
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_name", help="a local model folder (with config.json) or a model name on the Hub")
    parser.add_argument(
        "--library_name",
        "--library-name",
        choices=["timm", "transformers"],
        help="the model's library (default: read from the folder's config or the Hub)",
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=list(DTYPES),
        choices=DTYPES,
        help="the dtypes to estimate for (default: all four)",
    )
    parser.add_argument(
        "--trust_remote_code",
        "--trust-remote-code",
        action="store_true",
        default=False,
        help="allow the model repository's own modeling code to run (only for repositories you trust)",
    )


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "estimate-memory",
        help="estimate the memory a model needs, without loading it",
        description="Estimate the memory to load and train a model, built from its config on the meta device.",
        allow_abbrev=False,
    )
    add_arguments(parser)
    parser.set_defaults(run=run_estimate)
    return parser
