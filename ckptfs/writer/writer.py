"""The writer's public face: ``save`` and its futures, backpressure, and the phases in order.

One ``save`` goes through (PCcheck §3.1, §4.1):
  1. plan (writer/plan.py): flatten and lay out the object; every refusal happens here;
  2. an in-flight permit (at most ``max_inflight`` saves; the next one waits), then a counter and
     a claimed slot from the model's ring (region/ring.py: not latest, not pinned, not claimed),
     on the writer's claim thread (writer/claimer.py) beside step 3;
  3. snapshot (writer/snapshot.py): copy the tensors chunk by chunk into staging buffers and hand
     each to the persist workers, which write nothing before the claim; ``save`` returns once
     both are done, or raises the claim's refusal (with ``async_snapshot`` the first three steps
     run on the writer's snapshot thread and ``save`` returns at once);
  4. persist (writer/persist.py): write each chunk at its place in the slot, CRC32 each tensor
     piece, and after the last chunk commit through the claim: data and index durable, header,
     latest pointer (region/ring.py owns that order).
"""
from __future__ import annotations

import functools
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import wait as wait_for_futures

import torch

from ckptfs.errors import BusyError, CkptfsError, NotFoundError, RegionFullError, in_words
from ckptfs.memcopy import default_copy_threads
from ckptfs.region.extents import default_ring_slots, least_ring_slots
from ckptfs.region.region import Region, validate_model_name
from ckptfs.region.ring import Ring
from ckptfs.views import checked_extra
from ckptfs.units import align_up
from ckptfs.writer.calls import SaveCalls, open_writers
from ckptfs.writer.claimer import Claimer
from ckptfs.writer.cuda import CallerMark, caller_mark
from ckptfs.writer.hidden import HiddenKept
from ckptfs.writer.job import Job, SaveFuture, SaveResult, check_options, is_kept
from ckptfs.writer.threads import start_thread, uninterrupted
from ckptfs.writer.outstanding import Outstanding
from ckptfs.writer.persist import PersistPipeline
from ckptfs.writer.plan import Planner, SavePlan
from ckptfs.writer.progress import ProgressBoard
from ckptfs.writer.snapshot import Snapshotter
from ckptfs.writer.staging import StagingPool

__all__ = ["DEFAULT_CHUNK_BYTES", "DEFAULT_PERSIST_THREADS", "SaveFuture", "SaveResult", "Writer"]

log = logging.getLogger("ckptfs")

DEFAULT_CHUNK_BYTES = 64 << 20
DEFAULT_PERSIST_THREADS = 2
SLOT_HEADROOM = 1.10  # slots sized at the first save leave room for the state to grow a little


class Writer:
    """Saves checkpoints of one model; several in flight. Use as a context manager.

    Tunables: ``max_inflight`` (N: saves persisting at once; the N+1st waits), ``persist_threads``
    (p: parallel writers to the region), ``chunk_bytes`` (pipeline granularity),
    ``staging_budget_bytes`` (hard cap on host staging memory; default: room for N snapshots of
    the first checkpoint, at most half of physical memory), ``slots`` (how many versions the ring keeps, default N+2; on an existing model a
    new count takes effect), ``slot_bytes`` (the least slot size; default: the first save's, and
    slots grow by themselves when a save outgrows them), ``keep_every`` (every save whose step
    is a multiple of it is kept, as ``save(..., keep=True)``), ``timeout_s`` (longest wait for a
    free slot, staging buffer or permit before BusyError).

    A step saved again (a job rolled back to an earlier version) hides the earlier version of that
    step: listings, loads and the mount show the newer. An earlier one that was kept would hold
    its slot, unseen, for good: it is given back to the ring, with a warning
    (``give_back_hidden=False`` leaves it kept: the part models of a multi-rank checkpoint, whose
    parts ckptfs.dist.parts gives back once no global version names them).

    A writer is its model's only one while open (BusyError for a second, in any process), except
    with ``sole=False``: the writers ckptfs keeps for multi-rank (DCP) saves, in the training
    process and in DCP's background process, whose global commit orders their versions.
    """

    def __init__(self, region: Region, model: str, *, max_inflight: int = 2,
                 persist_threads: int = DEFAULT_PERSIST_THREADS, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 staging_budget_bytes: int | None = None, slots: int | None = None,
                 slot_bytes: int | None = None, keep_every: int | None = None, timeout_s: float = 120.0,
                 give_back_hidden: bool = True, sole: bool = True):
        validate_model_name(model)
        check_options(max_inflight, persist_threads, chunk_bytes, staging_budget_bytes, slots, keep_every, slot_bytes,
                      timeout_s)
        region.check_writable("saved to")
        self.region = region
        self.model = model
        self.max_inflight = max_inflight
        self.chunk_bytes = chunk_bytes
        self.staging_budget_bytes = staging_budget_bytes
        self.timeout_s = timeout_s
        self.keep_every = keep_every
        self._slots = slots
        self._slot_bytes = slot_bytes
        self._hidden = HiddenKept(model, give_back_hidden)
        self._sole = sole
        self._setup_lock = threading.Lock()  # lazy set-up may race when save() is called from threads
        self._planner = Planner(model, chunk_bytes)
        self._progress = ProgressBoard(region.superblock.uuid, model)
        self._permits = threading.BoundedSemaphore(max_inflight)
        self._pools: dict[bool, StagingPool] = {}
        self._retired_pools: list[StagingPool] = []  # outgrown; closed with the writer
        self._outstanding = Outstanding()
        self._made_empty = False  # its ring was made for a model without a version (_remove_if_never_saved)
        self._closed = False  # refuses saves: close began
        self._stopped = False  # close ended: workers stopped, ring closed
        self._calls = SaveCalls()  # close waits for the save() calls of other threads
        self._close_lock = threading.RLock()
        self._pid = os.getpid()  # the process whose threads save (a forked child has none of them)
        self._thread = threading.local()  # .saving: this thread is inside save() (_not_within_save)
        # Background snapshots (async_snapshot) run in call order on one thread of their own.
        self._snapshot_queue: queue.SimpleQueue = queue.SimpleQueue()
        self._snapshot_thread: threading.Thread | None = None
        self._last_snapshot = None
        self._background: list[threading.Thread] = []  # prefill and prepare, joined at close
        self._ring: Ring | None = None
        self._name_held: int | None = None  # Region.hold_name's lock byte, until the model is made
        self._persist = PersistPipeline(persist_threads, self._progress, self._finish)
        self._claimer = Claimer()
        try:
            self._snapshotter = Snapshotter(self._persist.enqueue, self._persist.unpark, default_copy_threads(),
                                            timeout_s)
            entry = region.find(model)
            if entry is None and sole:  # the model is made at the first save: its name held till then
                entry, self._name_held = region.hold_name(model)
            if entry is not None:
                self._ring = region.ring(entry, timeout_s=timeout_s, sole=sole)
                self._ring.extents.fit_writer(slots, slot_bytes, max_inflight)
            self._start_prefill(entry)
        except BaseException:
            # an I/O error reading the model's slots: nothing was saved, and nothing of this
            # writer may outlive the error (its workers would wait forever, holding the region)
            self._stop()
            raise
        open_writers.add(self)

    # ------------------------------------------------------------------ public API
    def save(self, obj, step: int, *, async_snapshot: bool = False, extra: dict | None = None,
             keep: bool | None = None) -> SaveFuture:
        """Snapshot ``obj`` and persist it in the background as version ``step``.

        ``extra``: small files saved with the version, ``{name: str or JSON-able value}`` (e.g.
        ``{"config.json": model.config.to_dict()}``); the mount shows them in the version
        directory, and with a ``config.json`` an ``hf/`` directory that ``from_pretrained`` opens.
        ``keep``: keep this version (a milestone): it leaves the ring and stays until unkept
        (``Store.unkeep``) or removed; default: kept if ``step`` is a multiple of ``keep_every``.

        Everything that can be refused (unsupported leaves, a checkpoint too large for its
        slots, a full region) is refused before any write. Then:
          * by default ``save`` reads ``obj``, refuses it by raising, or copies the tensors out
            and returns: the caller may modify them right away;
          * with ``async_snapshot=True`` it returns at once, and ``obj`` is read, checked and
            copied on a background thread that overlaps the caller's next forward/backward
            (PCcheck §3.1). The caller must not modify ``obj`` (its tensors or its containers)
            until ``future.snapshotted`` completes (``wait_snapshot()``), i.e. it calls that before
            ``optimizer.step()``; a refusal is raised there and by ``future.result()``.
        A Ctrl-C inside ``save`` gives the save up, unless its snapshot had begun: then it goes
        on, and ``wait_snapshot``/``wait`` cover it.
        A bad ``step``, a bad ``extra`` or a closed writer raises here in both cases. The returned future completes
        with a SaveResult when the checkpoint is durable and committed, or with the error that
        stopped it.
        """
        if self._pid != os.getpid():
            raise CkptfsError(f"this writer of {self.model!r} belongs to the process that opened it (pid {self._pid}), "
                              "whose threads save; open a writer in this process (after that one closes)")
        self._not_within_save("save()")
        with self._calls.call(self._closed):
            self._thread.saving = True
            try:
                return self._save(obj, step, async_snapshot, extra, keep)
            finally:
                self._thread.saving = False

    def _not_within_save(self, what: str) -> None:
        """CkptfsError where this thread is inside one of this writer's save() calls: a signal
        handler (a preemption's SIGTERM) that saves or closes interrupts it, and would wait
        for the save it interrupted, which cannot go on until the handler returns."""
        if getattr(self._thread, "saving", False):
            raise CkptfsError(
                f"{what} was called while a save() of this writer runs on the same thread (from a signal handler?), "
                "and would wait for that save, which cannot go on until it returns: in the handler set a flag, "
                "and save from the training loop when it sees it")

    def _save(self, obj, step: int, async_snapshot: bool, extra: dict | None, keep: bool | None) -> SaveFuture:
        keep = is_kept(step, keep, self.keep_every)
        # sole=False: ckptfs's own writers of multi-rank saves, which record those in their files
        files = checked_extra(extra, records=not self._sole)
        started = time.perf_counter()
        future = SaveFuture()
        # with async_snapshot nothing else happens on the caller's thread: right after its
        # optimizer step has streamed the whole state through the caches, every object touched
        # here is a cache miss (flatten alone took 5x its warm time there)
        plan = None if async_snapshot else self._planner.plan(obj, step, files)
        last_snapshot = self._last_snapshot
        try:
            self._outstanding.add(future)
            if plan is not None:
                if (last_snapshot is not None and not last_snapshot.done()
                        and threading.current_thread() is not self._snapshot_thread):
                    # An async save still queued claims its slot first: the counters, and so
                    # latest, follow the order of the saves (the final save after a periodic
                    # async one was overtaken by it, and latest was the older step). Its snapshot
                    # is waited for, its copy with its claim (the claim is made beside the copy).
                    # Not on the snapshot thread (a save from a ``snapshotted`` callback): that
                    # would wait for itself.
                    wait_for_futures([last_snapshot])
                self._start(future, plan, started, keep=bool(keep))
            else:
                if self._snapshot_thread is None:
                    self._start_snapshot_thread()
                self._last_snapshot = future.snapshotted  # before the thread can take it: see wait_snapshot
                self._snapshot_queue.put((future, obj, step, files, bool(keep), started, caller_mark()))
        except BaseException as e:
            future.error_reported = True  # raised to the caller here (a synchronous save's refusal)
            # a Ctrl-C before _start or the snapshot thread took the save (SaveFuture.take): it
            # is given up here, or wait() would wait for it forever; once taken, it is theirs
            if not future.done():
                uninterrupted(functools.partial(self._give_up, future, e, last_snapshot))
            raise
        return future

    def prepare(self, obj) -> Future:
        """Get ready for saves of ``obj`` without saving it: make the save plan of its structure
        and fault in (for CUDA tensors: pin) the staging memory its saves use, on a thread of
        its own, so that the first save stalls no longer than the later ones. Without it the
        first save does both on the caller's thread: seconds for a state of GBs or of tens of
        thousands of tensors. Call it with the state as it will be saved (after the optimizer
        made its state: AdamW makes it at its first step), then go on training; its tensors are
        not read. The future resolves once both are ready, or with the error the first save
        would raise for ``obj`` (an unsupported leaf, say). The staging memory is what the
        writer holds anyway from its first save on (see the README)."""
        future: Future = Future()

        def run() -> None:
            try:
                plan = self._planner.plan(obj, 0)  # the structure and layout, cached for the saves
                if not plan.cuda_devices:
                    self._snapshotter.host_spans(plan)  # the copy's spans, cached for the same tensors
                self._pool(bool(plan.cuda_devices), plan.layout.data_bytes).prefill()
            except BaseException as e:  # noqa: BLE001 - delivered through the future
                future.set_exception(e)
            else:
                future.set_result(None)

        with self._calls.call(self._closed):  # refused once close began, which joins it otherwise
            self._in_background(run, "ckptfs-prepare")
        return future

    def wait_snapshot(self) -> None:
        """Block until the last background snapshot is taken (the tensors may then change);
        raises the error that stopped it, if any."""
        if self._last_snapshot is not None:
            self._last_snapshot.result()

    def wait(self) -> list[SaveResult]:
        """Block until every save so far is committed; re-raises the first failure not yet
        reported otherwise (by its future's ``result``/``exception``, ``wait_snapshot`` or an
        earlier ``wait``): a save that failed in the background after its caller let go of its
        future is raised here, and so by ``close`` and the end of a ``with`` block."""
        self._not_within_save("wait()")
        pending, failed = self._outstanding.take()
        results, first_error = [], None
        for fut in failed:
            if not fut.failure_reported:
                first_error = first_error or fut.exception()
        for fut in pending:
            try:
                results.append(fut.result())
            except BaseException as e:  # noqa: BLE001 - collected and re-raised below
                first_error = first_error or e
        self._outstanding.prune()  # those that failed while we waited were reported above
        if first_error is not None:
            raise first_error
        return results

    def saves_in_flight(self) -> bool:
        """Whether a save of this writer is not yet committed (or failed)."""
        return self._outstanding.any()

    def model_removed(self) -> bool:
        """Whether the model this writer saved to is gone (its ring keeps ``Store.remove_model``
        away while the writer is open, and ``mkfs --force`` refuses a region with one open; a
        region file replaced under it, or a damaged table, can still lose it):
        its next save would fail with NotFoundError (a new writer makes the model again)."""
        ring = self._ring
        if ring is None:
            return False
        try:
            ring.refresh()
            return False
        except NotFoundError:
            return True

    @property
    def closed(self) -> bool:
        """Whether close began: no save is taken any more."""
        return self._closed

    def close(self) -> None:
        """Wait for every save (the save() calls under way on other threads too; later ones
        are refused), then stop the workers and free the staging memory."""
        if self._stopped:
            return
        if self._pid != os.getpid():
            # a forked child's copy (Store.close there): its saves are the parent's, run by threads
            # that did not come with the fork; nothing to wait for or stop here
            self._closed = self._stopped = True
            return
        self._not_within_save("close()")
        self._calls.close()
        with self._close_lock:  # one close stops the workers; another returns once it has
            if self._stopped:
                return
            try:
                self.wait()
            finally:
                self._stop()

    def _stop(self) -> None:
        """Stop the workers and give back the staging memory, the ring (and with it the model,
        which may be removed from then on) and the progress file. Each step may run again: where
        one fails (a second Ctrl-C in close), the writer is not stopped yet, and a later close
        (or the exit hook: it stays in open_writers) takes it up; until then the ring stays open,
        as a worker may still write its slots."""
        self._closed = True  # no save from here on (see SaveCalls)
        try:
            if self._snapshot_thread is not None:
                self._snapshot_queue.put(None)
                self._snapshot_thread.join()
            self._claimer.close()
            self._persist.close()
            for thread in self._background:  # before the pools: a prepare may still make one
                thread.join()
            for pool in [*self._pools.values(), *self._retired_pools]:
                pool.close()
            # only once no worker writes: the ring's close lets go of its claims and the model
            if self._ring is not None:
                self._ring.close()
                self._remove_if_never_saved()
            self._let_go_of_name()
        finally:
            self._progress.close()
        self._stopped = True
        open_writers.discard(self)

    def _let_go_of_name(self) -> None:
        if self._name_held is not None:
            self.region.pins.release(self._name_held)
            self._name_held = None

    def _remove_if_never_saved(self) -> None:
        """A model no save had claimed a slot of when this writer made its ring (a new one) and
        that still has no version at close is removed, its slots back to the region: a first
        save that failed (its staging memory refused, say) gives back what it took; the empty
        model held its whole ring for good, and the next model found the region full. A writer
        shared with other processes (``sole=False``) leaves it to them."""
        if not (self._sole and self._made_empty):
            return
        try:
            if not self.region.committed(self.region.reload(self._ring.entry)):
                self.region.remove_model(self.model)
        except (BusyError, NotFoundError):
            pass  # another writer of it came meanwhile (it is theirs now), or it went
        except CkptfsError as e:  # the region failing (a media error): the save's own error stands
            log.warning("model %r, left without a version by its first save, could not be removed again: %s; "
                        "remove it once the region works again", self.model, e)

    def __enter__(self) -> "Writer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ one save
    def _start_snapshot_thread(self) -> None:
        with self._setup_lock:
            if self._snapshot_thread is None:
                start_thread(self._snapshot_loop, "ckptfs-snapshot", self._record_snapshot_thread)

    def _record_snapshot_thread(self, thread: threading.Thread) -> None:
        self._snapshot_thread = thread

    def _snapshot_loop(self) -> None:
        while True:
            item = self._snapshot_queue.get()
            if item is None:
                return
            future, obj, step, files, keep, started, mark = item
            if not future.take():
                continue  # its caller was interrupted and gave it up
            try:
                plan = self._planner.plan(obj, step, files)
            except BaseException as e:  # noqa: BLE001 - delivered through both futures
                self._drop(future, e)
                continue
            try:
                self._start(future, plan, started, background=True, mark=mark, keep=keep)
            except BaseException:  # noqa: BLE001 - _start failed both futures, or its job will
                pass

    def _start(self, future: SaveFuture, plan: SavePlan, started: float, background: bool = False,
               mark: CallerMark | None = None, keep: bool = False) -> None:
        """Slot layout, permit, claim and snapshot of one save; raises (and fails the futures)
        if any of them cannot be had. ``background``: the snapshot runs beside the caller's
        compute (async_snapshot), so it also takes the chunks' CRCs; ``mark``: where its CUDA
        copies start (see writer.cuda)."""
        try:
            future.taken = True  # its end is ours from here (see SaveFuture.take; set plainly: no lock on this thread)
            ring = self._ring_for(plan)
            slot_layout = ring.layout(plan.index_bytes, plan.layout.data_bytes)
            pool = self._pool(bool(plan.cuda_devices), plan.layout.data_bytes)
            if not self._permits.acquire(timeout=self.timeout_s):
                raise BusyError(f"{self.max_inflight} saves of {self.model!r} still in flight after {self.timeout_s} s")
        except BaseException as e:
            uninterrupted(functools.partial(self._drop, future, e))
            raise
        job = None
        try:
            job = Job(self.model, plan, future, started, background=background, keep=keep)
            # the slot is claimed beside the snapshot (staging buffers need none); its writes wait
            # for the claim, and the save is snapshotted once both are done
            self._claimer.submit(job, lambda: ring.claim(plan.step, slot_layout))
            self._persist.begin(job)
            with self._persist.gate.snapshot():
                self._snapshotter.take(job, pool, mark)
            job.claimed.result()
        except BaseException as e:
            uninterrupted(functools.partial(self._start_failed, job, future, e, background))
            if job is not None and job.error is not None and job.error is not e:
                raise job.error from None  # what stopped the save first: the claim's refusal, say
            raise
        try:
            self._snapshot_done(job, started)
        except BaseException:
            # a Ctrl-C here (the snapshotted future's callbacks run here too) left its CRCs
            # parked and the job waiting for them, with its permit, claim and buffers
            uninterrupted(functools.partial(self._snapshot_done, job, started))
            raise

    def _snapshot_done(self, job: Job, started: float) -> None:
        """A save's snapshot is taken: its stall told to ``snapshotted``, its parked CRCs taken.
        Idempotent."""
        if not job.stall_s:
            job.stall_s = time.perf_counter() - started
        try:
            job.future.snapshotted.set_result(job.stall_s)
        except InvalidStateError:
            pass  # the save failed while it was being snapshotted (that error stands), or set already
        self._persist.unpark(job)

    def _start_failed(self, job: Job | None, future: SaveFuture, error: BaseException,
                      background: bool = False) -> None:
        """A save whose permit is held failed before its snapshot was taken: its job (None: not
        made yet) fails, or the permit goes back; raised by ``_start`` (to save()'s caller, which
        then does not see it again from wait(); an async save's is wait()'s to raise)."""
        if job is None:
            self._permits.release()
            self._drop(future, error)
            return
        self._persist.fail(job, error, raised=not background)  # logged where no caller is told
        self._outstanding.discard(future)  # raised here: not again by wait() (as a refusal before any write)

    def _drop(self, future: SaveFuture, error: BaseException) -> None:
        """Fail a save that never got a slot."""
        self._outstanding.failed(future)
        future.fail(error)

    def _give_up(self, future: SaveFuture, error: BaseException, last_snapshot: Future | None) -> None:
        """A save whose caller was interrupted before its start took it: failed, forgotten, and
        ``wait_snapshot`` back on the one before it; one that was taken goes on."""
        if future.give_up(error):
            self._outstanding.discard(future)
            if self._last_snapshot is future.snapshotted:
                self._last_snapshot = last_snapshot

    def _finish(self, job: Job, result: SaveResult | None, error: BaseException | None) -> None:
        """The end of a save that had a permit (PersistPipeline's ``finish``)."""
        if job.claim is not None:
            self._progress.finish(job.claim.counter)
        self._permits.release()
        if error is not None:
            self._outstanding.failed(job.future)
        else:
            self._outstanding.discard(job.future)
        if error is not None:
            job.future.fail(error)
        else:
            self._made_empty = False  # it has a version now
            self._hidden.after_commit(self._ring, result, job.keep)
            job.future.set_result(result)

    # ------------------------------------------------------------------ ring and staging
    def _ring_for(self, plan: SavePlan) -> Ring:
        """The model's ring; the model is created at its first save, with slots sized for it."""
        with self._setup_lock:
            if self._ring is None:
                need = plan.slot_layout.slot_bytes
                nslots = self._slots or default_ring_slots(self.max_inflight)
                slot_bytes = max(self._slot_bytes or int(need * SLOT_HEADROOM), need)
                # fewer than asked for where the region is short, but never fewer than the least
                least = least_ring_slots(self.max_inflight)
                try:
                    entry = self.region.create_model(self.model, nslots, slot_bytes, min_slots=least)
                except RegionFullError as e:
                    fewer = self.max_inflight > 1  # at 1 there is no fewer to ask for
                    hint = in_words(python=f"; or fewer saves in flight: max_inflight={self.max_inflight} needs "
                                           f"{least} slots", cli="") if fewer else ""
                    raise RegionFullError(f"{e}{hint}") from None
                self._ring = self.region.ring(entry, timeout_s=self.timeout_s, sole=self._sole)
                self._let_go_of_name()  # the model's own lock byte holds from here
                # a model no save ever claimed a slot of (its counter word, not a read of every header)
                self._made_empty = self.region.counter_word(entry) == 0
            return self._ring

    def _start_prefill(self, entry) -> None:
        """For a model that has a version (a job resumed after a restart): make and fault in the
        host staging pool for checkpoints of that size on a thread of its own, while the job
        loads and takes its first steps, instead of in its first save's stall. A model without a
        version sizes its pool at ``prepare`` or at its first save. Not where CUDA is available:
        such a job snapshots through a pinned pool of its own, and a host pool made on a guess
        would hold memory twice."""
        latest = self.region.latest(entry) if entry is not None else None
        if latest is None or latest.header.data_bytes == 0 or torch.cuda.is_available():
            return
        self._in_background(self._pool(False, latest.header.data_bytes).prefill, "ckptfs-prefill")

    def _in_background(self, target, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._background.append(thread)

    def _pool(self, cuda: bool, data_bytes: int) -> StagingPool:
        """The staging pool for saves of ``data_bytes`` (of CUDA tensors: pinned). One made for a
        smaller state (a first save before the optimizer had state) is replaced once a save
        needs larger chunks or, with the default budget, a quarter more room: its buffers are
        given back as the saves in flight release them."""
        chunk = self._planner.chunk_bytes_for(data_bytes)
        budget = self.staging_budget_bytes
        if budget is None:
            physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            budget = min(self.max_inflight * align_up(max(data_bytes, 1), chunk), physical // 2)
        budget = max(budget, chunk)
        with self._setup_lock:
            pool = self._pools.get(cuda)
            # what the pool would hold: a budget between two multiples of the chunk holds the lower
            if pool is None or pool.chunk_bytes < chunk or budget // chunk * chunk > pool.budget_bytes * 5 // 4:
                if pool is not None:
                    pool.retire()
                    self._retired_pools = [p for p in self._retired_pools if p.holds_buffers] + [pool]
                pool = self._pools[cuda] = StagingPool(chunk, budget, pinned=cuda)
            return pool


