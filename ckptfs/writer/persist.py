"""Persist phase of a save: worker threads write the staged chunks into the claimed slot, take the
CRCs, and commit through the region's slot lifecycle (ckptfs.region.ring) after the last chunk.
``WriteGate`` paces the chunk writes against a snapshot copy the caller is waiting for; the CRCs of
chunks written while it runs are parked until it is taken (``PersistPipeline.unpark``).
"""
from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time
from typing import Callable

from ckptfs.chunks import Chunk, tensor_crcs
from ckptfs.manifest import Manifest
from ckptfs.writer.job import Job, SaveResult
from ckptfs.writer.progress import ProgressBoard
from ckptfs.writer.snapshot import piece_crcs
from ckptfs.writer.staging import StagingBuffer, StagingPool

log = logging.getLogger("ckptfs")

GATE_POLL_S = 0.005


class WriteGate:
    """While a snapshot copy runs, one chunk write at a time: the device's DMA and the writers'
    page pinning take memory bandwidth and a core from the copy the caller waits for (on the
    2-core hosts measured, two writes made the stall 1.3-1.8x a memcpy; one costs the durable
    time nothing measurable, as the copy is several times faster than the device). A snapshot
    starved of staging buffers lifts the limit, since only finished writes free buffers."""

    def __init__(self):
        self._cond = threading.Condition()
        self._snapshots_running = 0
        self._writes_in_flight = 0

    @contextlib.contextmanager
    def snapshot(self):
        """Around a snapshot copy."""
        with self._cond:
            self._snapshots_running += 1
        try:
            yield
        finally:
            with self._cond:
                self._snapshots_running -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def write(self, pool: StagingPool):
        """Around one chunk write; waits for the right to issue it."""
        with self._cond:
            while self._snapshots_running and self._writes_in_flight and not pool.starved:
                self._cond.wait(GATE_POLL_S)
            self._writes_in_flight += 1
        try:
            yield
        finally:
            with self._cond:
                self._writes_in_flight -= 1
                self._cond.notify_all()


Finish = Callable[[Job, "SaveResult | None", "BaseException | None"], None]


class PersistPipeline:
    """The persist workers of one writer. ``finish(job, result, error)`` is called exactly once
    per job that was ``begin``-ed: with a SaveResult after its commit, or with the error that
    stopped it (its claim aborted)."""

    def __init__(self, threads: int, progress: ProgressBoard, finish: Finish):
        self.gate = WriteGate()
        self._progress = progress
        self._finish = finish
        self._queue: queue.Queue = queue.Queue()
        # parked CRCs let go by a taken snapshot: taken before the queued chunks, as they hold
        # staging buffers the next snapshot may need (one queue token per item wakes a worker)
        self._unparked: collections.deque = collections.deque()
        self._workers = [threading.Thread(target=self._loop, name=f"ckptfs-persist-{i}", daemon=True)
                         for i in range(threads)]
        for w in self._workers:
            w.start()

    def begin(self, job: Job) -> None:
        """Queue the slot's preparation (ahead of every chunk of the job)."""
        self._progress.start(job.claim.counter, job.step, sum(c.length for c in job.chunks))
        self._queue.put(("begin", job))

    def enqueue(self, job: Job, chunk: Chunk, buf: StagingBuffer, pool: StagingPool, events, crcs) -> None:
        """Queue a filled staging buffer (see snapshot.Enqueue)."""
        self._queue.put(("chunk", job, chunk, buf, pool, events, crcs))

    def unpark(self, job: Job) -> None:
        """The snapshot of ``job`` is taken, failed, or waits for a staging buffer: its parked
        CRCs are queued ahead of the chunks, and its later chunks are checksummed as they are
        written. Idempotent."""
        with job.mutex:
            job.parking = False
            parked, job.parked = job.parked, []
        for chunk, buf, pool in parked:
            self._unparked.append((job, chunk, buf, pool, None))
            self._queue.put(("unparked", job))

    def close(self) -> None:
        for _ in self._workers:
            self._queue.put(None)
        for w in self._workers:
            w.join()

    # ------------------------------------------------------------------ workers
    def _loop(self) -> None:
        while True:
            # One parked CRC before each next item: taken by its token at the back of the queue,
            # behind the chunks queued meanwhile, the CRCs of every chunk written during the
            # snapshot were left for the end of the save (10-15 ms on one thread after the last
            # write, of a 0.4 s save); here they are taken while the other workers' writes keep
            # the device busy.
            try:
                parked = self._unparked.popleft()
            except IndexError:
                pass
            else:
                self._run("unparked", parked[0], parked)
            item = self._queue.get()
            if item is None:
                return
            kind, job = item[0], item[1]
            if kind == "unparked":
                try:
                    item = self._unparked.popleft()
                except IndexError:
                    continue  # another worker took it first
                job = item[0]
            self._run(kind, job, item)

    def _run(self, kind: str, job: Job, item: tuple) -> None:
        try:
            if kind == "begin":
                self._begin(job)
            elif kind == "unparked":
                self._checksum(*item)
            else:
                self._persist_chunk(job, *item[2:])
        except BaseException as e:  # noqa: BLE001 - delivered through the future
            self.fail(job, e)

    def _begin(self, job: Job) -> None:
        job.claim.begin()
        job.ready.set()
        if not job.chunks:
            self._commit(job)

    def _persist_chunk(self, job: Job, chunk: Chunk, buf: StagingBuffer, pool: StagingPool, events, crcs) -> None:
        try:
            for event in events:
                event.synchronize()
            job.ready.wait()
            if job.error is None:
                with self.gate.write(pool), memoryview(buf.mapping) as view:
                    job.claim.write(chunk.start, view[:chunk.length])
        except BaseException:
            pool.release(buf)
            raise
        if crcs is None and self._park(job, chunk, buf, pool):
            return
        self._checksum(job, chunk, buf, pool, crcs)

    @staticmethod
    def _park(job: Job, chunk: Chunk, buf: StagingBuffer, pool: StagingPool) -> bool:
        """Hold a written chunk's CRC (and its buffer) while the snapshot runs: on a CPU-only
        host the checksums would take cores from the copy the caller is waiting for. The worker
        goes on to write the next chunk meanwhile, so the device stays busy."""
        with job.mutex:
            if job.parking and job.error is None:
                job.parked.append((chunk, buf, pool))
                return True
        return False

    def _checksum(self, job: Job, chunk: Chunk, buf: StagingBuffer, pool: StagingPool, crcs) -> None:
        """Take a written chunk's CRCs (unless the snapshot did), give its buffer back, count it;
        the last chunk commits."""
        try:
            if job.error is not None:
                return
            if crcs is None:
                crcs = piece_crcs(buf, chunk)
        finally:
            pool.release(buf)
        with job.mutex:
            job.piece_crcs[chunk.start] = crcs
            job.chunks_left -= 1
            last = job.chunks_left == 0
        self._progress.advance(job.claim.counter, chunk.length)
        if last:
            self._commit(job)

    def _commit(self, job: Job) -> None:
        if job.error is not None:
            return
        claim, plan = job.claim, job.plan
        manifest = Manifest(claim.model, job.step, claim.counter, claim.time_ns, plan.layout.records,
                            plan.flat.skeleton, plan.layout.data_bytes, plan.files,
                            skeleton_json=plan.flat.skeleton_json)
        index = manifest.encode(plan.layout.tensors.with_crcs(
            tensor_crcs(job.chunks, job.piece_crcs, len(plan.layout.records))))
        committed = claim.commit(index, manifest.data_bytes, keep=job.keep)
        self._finish(job, SaveResult(claim.model, job.step, claim.counter, claim.slot, manifest.data_bytes,
                                     committed.published, job.stall_s, time.perf_counter() - job.started), None)

    def fail(self, job: Job, error: BaseException) -> None:
        """Stop ``job`` (once): its claim is aborted and its future fails with ``error``."""
        with job.mutex:
            if job.error is not None or job.future.done():
                return
            job.error = error
        job.ready.set()
        self.unpark(job)  # the parked buffers go back to the pool
        job.claim.abort()
        log.error("save of %s step %d failed: %s", job.claim.model, job.step, error)
        self._finish(job, None, error)
