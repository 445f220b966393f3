"""Persist phase of a save: worker threads write the staged chunks into the claimed slot, checksum
threads take their CRCs, and the last chunk's commits through the region's slot lifecycle
(ckptfs.region.ring). ``WriteGate`` paces the chunk writes against a snapshot copy the caller is
waiting for; the CRCs of chunks written while it runs are parked until it is taken
(``PersistPipeline.unpark``).
"""
from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from typing import Callable

from ckptfs.checksum import crc32_pieces
from ckptfs.chunks import Chunk, block_crcs, tensor_crcs
from ckptfs.writer.job import Job, SaveResult
from ckptfs.writer.progress import ProgressBoard
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
        self._workers = [threading.Thread(target=self._loop, name=f"ckptfs-persist-{i}", daemon=True)
                         for i in range(threads)]
        # The CRCs on threads of their own, so that a persist worker issues its next write as soon
        # as the last one is done: taken by the worker after each write, they left the device idle
        # while both workers checksummed (2 GiB flat, steady state: durable 0.40 s where the same
        # saves without CRCs took 0.35 s and the raw overwrite 0.30 s). The last chunk's checksum
        # commits the version: as many threads as writers, so that one save's commit waiting on
        # a slow barrier holds up neither the CRCs nor the commit of the next.
        # (threads of its own, not a ThreadPoolExecutor: saves drained at the interpreter's exit
        # still checksum, where an executor refuses new work)
        self._checksums: queue.Queue = queue.Queue()
        self._checksummers = [threading.Thread(target=self._checksum_loop, name=f"ckptfs-crc-{i}", daemon=True)
                              for i in range(threads)]
        for w in self._workers + self._checksummers:
            w.start()

    def begin(self, job: Job) -> None:
        """Queue the slot's preparation (ahead of every chunk of the job), once it is claimed."""
        self._queue.put(("begin", job))

    def enqueue(self, job: Job, chunk: Chunk, buf: StagingBuffer, pool: StagingPool, events, crcs) -> None:
        """Queue a filled staging buffer (see snapshot.Enqueue)."""
        self._queue.put(("chunk", job, chunk, buf, pool, events, crcs))

    def unpark(self, job: Job) -> None:
        """The snapshot of ``job`` is taken, failed, or waits for a staging buffer: its parked
        CRCs are taken now (their buffers then go back), and its later chunks are checksummed as
        they are written. Idempotent."""
        with job.mutex:
            job.parking = False
            parked, job.parked = job.parked, []
        for chunk, buf, pool in parked:
            self._checksums.put((job, chunk, buf, pool))

    def close(self) -> None:
        for _ in self._workers:
            self._queue.put(None)
        for w in self._workers:
            w.join()
        for _ in self._checksummers:  # after the workers: they queue checksums
            self._checksums.put(None)
        for w in self._checksummers:
            w.join()

    # ------------------------------------------------------------------ workers
    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            kind, job = item[0], item[1]
            try:
                if kind == "begin":
                    self._begin(job)
                else:
                    self._persist_chunk(job, *item[2:])
            except BaseException as e:  # noqa: BLE001 - delivered through the future
                self.fail(job, e)

    def _begin(self, job: Job) -> None:
        try:
            claim = job.claimed.result()  # claimed beside the snapshot, usually long since
        except BaseException as e:  # noqa: BLE001 - delivered through the future
            # Writer._start waits for the claim too, and raises its refusal to save()'s caller
            # (but for a background snapshot's): logged here too, it was said twice
            self.fail(job, e, raised=not job.background)
            return
        with job.mutex:  # a job failed meanwhile has finished (or will): nothing more to show
            if job.error is not None:
                return
            self._progress.start(claim.counter, job.step, sum(c.length for c in job.chunks))
        claim.begin()
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
        if crcs is not None:
            self._checksum(job, chunk, buf, pool, crcs)  # taken by the snapshot: only counted here
        elif not self._park(job, chunk, buf, pool):
            self._checksums.put((job, chunk, buf, pool))

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

    def _checksum_loop(self) -> None:
        """A checksum thread: ``_checksum`` of each written chunk queued; an error fails its job."""
        while True:
            item = self._checksums.get()
            if item is None:
                return
            job = item[0]
            try:
                self._checksum(*item, None)
            except BaseException as e:  # noqa: BLE001 - delivered through the future
                self.fail(job, e)

    def _checksum(self, job: Job, chunk: Chunk, buf: StagingBuffer, pool: StagingPool, crcs) -> None:
        """Take a written chunk's CRCs (unless the snapshot did), give its buffer back, count it;
        the last chunk commits."""
        try:
            if job.error is not None:
                return
            if crcs is None:
                crcs = crc32_pieces(buf.mapping, chunk.pieces)
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
        layout = plan.layout
        manifest = layout.manifest(claim.model, job.step, claim.counter, claim.time_ns, plan.flat, plan.files)
        blocks = block_crcs(layout.block_pieces, job.piece_crcs)
        index = manifest.encode(layout.tensors.with_crcs(
            tensor_crcs(job.chunks, job.piece_crcs, len(layout.records)),
            [crc for i in sorted(blocks) for _, crc in sorted(blocks[i].items())]))
        committed = claim.commit(index, manifest.data_bytes, keep=job.keep)
        self._finish(job, SaveResult(claim.model, job.step, claim.counter, claim.slot, manifest.data_bytes,
                                     committed.published, job.stall_s, time.perf_counter() - job.started), None)

    def fail(self, job: Job, error: BaseException, *, raised: bool = False) -> None:
        """Stop ``job`` (once): its claim is aborted and its future fails with ``error``, which
        is logged unless ``raised`` (raised to the caller of save() there: said twice, it was)."""
        with job.mutex:
            if job.error is not None or job.future.done():
                return
            job.error = error
        job.ready.set()
        try:
            self.unpark(job)  # the parked buffers go back to the pool
            if job.claim is not None:  # else a claim that ends from now on is aborted by the claimer
                job.claim.abort()
        except BaseException as e:  # noqa: BLE001 - the future must end, and the worker live on
            log.error("save of %s step %d: its slot could not be given back (%s); the writer's close "
                      "gives it back", job.model, job.step, str(e) or type(e).__name__)
        # str() of some errors is empty (KeyboardInterrupt): the type says what happened
        if not raised:
            log.error("save of %s step %d failed: %s", job.model, job.step, str(error) or type(error).__name__)
        self._finish(job, None, error)
