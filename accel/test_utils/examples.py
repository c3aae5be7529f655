"""Checks that the `examples/complete_*_example.py` scripts hold everything each `examples/by_feature/*` script
adds to the plain `examples/nlp_example.py` (HF Accelerate's examples tests). `compare_against_test` is the check;
the other two functions cut a script into the part compared.
"""

from __future__ import annotations

import os

_DATALOADER_LINE = "train_dataloader, eval_dataloader = get_dataloaders(accelerator, batch_size)\n"
_TESTING_MARKER = "TESTING_MOCKED_DATALOADERS"


def get_function_contents_by_name(lines: list[str], name: str) -> list[str] | None:
    """The lines of function `name` ("training_function" or "main") in a script's `lines`: from its `def` up to the
    next `def main` (for training_function) or `if __name__` (for main); None when the script has no such function.

    Raises:
        ValueError: another name.
    """
    if name not in ("training_function", "main"):
        raise ValueError(f"Incorrect function name passed: {name}, choose either 'main' or 'training_function'")
    end = "def main" if name == "training_function" else "if __name__"
    found: list[str] | None = None
    for line in lines:
        if found is None:
            if f"def {name}" in line:
                found = [line]
        elif end in line:
            return found
        else:
            found.append(line)
    return None


def clean_lines(lines: list[str]) -> list[str]:
    """`lines` without comment lines and empty lines."""
    return [line for line in lines if not line.lstrip().startswith("#") and line != "\n"]


def _section(filename: str | os.PathLike, name: str) -> list[str]:
    with open(filename) as f:
        return clean_lines(get_function_contents_by_name(f.readlines(), name) or [])


def _new_lines(lines: list[str], template: list[str]) -> list[str]:
    """The lines of `lines` that the template lacks, leaving out the dataloader line and the testing-only block (the
    marker line and the line it guards)."""
    found, skip_next = [], False
    for line in lines:
        if skip_next:
            skip_next = False
        elif _TESTING_MARKER in line:
            skip_next = True
        elif line not in template and line.lstrip() != _DATALOADER_LINE:
            found.append(line)
    return found


def compare_against_test(
    base_filename: str | os.PathLike,
    feature_filename: str | os.PathLike,
    parser_only: bool,
    secondary_filename: str | os.PathLike | None = None,
) -> list[str]:
    """The lines `feature_filename` adds to `examples/nlp_example.py` (read from the current folder) that
    `base_filename` lacks: an empty list when the complete example has the feature.

    Args:
        base_filename: the complete example, e.g. "examples/complete_nlp_example.py".
        feature_filename: a by_feature script, e.g. "examples/by_feature/checkpointing.py".
        parser_only: compare the `main()` functions (argument parsing) instead of `training_function`.
        secondary_filename: the plain script the complete example extends when it is not nlp_example.py (e.g.
            "examples/cv_example.py"): lines specific to nlp_example are then not reported.
    """
    name = "main" if parser_only else "training_function"
    template_path = os.path.abspath(os.path.join("examples", "nlp_example.py"))
    template = _section(template_path, name)
    in_feature = _new_lines(_section(feature_filename, name), template)
    in_base = _new_lines(_section(base_filename, name), template)
    missing = [line for line in in_feature if line not in in_base]
    if secondary_filename is not None:
        secondary = _section(secondary_filename, name)
        with open(template_path) as f:
            template_only = [line for line in f.readlines() if line not in secondary]
        missing = [line for line in missing if line not in template_only]
    return missing
