"""Bursts that build or walk tens of thousands of small objects (a version's index and views, the
flatten of a large state) run with the cyclic garbage collector paused: they make no cycles, and
each collection it would start there traverses the whole heap of such objects again (half the
time of the views of a 40,000-tensor version went to it).

A DCP load's metadata and planning run in torch's code between the storage reader's calls, and
make enough objects that a full collection of the process's heap (a quarter of a second in a
process that has imported transformers) came in most loads: there the pause spans those calls
(``GCHold``), from DCP's start of the load to the end of its reads."""
from __future__ import annotations

import contextlib
import gc
import threading
import weakref

_lock = threading.Lock()
_depth = 0
_was_enabled = False


def _pause() -> None:
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1


def _resume() -> None:
    global _depth
    with _lock:
        _depth -= 1
        if _depth == 0 and _was_enabled:
            gc.enable()


@contextlib.contextmanager
def paused_gc():
    """Pause the cyclic GC for the block (nestable, across threads: it resumes, if it was on,
    when the last block or hold in the process ends). Reference counting frees memory as usual."""
    _pause()
    try:
        yield
    finally:
        _resume()


class GCHold:
    """A pause of the cyclic GC that spans calls (a DCP load's, from its start to the end of
    its reads, which torch's code runs between): ``hold(expire_s)`` and ``release()``, both
    idempotent. A load that fails between the reader's calls never says so: the pause ends
    after ``expire_s`` anyway, or when the hold goes (its reader with it), or at its next
    ``hold`` or ``release``."""

    def __init__(self):
        self._state = _Hold()
        weakref.finalize(self, self._state.release)

    def hold(self, expire_s: float) -> None:
        self._state.release()  # a hold an earlier, failed load left
        self._state.hold(expire_s)

    def release(self) -> None:
        self._state.release()


class _Hold:
    def __init__(self):
        self._mutex = threading.Lock()
        self._timer: threading.Timer | None = None

    def hold(self, expire_s: float) -> None:
        with self._mutex:
            if self._timer is None:
                _pause()
                self._timer = threading.Timer(expire_s, self.release)
                self._timer.daemon = True
                self._timer.name = "ckptfs-gc-hold"
                self._timer.start()

    def release(self) -> None:
        with self._mutex:
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
            _resume()
