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
import sys
import threading
import time
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


HOLD_LOOK_S = 0.25  # how often a hold looks whether the call it spans has returned


class GCHold:
    """A pause of the cyclic GC that spans calls (a DCP load's, from its start to the end of
    its reads, which torch's code runs between): ``hold(expire_s, frame)`` and ``release()``,
    both idempotent. A load that fails between the reader's calls never says so: the pause
    ends within HOLD_LOOK_S of the return (or raise) of ``frame``, the call that runs the load
    (DCP's ``_load_state_dict``), after ``expire_s`` at the latest, when the hold goes (its
    reader with it), or at its next ``hold`` or ``release``. (Only at ``expire_s``, the load's
    timeout_s, before: a failed load's reader, held by its exception's traceback, stayed, and
    the GC with it off for 300 s.)"""

    def __init__(self):
        self._state = _Hold()
        weakref.finalize(self, self._state.release)

    def hold(self, expire_s: float, frame=None) -> None:
        self._state.release()  # a hold an earlier, failed load left
        self._state.hold(expire_s, frame)

    def release(self) -> None:
        self._state.release()


def _running(thread_id: int, frame_id: int, code) -> bool:
    """Whether the frame of id ``frame_id`` running ``code`` is still on the stack of thread
    ``thread_id``. (Ids, not the frame: a reference to it would keep the load's locals.)"""
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        if id(frame) == frame_id and frame.f_code is code:
            return True
        frame = frame.f_back
    return False


class _Hold:
    def __init__(self):
        self._mutex = threading.Lock()
        self._done: threading.Event | None = None

    def hold(self, expire_s: float, frame=None) -> None:
        with self._mutex:
            if self._done is not None:
                return
            _pause()
            done = self._done = threading.Event()
        span = None if frame is None else (threading.get_ident(), id(frame), frame.f_code)
        deadline = time.monotonic() + expire_s

        def watch() -> None:
            while not done.wait(min(HOLD_LOOK_S, max(deadline - time.monotonic(), 0))):
                if time.monotonic() >= deadline or (span is not None and not _running(*span)):
                    self._end(done)
                    return

        threading.Thread(target=watch, name="ckptfs-gc-hold", daemon=True).start()

    def release(self) -> None:
        with self._mutex:
            done = self._done
        if done is not None:
            self._end(done)

    def _end(self, done: threading.Event) -> None:
        """End the hold whose event is ``done``, once (a release and its watcher may race)."""
        with self._mutex:
            if self._done is not done:
                return
            self._done = None
        done.set()
        _resume()
