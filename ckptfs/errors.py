"""The exceptions ckptfs raises. Every message says what went wrong and what to do about it.

The FUSE layer maps these to errno in one place (``ckptfs.fs.errno_for``); the CLI prints the
message on one line and exits non-zero.
"""


class CkptfsError(Exception):
    """Base class of every error ckptfs raises on purpose."""


class RegionFormatError(CkptfsError):
    """The region is not a ckptfs region, or its metadata is damaged."""


class IncompatibleVersionError(RegionFormatError):
    """The region was written by a newer, incompatible ckptfs."""


class InvalidNameError(CkptfsError, ValueError):
    """A model name that cannot be stored (empty, '/', '..', control characters, too long)."""


class UnsupportedObjectError(CkptfsError, TypeError):
    """A leaf in the saved object that ckptfs cannot store safely; the message names its path."""


class CheckpointTooLargeError(CkptfsError):
    """The checkpoint does not fit in the model's slots."""


class RegionFullError(CkptfsError):
    """The region (or its model table) has no room for a new model ring."""


class NotFoundError(CkptfsError, LookupError):
    """A model or a version that the region does not hold (or no longer holds)."""


class BusyError(CkptfsError):
    """The operation conflicts with a pin or a save in flight (e.g. removing a pinned version)."""


class CorruptionError(CkptfsError):
    """Stored bytes do not match their checksums."""


class MalformedInputError(CkptfsError, ValueError):
    """An imported file is truncated, inconsistent or hostile; nothing was written."""
