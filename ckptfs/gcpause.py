"""Bursts that build or walk tens of thousands of small objects (a version's index and views, the
flatten of a large state) run with the cyclic garbage collector paused: they make no cycles, and
each collection it would start there traverses the whole heap of such objects again (half the
time of the views of a 40,000-tensor version went to it)."""
from __future__ import annotations

import contextlib
import gc
import threading

_lock = threading.Lock()
_depth = 0
_was_enabled = False


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
