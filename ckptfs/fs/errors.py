"""The one place where exceptions become errno values for the kernel.

Every FUSE handler in :mod:`ckptfs.fs.ops` runs inside :func:`fuse_errors`, which turns whatever it
raises into ``pyfuse3.FUSEError(errno_for(exc))``. Code below the handlers (the tree, the Store,
the views) raises ordinary exceptions: ckptfs errors, or ``OSError`` subclasses that already carry
an errno (``FileNotFoundError``, ``NotADirectoryError``, ``IsADirectoryError``, or
``OSError(errno.EROFS, ...)``). Unexpected exceptions are logged with their traceback and reported
as EIO, so a bug never takes the mount down (pyfuse3 ends its main loop on any exception that is
not a FUSEError).
"""
from __future__ import annotations

import contextlib
import errno
import logging
from typing import Iterator

import pyfuse3

from ckptfs import errors as E

log = logging.getLogger("ckptfs.fs")

# Most specific first: the first matching class wins.
_ERRNO_OF: tuple[tuple[type[BaseException], int], ...] = (
    (E.NotFoundError, errno.ENOENT),
    (E.BusyError, errno.EBUSY),
    (E.InvalidNameError, errno.ENOENT),  # a name that cannot exist in the region is simply absent
    (E.CorruptionError, errno.EIO),
    (E.RegionFormatError, errno.EIO),
    (E.RegionFullError, errno.ENOSPC),
    (E.CheckpointTooLargeError, errno.EFBIG),
    (E.MalformedInputError, errno.EINVAL),
    (E.UnsupportedObjectError, errno.EINVAL),
    (E.CkptfsError, errno.EIO),
)


def errno_for(exc: BaseException) -> int:
    """The errno the kernel should see for ``exc``.

    FUSEError and OSError carry their own errno (EIO if an OSError has none); ckptfs errors map by
    class (NotFoundError -> ENOENT, BusyError -> EBUSY, CorruptionError -> EIO, ...); anything else
    is EIO.
    """
    if isinstance(exc, pyfuse3.FUSEError):
        return exc.errno
    if isinstance(exc, OSError):
        return exc.errno or errno.EIO
    if isinstance(exc, E.RegionIOError):
        return exc.errno
    for cls, code in _ERRNO_OF:
        if isinstance(exc, cls):
            return code
    return errno.EIO


def read_only(what: str) -> OSError:
    """The error for any attempt to change the tree other than removing a version (EROFS)."""
    return OSError(errno.EROFS, f"ckptfs mounts are read-only except `rm -r` of a version (with -o rw): {what}")


@contextlib.contextmanager
def fuse_errors(op: str) -> Iterator[None]:
    """Run a handler body; re-raise any exception as ``pyfuse3.FUSEError(errno_for(exc))``.

    Expected errors (ckptfs errors, OSError) are logged at debug level, but damage and I/O
    errors (a reader gets EIO: the log must say which tensor, which device) at warning level,
    each distinct one once; anything else is a bug and is logged with its traceback.
    """
    try:
        yield
    except pyfuse3.FUSEError:
        raise
    except (E.CkptfsError, OSError) as exc:
        if isinstance(exc, (E.CorruptionError, E.RegionIOError)) and _first_time(str(exc)):
            log.warning("%s: %s", op, exc)
        else:
            log.debug("%s: %s", op, exc)
        raise pyfuse3.FUSEError(errno_for(exc)) from None
    except Exception as exc:  # noqa: BLE001 - a bug must not end the mount
        log.exception("%s failed unexpectedly", op)
        raise pyfuse3.FUSEError(errno_for(exc)) from None


_said: set[str] = set()
SAID_MAX = 1000  # distinct warnings remembered (a region full of damage must not grow the daemon)


def _first_time(message: str) -> bool:
    """Whether ``message`` is new to this mount's log (then remembered)."""
    if message in _said or len(_said) >= SAID_MAX:  # past the cap: to the debug log, not again and again
        return False
    _said.add(message)
    return True
