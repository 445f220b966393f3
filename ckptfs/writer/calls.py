"""A writer's life: the save() calls under way on its threads against its close (close waits for
the calls of other threads and refuses later ones: a save on another thread ran on into the
stopped workers, a hang in the claimer's close, leaked threads, closed descriptors), and the
writers still open when their store closes or the process exits.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import weakref

from ckptfs.errors import CkptfsError

log = logging.getLogger("ckptfs")
open_writers: "weakref.WeakSet" = weakref.WeakSet()  # every Writer of this process not closed yet


@atexit.register
def _commit_in_flight_at_exit() -> None:
    """A script that ends without closing its writer still gets its saves committed. Only this
    process's writers: a child forked while a save was in flight (a DataLoader worker) holds a
    copy of its parent's, whose threads did not come with it (its exit waited for them forever)."""
    pid = os.getpid()
    close_writers(lambda writer: writer._pid == pid, "at exit")


def close_writers(which, when: str) -> None:
    """Close every open writer for which ``which(writer)`` holds: its saves in flight committed,
    its workers stopped. A save that fails is logged (its future raised it to its caller)."""
    for writer in [w for w in list(open_writers) if which(w)]:
        try:
            writer.close()
        except (KeyboardInterrupt, SystemExit):
            # not a failed save: the wait for them was cut (a second Ctrl-C at exit, say)
            log.error("ckptfs: the wait for the saves of %s in flight was interrupted %s: the newest of them may "
                      "not be committed (`ckptfs ls %s` lists what is)", writer.model, when, writer.model)
        except BaseException as e:  # noqa: BLE001 - report and go on with the others
            log.error("ckptfs: a save of %s failed %s: %s", writer.model, when, e)


CLOSED = "this writer is closed; open a new one with store.writer(...)"


class SaveCalls:
    """The save() calls under way on one writer's threads, and whether its close began."""

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
