"""Claim phase of a save, beside its snapshot: one thread per writer claims each save's slot
(region/ring.py's ``Ring.claim``) while the snapshot copies the tensors into staging buffers,
which need no slot. A claim reads the chosen slot's header (from the disk: the slot's last
O_DIRECT write left it out of the page cache) and the model's table entry: 1-2 ms of a save's
stall when it ran first, the longest part of what a GPU save did before its first copy.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

from ckptfs.region.claim import Claim
from ckptfs.writer.job import Job
from ckptfs.writer.threads import start_thread

log = logging.getLogger("ckptfs")


class Claimer:
    """Claims slots for jobs, one at a time in the order asked (so that the counters, which
    order versions, follow the order of the saves), on a thread of its own started on first
    need. Not a ThreadPoolExecutor: one refuses work once the interpreter is exiting, where a
    writer's last saves may still be made."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, job: Job, claim: Callable[[], Claim]) -> None:
        """Run ``claim()`` for ``job``; ``job.claimed`` completes with the claim or its error.
        A claim made for a job that failed meanwhile is aborted (its slot goes back)."""
        with self._lock:
            if self._thread is None:
                start_thread(self._loop, "ckptfs-claim", self._record)
        self._queue.put((job, claim))

    def _record(self, thread: threading.Thread) -> None:
        self._thread = thread

    def close(self) -> None:
        """Stop the thread after the claims asked for so far."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, claim = item
            _claim_for(job, claim)


def _claim_for(job: Job, claim: Callable[[], Claim]) -> None:
    try:
        got = claim()
    except BaseException as e:  # noqa: BLE001 - delivered through job.claimed
        job.claimed.set_exception(e)
        return
    with job.mutex:
        failed = job.error
        if failed is None:
            job.claim = got  # under the mutex: PersistPipeline.fail aborts it from here on
    if failed is not None:
        try:
            got.abort()
        except BaseException as e:  # noqa: BLE001 - the thread must live on and the job end
            log.error("the claim of %s step %d could not be given back (%s); the writer's close gives it back",
                      job.model, job.step, str(e) or type(e).__name__)
        finally:
            job.claimed.set_exception(failed)
    else:
        job.claimed.set_result(got)

