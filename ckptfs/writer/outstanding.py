"""The saves of one writer that are not yet over, and the failures that no one has seen yet: the
one home of "no silent loss" (a job that drops its futures must not lose its checkpoints
without a word), which ``Writer.wait`` and so ``close`` raise."""
from __future__ import annotations

import threading

from ckptfs.writer.job import SaveFuture

FAILED_KEPT = 8  # background failures kept for wait() to raise, for memory


class Outstanding:
    """The futures of a writer's saves in flight, and of those that failed without their
    failure reaching a caller (the first FAILED_KEPT of them). Thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending: set[SaveFuture] = set()
        self._failed: list[SaveFuture] = []

    def add(self, future: SaveFuture) -> None:
        """A save begins."""
        with self._lock:
            self._pending.add(future)

    def discard(self, future: SaveFuture) -> None:
        """A save is over, and its outcome is its caller's (committed, or an error raised to it)."""
        with self._lock:
            self._pending.discard(future)

    def failed(self, future: SaveFuture) -> None:
        """A save is over and failed where its caller may not see it: kept for ``take``."""
        with self._lock:
            self._pending.discard(future)
            self._prune()
            if len(self._failed) < FAILED_KEPT:
                self._failed.append(future)

    def any(self) -> bool:
        """Whether a save is in flight."""
        with self._lock:
            return bool(self._pending)

    def take(self) -> tuple[list[SaveFuture], list[SaveFuture]]:
        """(the saves in flight, the failed ones kept, which are forgotten here)."""
        with self._lock:
            failed, self._failed = self._failed, []
            return list(self._pending), failed

    def prune(self) -> None:
        """Forget the kept failures that have been reported since (to a future's caller)."""
        with self._lock:
            self._prune()

    def _prune(self) -> None:
        self._failed = [f for f in self._failed if not f.failure_reported]
