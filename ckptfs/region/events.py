"""The seam after commit: code that reacts to a committed version (a drain to a tier, a
differential chain, a CPU replica, the mount's refresh) subscribes here; the writer does not
know its subscribers.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Generic, TypeVar

log = logging.getLogger("ckptfs")

Event = TypeVar("Event")


class Subscribers(Generic[Event]):
    """In-process callbacks, called in subscription order on the thread that made the event
    (a persist worker for a commit: keep them short, or hand the work to a thread of your own).
    A callback that raises is logged and never fails the commit that it hears of: the version
    is durable and visible by then."""

    def __init__(self, what: str):
        self._what = what
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[Event], None]] = []

    def subscribe(self, callback: Callable[[Event], None]) -> Callable[[], None]:
        """Call ``callback(event)`` after each event from now on; returns the unsubscribe function."""
        with self._lock:
            self._callbacks.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._callbacks:
                    self._callbacks.remove(callback)

        return unsubscribe

    def notify(self, event: Event) -> None:
        with self._lock:
            callbacks = list(self._callbacks)
        for callback in callbacks:
            try:
                callback(event)
            except Exception:  # noqa: BLE001 - a subscriber's bug must not fail a durable commit
                log.exception("a subscriber of %s failed on %s", self._what, event)
