"""The save() calls under way on a writer's threads, against its close: close waits for the calls
of other threads and refuses later ones. (A save on another thread ran on into the stopped
workers: a hang in the claimer's close, leaked threads, closed descriptors.)
"""
from __future__ import annotations

import contextlib
import threading

from ckptfs.errors import CkptfsError

CLOSED = "this writer is closed; open a new one with store.writer(...)"


class SaveCalls:
    def __init__(self):
        self._cond = threading.Condition()
        self._running: dict[int, int] = {}  # thread ident -> its calls under way
        self._closing = False

    @contextlib.contextmanager
    def call(self, closed: bool):
        """Around one save() call; CkptfsError where the writer is ``closed`` or closing."""
        me = threading.get_ident()
        with self._cond:
            if closed or self._closing:
                raise CkptfsError(CLOSED)
            self._running[me] = self._running.get(me, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                left = self._running.pop(me) - 1
                if left:
                    self._running[me] = left
                self._cond.notify_all()

    def close(self) -> None:
        """Refuse later calls; wait for those under way on other threads. This thread's own
        count can only be left over (close is not called inside save(), and a Ctrl-C in the
        last lines of a call left it): it is dropped."""
        with self._cond:
            self._closing = True
            self._running.pop(threading.get_ident(), None)
            while self._running:
                self._cond.wait()
