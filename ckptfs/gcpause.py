"""Bursts that build or walk tens of thousands of small objects (a version's index and views, the
flatten of a large state) run with the cyclic garbage collector paused: they make no cycles, and
each collection it would start there traverses the whole heap of such objects again (half the
time of the views of a 40,000-tensor version went to it).

A DCP load's planning runs in torch's code between the storage reader's calls, and makes enough
objects that a full collection of the process's heap (a quarter of a second in a process that has
imported transformers) comes in most loads: there the heap that existed when the load began is
frozen instead (``freeze_heap`` / ``thaw_heap``), so collections go on but walk only what the load
made."""
from __future__ import annotations

import contextlib
import gc
import threading
import weakref

_lock = threading.Lock()
_depth = 0
_was_enabled = False
_freeze_owner: object | None = None


@contextlib.contextmanager
def paused_gc():
    """Pause the cyclic GC for the block (nestable, across threads: it resumes, if it was on,
    when the last block in the process ends). Reference counting frees memory as usual."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()


def freeze_heap(owner: object) -> None:
    """Leave every object that exists now out of the cyclic GC's collections (``gc.freeze``)
    until ``thaw_heap(owner)``: collections meanwhile walk only the objects made since, and
    reference counting frees memory as usual. Nothing is done where someone else froze the heap
    (``gc.get_freeze_count()``: a process about to fork its workers). One hold per process: a
    second ``freeze_heap`` takes it over (a process's loads run one after another; one that failed
    before thawing is thawed by the next one's end)."""
    global _freeze_owner
    with _lock:
        if _freeze_owner is None:
            if gc.get_freeze_count():
                return
            gc.freeze()
        _freeze_owner = owner


def thaw_heap(owner: object) -> None:
    """End ``owner``'s hold, if it still has it (idempotent): the frozen objects are collected
    as before (``gc.unfreeze``)."""
    global _freeze_owner
    with _lock:
        if _freeze_owner is owner:
            _freeze_owner = None
            gc.unfreeze()


class HeapHold:
    """A DCP storage reader's hold of the frozen heap across one load at a time: ``freeze`` and
    ``thaw`` (``freeze_heap`` / ``thaw_heap``, idempotent), thawed too when the hold goes (its
    reader with it)."""

    def __init__(self):
        self._owner = object()
        weakref.finalize(self, thaw_heap, self._owner)

    def freeze(self) -> None:
        freeze_heap(self._owner)

    def thaw(self) -> None:
        thaw_heap(self._owner)
