"""The exceptions ckptfs raises. Every message says what went wrong and what to do about it.

The FUSE layer maps these to errno in one place (``ckptfs.fs.errors.errno_for``); the CLI prints the
message on one line and exits non-zero.

Advice names what the user can do in the words of the interface they used: ``in_words(python=
"pass force=True", cli="--force")`` gives the Python wording, or the CLI's while the ``ckptfs``
command runs (``cli_words()``: process-wide, as the command's threads raise too, and undone when
the command returns, so that a program calling it keeps the Python wording).
"""

import contextlib

_words = "python"


@contextlib.contextmanager
def cli_words():
    """While the block runs, advice in messages names CLI flags and commands (``ckptfs.cli.main``)."""
    global _words
    before, _words = _words, "cli"
    try:
        yield
    finally:
        _words = before


def in_words(*, python: str, cli: str) -> str:
    """The advice for the interface in use: ``cli`` in the ``ckptfs`` command, else ``python``."""
    return cli if _words == "cli" else python


class CkptfsError(Exception):
    """Base class of every error ckptfs raises on purpose."""


class RegionFormatError(CkptfsError):
    """The region is not a ckptfs region, or its metadata is damaged."""


class IncompatibleVersionError(RegionFormatError):
    """The region was written by a newer, incompatible ckptfs."""


class OldFormatError(IncompatibleVersionError):
    """The region uses an older format; ``ckptfs upgrade`` copies it into the current one."""


class InvalidNameError(CkptfsError, ValueError):
    """A model name that cannot be stored (empty, '/', '..', control characters, too long)."""


class UnsupportedObjectError(CkptfsError, TypeError):
    """A leaf in the saved object that ckptfs cannot store safely; the message names its path."""


class CheckpointTooLargeError(CkptfsError):
    """The checkpoint fits neither the model's slots nor the region's free space."""


class RegionFullError(CkptfsError):
    """The region (or its model table) has no room for a new model ring."""


class NotFoundError(CkptfsError, LookupError):
    """A model or a version that the region does not hold (or no longer holds)."""


class BusyError(CkptfsError):
    """The operation conflicts with a pin or a save in flight (e.g. removing a pinned version)."""


class HeldError(BusyError):
    """A version to open is held by a save for longer than a reader waits: its commit's barrier
    (a slow disk), or the claim of its slot by a save reusing it. Trying again resolves it."""


class CorruptionError(CkptfsError):
    """Stored bytes do not match their checksums."""


class PartGoneError(NotFoundError):
    """A part that a multi-rank version names is gone from its rank's part model (its slot was
    reused): that version can no longer be loaded, kept or become latest, as if it were
    removed. ``rank``: whose part."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


class RegionIOError(CkptfsError):
    """An I/O operation on the region failed (the device, a full or read-only filesystem, a
    region removed underneath). ``errno`` is the system's; ``operation`` names the call."""

    def __init__(self, message: str, errno: int, operation: str):
        super().__init__(message)
        self.errno = errno
        self.operation = operation


class StagingMemoryError(CkptfsError):
    """The host (or pinned) staging memory of a save could not be allocated."""


class MalformedInputError(CkptfsError, ValueError):
    """An imported file is truncated, inconsistent or hostile; nothing was written."""


# The not-found messages, worded once for the library, the CLI and the mount's log.
def no_model(model: str, region_path: str) -> NotFoundError:
    return NotFoundError(f"no model {model!r} in {region_path}; "
                         + in_words(python="Store.models() lists them", cli="`ckptfs ls` lists them"))


def no_version_yet(model: str) -> NotFoundError:
    return NotFoundError(f"{model!r} has no committed version yet")


def not_a_region(path: str, why: str) -> "RegionFormatError":
    """The error for a path that holds no ckptfs region (an empty file, another file, a
    directory), in the words of the interface in use."""
    return RegionFormatError(f"{path} is not a ckptfs region ({why}): " + in_words(
        python="give the path of a region, or make one with Store.create(path, size_bytes=...)",
        cli="give the path of a region (--region, or $CKPTFS_REGION); `ckptfs mkfs NEW_PATH` makes one"))


def no_step(model: str, step: int) -> NotFoundError:
    return NotFoundError(f"{model!r} has no step {step} (never saved, removed, or its slot was reused by a "
                         "newer save); " + in_words(python=f"Store.versions({model!r}) lists them",
                                                   cli=f"`ckptfs ls {model}` lists them"))


_WARNED: set[tuple] = set()  # (key, message) of the warnings this process gave (warn_once)
_WARNED_MAX = 10_000


def warn_once(logger, key, message: str) -> None:
    """Log ``message`` as a warning the first time this process meets it for ``key`` (e.g. the
    region's path): a damaged table entry or latest pointer is met at every scan of the region,
    and one command printed the same line up to 7 times."""
    if (key, message) in _WARNED:
        return
    if len(_WARNED) < _WARNED_MAX:
        _WARNED.add((key, message))
    logger.warning("%s", message)
