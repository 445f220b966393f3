"""Kept versions hidden by a new save of their step: a writer that saves a step again (a job
resumed from an earlier step redoes steps) makes the new version the one that step names, and
gives the earlier, kept one back to the ring (see ``Writer``), with a warning saying how to keep
the new one.
"""
from __future__ import annotations

import logging
import threading

from ckptfs.writer.job import SaveResult

log = logging.getLogger("ckptfs")


class HiddenKept:
    """One writer's look for kept versions its commits hide (``enabled`` False: never; the part
    models of a multi-rank checkpoint, whose leader decides)."""

    def __init__(self, model: str, enabled: bool):
        self._model = model
        self._enabled = enabled
        self._highest_step: int | None = None  # of the versions committed (None: not known yet)
        self._lock = threading.Lock()

    def after_commit(self, ring, result: SaveResult, kept: bool) -> None:
        """After the commit of ``result`` (``kept``: the new version is kept): the kept versions of
        its step that it hides go back to ``ring``, each with a warning. Only a step not above
        every step this writer saw committed can hide one: the first commit looks (reading the
        headers the ring holds, on the persist thread, not at the writer's opening), and then a
        training loop whose steps grow pays nothing. A failure is only logged: the save itself
        is durable and committed."""
        with self._lock:
            seen = self._highest_step
            if seen is not None:  # else known once a look is done: a commit meanwhile looks too
                self._highest_step = max(seen, result.step)
        if not self._enabled or (seen is not None and result.step > seen):
            return
        try:
            advice = "" if kept else f"; keep the new one with store.keep({self._model!r}, {result.step})"
            # the first look sweeps every step: a crash between a commit and its look left the
            # kept version it hid kept for good (listed nowhere, its slot never reused)
            hidden, highest = ring.give_back_hidden(result.step, result.counter, every_step=seen is None)
            with self._lock:
                self._highest_step = max(self._highest_step or highest, highest, result.step)
            for v in hidden:
                log.warning("ckptfs: step %d of %r was saved again: the earlier version of that step, a kept one, is "
                            "hidden by the new one and goes back to the ring%s", v.header.step, self._model,
                            advice if v.header.step == result.step else "")
        except Exception as e:  # noqa: BLE001 - an I/O error here must not keep the future from completing
            with self._lock:  # not looked again at every commit (a sweep of every header each time)
                self._highest_step = max(self._highest_step or result.step, result.step)
            log.warning("ckptfs: the kept versions of %r step %d that a new save of it hides could not be looked "
                        "for or given back: %s", self._model, result.step, e)
