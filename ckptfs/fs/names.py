"""The names of the mount's version directories, and the steps a user may name after them
(``1200`` or ``step-00001200``): shared by the tree and the CLI, which loads neither pyfuse3 nor
the tree to parse a step.
"""
from __future__ import annotations

LATEST = "latest"  # the directory of a model's newest version
STEP_PREFIX = "step-"  # of a version directory's name


def version_dirname(step: int) -> str:
    """``step-00001200``: zero-padded to at least 8 digits so that ``ls`` sorts versions."""
    return f"{STEP_PREFIX}{step:08d}"


def _digits(text: str) -> int | None:
    return int(text) if text.isascii() and text.isdigit() else None


def dirname_step(name: str) -> int | None:
    """The step of a version directory's name (``step-00001200``, or unpadded); None for any
    other name."""
    return _digits(name[len(STEP_PREFIX):]) if name.startswith(STEP_PREFIX) else None


def step_of(text: str) -> int | None:
    """The step a user names: ``1200``, or a version directory's name ``step-00001200``; None
    for anything else."""
    return dirname_step(text) if text.startswith(STEP_PREFIX) else _digits(text)
