"""Pins and exclusive claims as Linux open-file-description (OFD) byte-range locks.

Each slot of each model has one lock byte in a virtual range far past any real region offset
(locks are advisory and need not lie inside the file). Readers hold a shared lock on the byte
(a *pin*), a writer filling the slot holds an exclusive one. Because the kernel drops OFD locks
when the last descriptor of their open file description closes, the pins of a process that died
are released without any cleanup protocol, which is invariant 2's "a pin held by a process that
died is released".

OFD locks (unlike POSIX ``fcntl.lockf``) conflict between descriptors of the same process, so a
``load`` in the training process still protects its slot from that process's own writer.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import struct
import threading
import weakref

from ckptfs.errors import CkptfsError

log = logging.getLogger("ckptfs")

_FLOCK = struct.Struct("hhxxxxqqixxxx")  # struct flock on 64-bit Linux
META_LOCK_OFFSET = 1 << 40
MODEL_LOCK_BASE = META_LOCK_OFFSET + 1  # + a model's index: held exclusively by the ring open on it
SLOT_LOCK_BASE = 1 << 41
SLOT_LOCK_STRIDE = 1 << 16
NAME_LOCK_BASE = 1 << 42  # + a hash of a model's name: held by a writer of a model not made yet
EXCLUSIVE = -1  # LockSpace._counts value of a byte held exclusively


def any_lock_held(path: str) -> bool:
    """Whether any process holds a lock byte of the region at ``path`` (a writer's model, a
    claim, a pin, the table's lock); False where the file cannot be opened or has no OFD locks."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        probe = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, META_LOCK_OFFSET, 0, 0)  # length 0: to the end
        return _FLOCK.unpack(fcntl.fcntl(fd, fcntl.F_OFD_GETLK, probe))[0] != fcntl.F_UNLCK
    except OSError:
        return False
    finally:
        os.close(fd)


def slot_lock_offset(model_index: int, slot: int) -> int:
    return SLOT_LOCK_BASE + model_index * SLOT_LOCK_STRIDE + slot


def name_lock_offset(name: str) -> int:
    """The byte a writer of model ``name`` holds exclusively from its opening to its first save,
    which makes the model (and its own lock byte, ``model_lock_offset``): a second writer of a
    model without a version opened, and the first of the two to save refused the other's saves.
    40 bits of a hash of the name: two names share a byte once in 10**12."""
    return NAME_LOCK_BASE + int.from_bytes(hashlib.blake2b(name.encode(), digest_size=5).digest(), "little")


def model_lock_offset(model_index: int) -> int:
    """The byte a model's writer's ring holds exclusively while open (one writer per model), and
    a removal of the model for as long as it looks at the slots."""
    return MODEL_LOCK_BASE + model_index


def _fcntl_lock(fd: int, lock_type: int, offset: int, wait: bool) -> bool:
    cmd = fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK
    try:
        fcntl.fcntl(fd, cmd, _FLOCK.pack(lock_type, os.SEEK_SET, offset, 1, 0))
        return True
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


class LockSpace:
    """One open file description on the region, holding a set of lock bytes.

    Within one description a byte is either unlocked, shared or exclusive; a reference count
    per byte lets several pins of one process share a single shared lock. Locks of one
    description never conflict in the kernel (a second request converts the first), so the
    exclusion between threads of this process is this bookkeeping: ``_counts[offset]`` is the
    number of shared references, or EXCLUSIVE while an exclusive lock is held *or being taken*.
    """

    def __init__(self, path: str, writable: bool = True, *, pins_in_child: bool = True):
        # Exclusive (write) locks need a descriptor opened for writing.
        self._pins_in_child = pins_in_child  # see _after_fork_in_child
        self._flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC
        self._fd = os.open(path, self._flags)
        self._lost: OSError | None = None  # why a forked child has no descriptor (_after_fork_in_child)
        self._counts: dict[int, int] = {}
        self._inherited: dict[int, int] = {}  # a forked child's references to its parent's locks
        self._mutex = threading.Lock()
        _spaces.add(self)

    def another(self, *, pins_in_child: bool = True) -> "LockSpace":
        """A description of its own on the same open file, writable (for exclusive locks):
        through this one's descriptor, not the path, where another file may be by now (the
        region renamed, or removed and made again) or none (OSError)."""
        return LockSpace(f"/proc/self/fd/{self._descriptor()}", writable=True, pins_in_child=pins_in_child)

    def _after_fork_in_child(self) -> None:
        """In a child of ``fork``: the parent's description (and its locks) would be shared
        with the parent, so that an unlock here (the child closing a Version it inherited, or
        its own load of the same version ending) dropped the parent's pin, and its slot was
        reused under the parent's reads; and, the description kept open by a child that lives
        on (a DataLoader worker), a lock the parent let go by closing stayed held. The child
        takes a description of its own, and on it a pin of its own for each shared lock it
        inherited (``pins_in_child``: the Versions it inherited read the same slots through the
        inherited mapping, and hold them until closed, in any order with its own pins); the
        other references (exclusive ones, and a writer's ring's, whose threads stay with the
        parent: ``pins_in_child`` False) are the parent's, released here as bookkeeping only."""
        self._mutex = threading.Lock()  # another thread of the parent may have held it: gone here
        if self._fd < 0:
            return
        inherited, self._counts = self._counts, {}
        try:
            # the same file through the inherited descriptor (its path may be relative to a
            # directory the process has left since, or gone)
            own = os.open(f"/proc/self/fd/{self._fd}", self._flags)
        except OSError as e:
            # no description of its own (no descriptor left, no /proc): the parent's is let go,
            # unlocked by nothing here; every reference becomes bookkeeping, and a later lock
            # here fails (see _descriptor)
            self._counts = {}
            for offset, count in inherited.items():
                self._inherited[offset] = self._inherited.get(offset, 0) + (1 if count == EXCLUSIVE else count)
            os.close(self._fd)
            self._fd, self._lost = -1, e
            log.warning("ckptfs: a forked child could not reopen its region's descriptor (%s); it cannot read "
                        "versions there", e)
            return
        os.close(self._fd)  # only this child's reference: the parent's description stays open
        self._fd = own
        for offset, count in inherited.items():
            if count != EXCLUSIVE and self._pins_in_child and _fcntl_lock(self._fd, fcntl.F_RDLCK, offset, wait=False):
                self._counts[offset] = count  # the parent's pin holds off any exclusive lock
            else:
                self._inherited[offset] = self._inherited.get(offset, 0) + (1 if count == EXCLUSIVE else count)

    def _descriptor(self) -> int:
        """The descriptor to take a lock through; CkptfsError where there is none."""
        if self._fd < 0:
            if self._lost is not None:
                raise CkptfsError(f"this forked process could not reopen the region ({self._lost}); open a new "
                                  "ckptfs.Store in it to read the region")
            raise CkptfsError("this store is closed")
        return self._fd

    def try_shared(self, offset: int) -> bool:
        """Add a reference to a shared lock on ``offset``; False if someone holds it exclusively."""
        with self._mutex:
            count = self._counts.get(offset, 0)
            if count == EXCLUSIVE:
                return False  # this description holds it (or is taking it) exclusively
            if count > 0:
                self._counts[offset] = count + 1
                return True
            if not _fcntl_lock(self._descriptor(), fcntl.F_RDLCK, offset, wait=False):
                return False
            self._counts[offset] = 1
            return True

    def try_exclusive(self, offset: int, wait: bool = False) -> bool:
        """Take ``offset`` exclusively; False if anyone (this or another description) holds it."""
        with self._mutex:
            if self._counts.get(offset, 0) != 0:
                return False
            self._descriptor()
            # Reserve it before the (possibly blocking) fcntl, outside the mutex: a pin taken by
            # another thread of this process in between would otherwise be *converted* by the
            # kernel into this exclusive lock (found by tests/test_contention.py).
            self._counts[offset] = EXCLUSIVE
        try:
            ok = _fcntl_lock(self._fd, fcntl.F_WRLCK, offset, wait=wait)
        except BaseException:
            ok = False
            raise
        finally:
            if not ok:
                with self._mutex:
                    del self._counts[offset]
        return ok

    def downgrade(self, offset: int) -> None:
        """Turn the exclusive lock this description holds on ``offset`` into a shared one of one
        reference, atomically: no moment unlocked, when another could take it exclusively."""
        with self._mutex:
            if self._counts.get(offset, 0) != EXCLUSIVE:
                raise RuntimeError(f"lock byte {offset:#x} is not held exclusively")
            _fcntl_lock(self._fd, fcntl.F_RDLCK, offset, wait=False)  # a conversion: never conflicts
            self._counts[offset] = 1

    def release(self, offset: int) -> None:
        """Drop one reference; the lock goes when the last reference does."""
        with self._mutex:
            count = self._counts.get(offset, 0)
            if count == 0 and self._inherited.get(offset, 0) > 0:
                self._inherited[offset] -= 1  # the parent's lock, taken before the fork: its to release
                return
            if count == 0:
                raise RuntimeError(f"lock byte {offset:#x} is not held")
            if count > 1:
                self._counts[offset] = count - 1
                return
            del self._counts[offset]
            _fcntl_lock(self._fd, fcntl.F_UNLCK, offset, wait=False)

    def is_locked_by_others(self, offset: int, exclusive: bool = True) -> bool:
        """Whether another description holds a lock that conflicts with ``exclusive``/shared."""
        probe = _FLOCK.pack(fcntl.F_WRLCK if exclusive else fcntl.F_RDLCK, os.SEEK_SET, offset, 1, 0)
        result = fcntl.fcntl(self._descriptor(), fcntl.F_OFD_GETLK, probe)
        return _FLOCK.unpack(result)[0] != fcntl.F_UNLCK

    def close(self) -> None:
        """Let go of every lock (unlocked first: a forked process that still holds the
        description would keep them otherwise) and of the descriptor."""
        if self._fd >= 0:
            with self._mutex:
                for offset in self._counts:
                    _fcntl_lock(self._fd, fcntl.F_UNLCK, offset, wait=False)
                self._counts.clear()
            os.close(self._fd)
            self._fd = -1


_spaces: "weakref.WeakSet[LockSpace]" = weakref.WeakSet()  # every open LockSpace of this process


def _after_fork_in_child() -> None:
    for space in list(_spaces):
        space._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
