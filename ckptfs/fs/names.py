"""The names of the mount's version directories, and the steps a user may name after them
(``1200`` or ``step-00001200``): shared by the tree and the CLI, which loads neither pyfuse3 nor
the tree to parse a step.
"""
from __future__ import annotations

LATEST = "latest"  # the directory of a model's newest version


def version_dirname(step: int) -> str:
    """``step-00001200``: zero-padded to at least 8 digits so that ``ls`` sorts versions."""
    return f"step-{step:08d}"


def step_of(text: str) -> int | None:
    """The step a user names: ``1200``, or a version directory's name ``step-00001200``; None
    for anything else."""
    digits = text[len("step-"):] if text.startswith("step-") else text
    return int(digits) if digits.isascii() and digits.isdigit() else None
