"""The writer: snapshot into staging chunks, persist in parallel, commit through the latest pointer.

One ``save`` goes through (PCcheck §3.1, §4.1):
  1. flatten and lay out the object; every check that can fail happens here, before any write;
  2. take an in-flight permit (at most ``max_inflight`` saves; the next one waits), a counter,
     and claim a free slot (not latest, not pinned, not claimed);
  3. snapshot: copy the tensors chunk by chunk into staging buffers (a side CUDA stream for GPU
     tensors; for CPU tensors the native multi-threaded copy of ckptfs.memcopy) and hand each
     chunk to the persist workers; ``save`` returns here. While a snapshot runs, only one chunk
     write is in flight, so the copy the caller waits for keeps the memory bandwidth;
  4. persist workers: O_DIRECT write of the chunk at its place in the slot, CRC32 of each tensor
     piece in it (taken by the snapshot itself when it runs in the background), buffer back to
     the pool;
  5. commit, by the worker that finishes the last chunk: data durable → header + manifest with
     the combined CRCs → durable → CAS the latest pointer if this counter is newer → pointer
     durable → release the claim → complete the future.
A slot that held a committed version is first marked WRITING (durably) so a crash mid-rewrite
never leaves an old header in front of half-new data.
"""
from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ckptfs.checksum import crc32
from ckptfs.chunks import Chunk, combine_piece_crcs, plan_chunks
from ckptfs.errors import BusyError, CheckpointTooLargeError, CkptfsError
from ckptfs.memcopy import copy_spans, default_copy_threads, host_bytes
from ckptfs.manifest import (DTYPE_NAMES, TENSOR_ALIGN_BYTES, EncodedTensors, Manifest, TensorRecord, align_up,
                             flatten)
from ckptfs.region.backend import aligned_buffer
from ckptfs.region.format import (COUNTER_MAX, SLOT_COMMITTED, SLOT_HEADER_BYTES, SLOT_WRITING, SLOTS_MAX,
                                  SlotHeader, pack_latest, slot_layout, unpack_latest)
from ckptfs.region.locks import LockSpace, slot_lock_offset
from ckptfs.region.region import Region, validate_model_name
from ckptfs.writer.cuda import CallerMark, SideStreams, caller_mark, copy_chunk_pieces
from ckptfs.writer.progress import ProgressBoard
from ckptfs.writer.staging import StagingBuffer, StagingPool

log = logging.getLogger("ckptfs")

_open_writers: "weakref.WeakSet[Writer]" = weakref.WeakSet()


@atexit.register
def _commit_in_flight_at_exit() -> None:
    """A script that ends without closing its writer still gets its saves committed."""
    for writer in list(_open_writers):
        try:
            writer.close()
        except BaseException as e:  # noqa: BLE001 - report and go on with the others
            log.error("ckptfs: a save of %s failed at exit: %s", writer.model, e)


DEFAULT_CHUNK_BYTES = 64 << 20
DEFAULT_PERSIST_THREADS = 2
SLOT_HEADROOM = 1.10  # slots sized at the first save leave room for the state to grow a little


class SaveFuture(Future):
    """The future of one save; ``snapshotted`` completes (with the stall in seconds) once the
    tensors have been copied out and may be modified."""

    def __init__(self):
        super().__init__()
        self.snapshotted: Future = Future()


@dataclass(frozen=True)
class SaveResult:
    """What a completed save future returns."""

    model: str
    step: int
    counter: int
    slot: int
    nbytes: int
    published: bool  # False: a newer checkpoint was already latest when this one committed
    stall_s: float
    durable_s: float


@dataclass(frozen=True)
class _Layout:
    """Where each tensor of one object structure goes; shared by the saves of that structure."""

    records: tuple[TensorRecord, ...]
    data_bytes: int
    chunks: list[Chunk]
    tensors: EncodedTensors  # the index's tensor array: its length sizes the index, commit fills its CRCs


@dataclass(frozen=True)
class _SavePlan:
    """One save, checked and laid out; nothing has been claimed or written for it yet."""

    entry: object
    step: int
    flat: object  # manifest.Flattened
    layout: _Layout
    data_offset: int  # where the tensor bytes start within the slot

    @property
    def cuda_devices(self) -> set[int]:
        return {d.index for d in self.flat.devices if d.type == "cuda"}


@dataclass
class _InFlight:
    entry: object
    slot: int
    counter: int
    step: int
    time_ns: int
    manifest: Manifest
    layout: _Layout
    future: Future
    started: float
    chunks_left: int
    data_offset: int = 0  # where the tensor bytes start within the slot
    ready: threading.Event = field(default_factory=threading.Event)
    snapshot_taken: threading.Event = field(default_factory=threading.Event)
    piece_crcs: list = field(default_factory=list)
    error: BaseException | None = None
    stall_s: float = 0.0
    crc_in_snapshot: bool = False  # see _snapshot
    mutex: threading.Lock = field(default_factory=threading.Lock)


def _lay_out(names: list[str], tensors: list[torch.Tensor], chunk_bytes_for) -> _Layout:
    """Tensor offsets (64-byte aligned, in object order) and the chunks that cover them;
    ``chunk_bytes_for(data_bytes)`` gives the chunk size."""
    records, offset = [], 0
    for name, t in zip(names, tensors):
        offset = align_up(offset, TENSOR_ALIGN_BYTES)
        nbytes = t.numel() * t.element_size()
        records.append(TensorRecord(name, DTYPE_NAMES[t.dtype], tuple(t.shape), offset, nbytes))
        offset += nbytes
    return _Layout(tuple(records), offset, plan_chunks(records, offset, chunk_bytes_for(offset)),
                   EncodedTensors.of(records))


def _byte_source(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor, without a copy when it is contiguous."""
    # Conjugate / negative views are lazy bits on top of the storage: materialize them, as the
    # bytes must hold the values the caller sees.
    t = t.detach().resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return t.reshape(-1).view(torch.uint8)


class Writer:
    """Saves checkpoints of one model; several in flight. Use as a context manager.

    Tunables: ``max_inflight`` (N: saves persisting at once; the N+1st waits), ``persist_threads``
    (p: parallel writers to the region), ``chunk_bytes`` (pipeline granularity),
    ``staging_budget_bytes`` (hard cap on host staging memory; default: room for N snapshots of
    the first checkpoint, at most half of physical memory), ``slots`` / ``slot_bytes`` (ring
    geometry when the model is created; default N+2 slots sized at the first save),
    ``timeout_s`` (longest wait for a free slot, staging buffer or permit before BusyError).
    """

    def __init__(self, region: Region, model: str, *, max_inflight: int = 2,
                 persist_threads: int = DEFAULT_PERSIST_THREADS, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 staging_budget_bytes: int | None = None, slots: int | None = None,
                 slot_bytes: int | None = None, timeout_s: float = 120.0):
        validate_model_name(model)
        _positive("max_inflight", max_inflight)
        _positive("persist_threads", persist_threads)
        _positive("chunk_bytes", chunk_bytes)
        if chunk_bytes % 4096:
            raise ValueError(f"chunk_bytes must be a multiple of 4096, got {chunk_bytes}")
        if slots is not None and not max_inflight + 1 <= slots <= SLOTS_MAX:
            raise ValueError(f"slots={slots} must be between max_inflight+1={max_inflight + 1} and {SLOTS_MAX}: "
                             "N checkpoints in flight need N+1 slots so the latest is never overwritten")
        if staging_budget_bytes is not None and staging_budget_bytes < chunk_bytes:
            raise ValueError(f"staging_budget_bytes={staging_budget_bytes} is smaller than one chunk ({chunk_bytes})")
        if not region.writable:
            raise CkptfsError(f"{region.path} is open read-only; open the store writable to save")
        self.region = region
        self.model = model
        self.max_inflight = max_inflight
        self.chunk_bytes = chunk_bytes
        self.staging_budget_bytes = staging_budget_bytes
        self.timeout_s = timeout_s
        self._slots = slots
        self._slot_bytes = slot_bytes
        self._entry = region.find(model)
        if self._entry is not None:
            self._recover_counter()
        self._claims = LockSpace(region.path, writable=True)
        self._progress = ProgressBoard(region.superblock.uuid, model)
        self._permits = threading.BoundedSemaphore(max_inflight)
        self._pools: dict[bool, StagingPool] = {}
        self._queue: queue.Queue = queue.Queue()
        self._outstanding: set[Future] = set()
        self._outstanding_lock = threading.Lock()
        self._closed = False
        self._workers = [threading.Thread(target=self._persist_loop, name=f"ckptfs-persist-{i}", daemon=True)
                         for i in range(persist_threads)]
        for w in self._workers:
            w.start()
        self._side_streams = SideStreams()
        # Background snapshots (async_snapshot) run in call order on one thread of their own.
        self._snapshot_queue: queue.SimpleQueue = queue.SimpleQueue()
        self._snapshot_thread: threading.Thread | None = None
        self._last_snapshot: Future | None = None
        self._setup_lock = threading.Lock()  # lazy set-up may race when save() is called from threads
        self._effective_chunk_bytes: int | None = None
        self._copy_threads = default_copy_threads()
        self._slot_age_cache: list[int] | None = None
        self._layout_cache: tuple[tuple, _Layout] | None = None
        # While a snapshot copy runs, one chunk write at a time (see _enter_write).
        self._write_gate = threading.Condition()
        self._snapshots_running = 0
        self._writes_in_flight = 0
        _open_writers.add(self)

    # ------------------------------------------------------------------ public API
    def save(self, obj, step: int, *, async_snapshot: bool = False) -> "SaveFuture":
        """Snapshot ``obj`` and persist it in the background as version ``step``.

        Everything that can be refused (unsupported leaves, a checkpoint too large for its
        slots, a full region) is refused before any write. Then:
          * by default ``save`` reads ``obj``, refuses it by raising, or copies the tensors out
            and returns: the caller may modify them right away;
          * with ``async_snapshot=True`` it returns at once, and ``obj`` is read, checked and
            copied on a background thread that overlaps the caller's next forward/backward
            (PCcheck §3.1). The caller must not modify ``obj`` (its tensors or its containers)
            until ``future.snapshotted`` completes (``wait_snapshot()``), i.e. it calls that before
            ``optimizer.step()``; a refusal is raised there and by ``future.result()``.
        A bad ``step`` or a closed writer raises here in both cases. The returned future completes
        with a SaveResult when the checkpoint is durable and committed, or with the error that
        stopped it.
        """
        if self._closed:
            raise CkptfsError("this writer is closed; open a new one with store.writer(...)")
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 1 << 62:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        started = time.perf_counter()
        future = SaveFuture()
        if not async_snapshot:
            plan = self._plan_save(obj, step)
            self._register(future)
            self._start(future, plan, started)
            return future
        # Nothing else happens on the caller's thread: right after its optimizer step has
        # streamed the whole state through the caches, every object touched here is a cache
        # miss (flatten alone took 5x its warm time there).
        self._register(future)
        if self._snapshot_thread is None:
            self._start_snapshot_thread()
        self._snapshot_queue.put((future, obj, step, started, caller_mark()))
        self._last_snapshot = future.snapshotted
        return future

    def wait_snapshot(self) -> None:
        """Block until the last background snapshot is taken (the tensors may then change);
        raises the error that stopped it, if any."""
        if self._last_snapshot is not None:
            self._last_snapshot.result()

    def _register(self, future: "SaveFuture") -> None:
        with self._outstanding_lock:
            self._outstanding.add(future)

    def _start_snapshot_thread(self) -> None:
        with self._setup_lock:
            if self._snapshot_thread is None:
                thread = threading.Thread(target=self._snapshot_loop, name="ckptfs-snapshot", daemon=True)
                thread.start()
                self._snapshot_thread = thread

    def _snapshot_loop(self) -> None:
        while True:
            item = self._snapshot_queue.get()
            if item is None:
                return
            future, obj, step, started, mark = item
            try:
                plan = self._plan_save(obj, step)
                self._start(future, plan, started, background=True, mark=mark)
            except BaseException as e:  # noqa: BLE001 - delivered through both futures
                if not future.done():
                    self._drop(future, e)

    def _plan_save(self, obj, step: int) -> _SavePlan:
        """Flatten and lay out ``obj``; raises every refusal (before anything is claimed)."""
        flat = flatten(obj)
        for device in flat.devices:
            if device.type not in ("cpu", "cuda"):
                raise CkptfsError(f"tensors on {device} are not supported yet; move them to cpu or cuda")
        layout = self._layout(flat)
        probe = Manifest(self.model, step, COUNTER_MAX, time.time_ns(), layout.records, flat.skeleton,
                         layout.data_bytes)
        # The probe has the widest counter, so its index is at least as long as the real one:
        # its length fixes the slot layout, and the real index is encoded once, at commit.
        _, data_offset, need = slot_layout(probe.encoded_length(layout.tensors.text), layout.data_bytes)
        entry = self._ensure_model(need)
        if need > entry.slot_bytes:
            raise CheckpointTooLargeError(
                f"this checkpoint of {self.model!r} needs {need} bytes but its slots hold {entry.slot_bytes}; "
                f"remove the model (`ckptfs rm {self.model}`) and save again (slots are sized at the first save), "
                "or pass a larger slot_bytes when the model is first created")
        return _SavePlan(entry, step, flat, layout, data_offset)

    def _start(self, future: "SaveFuture", plan: _SavePlan, started: float, background: bool = False,
               mark: CallerMark | None = None) -> None:
        """Permit, counter, slot claim and snapshot of one save; raises (and fails the futures)
        if any of them cannot be had. ``background``: the snapshot runs beside the caller's
        compute (async_snapshot), so it also takes the chunks' CRCs; ``mark``: where its CUDA
        copies start (see writer.cuda)."""
        entry, layout = plan.entry, plan.layout
        try:
            pool = self._pool(bool(plan.cuda_devices), layout.data_bytes)
            if not self._permits.acquire(timeout=self.timeout_s):
                raise BusyError(f"{self.max_inflight} saves of {self.model!r} still in flight after {self.timeout_s} s")
        except BaseException as e:
            self._drop(future, e)
            raise
        try:
            counter = self.region.next_counter(entry)
            slot = self._claim_slot(entry)
        except BaseException as e:
            self._permits.release()
            self._drop(future, e)
            raise
        time_ns = time.time_ns()
        manifest = Manifest(self.model, plan.step, counter, time_ns, layout.records, plan.flat.skeleton,
                            layout.data_bytes)
        job = _InFlight(entry, slot, counter, plan.step, time_ns, manifest, layout, future, started,
                        chunks_left=len(layout.chunks), data_offset=plan.data_offset, crc_in_snapshot=background)
        job.piece_crcs = [[] for _ in layout.records]
        self._progress.start(counter, plan.step, sum(c.length for c in layout.chunks))
        self._queue.put(("prepare", job))
        try:
            self._snapshot_gated(job, plan, pool, mark)
        except BaseException as e:
            self._fail(job, e)
            raise
        job.stall_s = time.perf_counter() - started
        future.snapshotted.set_result(job.stall_s)
        job.snapshot_taken.set()

    def _drop(self, future: "SaveFuture", error: BaseException) -> None:
        """Fail a save that never got a slot."""
        with self._outstanding_lock:
            self._outstanding.discard(future)
        if not future.snapshotted.done():
            future.snapshotted.set_exception(error)
        future.set_exception(error)

    def wait(self) -> list[SaveResult]:
        """Block until every save so far is committed; re-raises the first failure."""
        with self._outstanding_lock:
            pending = list(self._outstanding)
        results, first_error = [], None
        for fut in pending:
            try:
                results.append(fut.result())
            except BaseException as e:  # noqa: BLE001 - collected and re-raised below
                first_error = first_error or e
        if first_error is not None:
            raise first_error
        return results

    def close(self) -> None:
        """Wait for every save, then stop the workers and free the staging memory."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            _open_writers.discard(self)
            if self._snapshot_thread is not None:
                self._snapshot_queue.put(None)
                self._snapshot_thread.join()
            for _ in self._workers:
                self._queue.put(None)
            for w in self._workers:
                w.join()
            for pool in self._pools.values():
                pool.close()
            self._claims.close()
            self._progress.close()

    def __enter__(self) -> "Writer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ model and slots
    def _recover_counter(self) -> None:
        highest = max((v.header.counter for v in self.region.committed(self._entry)), default=0)
        latest = unpack_latest(self.region.latest_word(self._entry))
        self.region.raise_counter(self._entry, max(highest, latest[0] if latest else 0))

    def _ensure_model(self, need_bytes: int):
        with self._setup_lock:
            if self._entry is None:
                nslots = self._slots or self.max_inflight + 2
                slot_bytes = self._slot_bytes or int(need_bytes * SLOT_HEADROOM)
                self._entry = self.region.create_model(self.model, nslots, max(slot_bytes, need_bytes))
                self._recover_counter()
            return self._entry

    def _claim_slot(self, entry) -> int:
        """Claim the free slot holding the oldest version (or none); wait while all are busy."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            latest = unpack_latest(self.region.latest_word(entry))
            latest_slot = latest[1] if latest else -1
            ages = self._slot_ages(entry)
            for slot in sorted((s for s in range(entry.nslots) if s != latest_slot), key=ages.__getitem__):
                if not self._claims.try_exclusive(slot_lock_offset(entry.index, slot)):
                    continue
                now_latest = unpack_latest(self.region.latest_word(entry))
                if now_latest is not None and now_latest[1] == slot:
                    self._claims.release(slot_lock_offset(entry.index, slot))
                    continue
                return slot
            if time.monotonic() > deadline:
                raise BusyError(f"every slot of {self.model!r} is latest, pinned by a reader or being written "
                                f"after waiting {self.timeout_s} s; close readers (open files in the mount, "
                                "loads) or create the model with more slots")
            self._slot_age_cache = None  # another process may have moved things: look again
            time.sleep(0.005)

    def _slot_ages(self, entry) -> list[int]:
        """Counter of the committed version in each slot (-1: none), read from the headers once and
        then kept up to date by this writer's own commits. Only the choice among free slots
        depends on it (safety rests on the claim lock and the latest check), so a value made
        stale by another process costs at most a less old version, never a wrong overwrite;
        it spares every save a disk read per slot header."""
        with self._setup_lock:
            if self._slot_age_cache is None:
                ages = []
                for slot in range(entry.nslots):
                    header = self.region.read_header(entry, slot)
                    ages.append(header.counter if header is not None and header.state == SLOT_COMMITTED else -1)
                self._slot_age_cache = ages
            return list(self._slot_age_cache)

    def _note_slot_age(self, slot: int, counter: int) -> None:
        with self._setup_lock:
            if self._slot_age_cache is not None:
                self._slot_age_cache[slot] = counter

    def _release_claim(self, job: _InFlight) -> None:
        self._claims.release(slot_lock_offset(job.entry.index, job.slot))

    # ------------------------------------------------------------------ snapshot
    def _layout(self, flat) -> _Layout:
        """The layout of ``flat``, planned once per object structure: a training loop saves the
        same structure every time, and planning a large one costs the caller milliseconds."""
        cached = self._layout_cache
        if cached is not None and cached[0] == flat.signature:
            return cached[1]
        layout = _lay_out(flat.names, flat.tensors, self._chunk_bytes_for)
        self._layout_cache = (flat.signature, layout)
        return layout

    def _chunk_bytes_for(self, data_bytes: int) -> int:
        """The chunk size, fixed at the first save: ``chunk_bytes``, or less for a small state,
        so that a checkpoint of a few KiB does not pre-fault 64 MiB staging buffers."""
        with self._setup_lock:
            if self._effective_chunk_bytes is None:
                self._effective_chunk_bytes = min(self.chunk_bytes, max(align_up(data_bytes, 4096), 4096))
            return self._effective_chunk_bytes

    def _pool(self, cuda: bool, data_bytes: int) -> StagingPool:
        with self._setup_lock:
            return self._pool_locked(cuda, data_bytes)

    def _pool_locked(self, cuda: bool, data_bytes: int) -> StagingPool:
        if cuda not in self._pools:
            budget = self.staging_budget_bytes
            if budget is None:
                physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                chunk = self._effective_chunk_bytes or self.chunk_bytes
                budget = min(self.max_inflight * align_up(max(data_bytes, 1), chunk), physical // 2)
            chunk = self._effective_chunk_bytes or self.chunk_bytes
            self._pools[cuda] = StagingPool(chunk, max(budget, chunk), pinned=cuda)
        return self._pools[cuda]

    def _snapshot_gated(self, job: _InFlight, plan: _SavePlan, pool: StagingPool, mark: CallerMark | None) -> None:
        with self._write_gate:
            self._snapshots_running += 1
        try:
            cuda_devices = plan.cuda_devices
            if cuda_devices:
                self._snapshot_cuda(job, plan.flat.tensors, pool, cuda_devices, mark)
            else:
                self._snapshot_host(job, [_byte_source(t) for t in plan.flat.tensors], pool)
        finally:
            with self._write_gate:
                self._snapshots_running -= 1
                self._write_gate.notify_all()

    def _snapshot_host(self, job: _InFlight, sources: list[torch.Tensor], pool: StagingPool) -> None:
        """CPU tensors: the native multi-threaded copy, chunk by chunk."""
        host = [host_bytes(t) for t in sources]
        for chunk in job.layout.chunks:
            buf = pool.acquire(self.timeout_s)
            copy_spans(buf.mapping, [(p.buffer_start, host[p.tensor], p.tensor_start, p.length)
                                     for p in chunk.pieces], self._copy_threads)
            crcs = None
            if job.crc_in_snapshot:
                # A background snapshot runs while the caller computes: checksumming here
                # keeps that memory traffic out of the caller's next optimizer step, which
                # the persist workers' checksums would otherwise overlap.
                crcs = _piece_crcs(buf, chunk)
            self._queue.put(("chunk", job, chunk, buf, pool, (), crcs))

    def _snapshot_cuda(self, job: _InFlight, tensors: list[torch.Tensor], pool: StagingPool,
                       devices: set[int], mark: CallerMark | None) -> None:
        """Some tensors on GPUs: copies into pinned buffers on side streams; the persist workers
        wait for each chunk's events. Returns once every copy is done (the tensors may change)."""
        # A thread's current device starts as 0: without this, registering the pinned buffers
        # from the snapshot thread would make a context on GPU 0 in every rank of a job.
        with torch.cuda.device(min(devices)):
            streams = self._side_streams.ordered_after_caller(devices, mark)
            sources = []
            for t in tensors:
                if t.is_cuda:
                    # a view that must be made contiguous is copied on the side stream, after the
                    # caller's work, like the rest of the snapshot
                    with torch.cuda.stream(streams[t.device.index]):
                        sources.append(_byte_source(t))
                else:
                    sources.append(_byte_source(t))
            pending = []
            for chunk in job.layout.chunks:
                buf = pool.acquire(self.timeout_s)
                events = copy_chunk_pieces(buf.tensor, chunk.pieces, sources, streams)
                pending.extend(events)
                self._queue.put(("chunk", job, chunk, buf, pool, events, None))
            for event in pending:
                event.synchronize()

    # ------------------------------------------------------------------ persist workers
    def _persist_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            kind, job = item[0], item[1]
            try:
                if kind == "prepare":
                    self._prepare_slot(job)
                else:
                    self._persist_chunk(job, *item[2:])
            except BaseException as e:  # noqa: BLE001 - delivered through the future
                self._fail(job, e)

    @staticmethod
    def _yield_to_snapshot(job: _InFlight, pool: StagingPool) -> None:
        """Hold the chunk's CRC until the snapshot is taken: on a CPU-only host the checksums
        would otherwise take cores from the copy the caller is waiting for. The writes already
        issued keep the device busy meanwhile, so durability is not delayed. Never waits while
        the snapshot itself waits for a staging buffer (this one must then be freed)."""
        while not job.future.snapshotted.done() and not pool.starved:
            job.snapshot_taken.wait(0.002)

    def _enter_write(self, pool: StagingPool) -> None:
        """Wait for the right to issue a chunk write. While a snapshot copy runs, only one
        write is in flight: the device's DMA and the writers' page pinning take memory bandwidth
        and a core from the copy the caller waits for (on the 2-core hosts measured, two writes
        made the stall 1.3-1.8x a memcpy; one costs the durable time nothing measurable, as the
        copy is several times faster than the device). A snapshot starved of staging buffers
        lifts the limit, since only finished writes free buffers."""
        with self._write_gate:
            while self._snapshots_running and self._writes_in_flight and not pool.starved:
                self._write_gate.wait(0.005)
            self._writes_in_flight += 1

    def _exit_write(self) -> None:
        with self._write_gate:
            self._writes_in_flight -= 1
            self._write_gate.notify_all()

    def _prepare_slot(self, job: _InFlight) -> None:
        header = self.region.read_header(job.entry, job.slot)
        if header is not None and header.state == SLOT_COMMITTED:
            marker = SlotHeader(SLOT_WRITING, job.counter, job.step, job.time_ns, job.entry.index, job.slot)
            buf = aligned_buffer(4096)
            buf[:] = marker.pack()
            self.region.write_slot(job.entry, job.slot, 0, buf)
            self.region.backend.barrier()
        job.ready.set()
        if not job.layout.chunks:
            self._commit(job)

    def _persist_chunk(self, job: _InFlight, chunk: Chunk, buf: StagingBuffer, pool: StagingPool,
                       events, crcs) -> None:
        try:
            for event in events:
                event.synchronize()
            job.ready.wait()
            if job.error is not None:
                return
            self._enter_write(pool)
            try:
                with memoryview(buf.mapping) as view:
                    self.region.write_slot(job.entry, job.slot, job.data_offset + chunk.start, view[:chunk.length])
            finally:
                self._exit_write()
            if crcs is None:
                self._yield_to_snapshot(job, pool)
                crcs = _piece_crcs(buf, chunk)
        finally:
            pool.release(buf)
        with job.mutex:
            for tensor, start, n, crc in crcs:
                job.piece_crcs[tensor].append((start, n, crc))
            job.chunks_left -= 1
            last = job.chunks_left == 0
        self._progress.advance(job.counter, chunk.length)
        if last:
            self._commit(job)

    def _commit(self, job: _InFlight) -> None:
        if job.error is not None:
            return
        region = self.region
        manifest = job.manifest
        raw = manifest.encode(job.layout.tensors.with_crcs([combine_piece_crcs(p) for p in job.piece_crcs]))
        moff, doff = SLOT_HEADER_BYTES, job.data_offset
        if len(raw) > doff - moff:
            raise CkptfsError(f"the index of {self.model} step {job.step} outgrew its reserved space; "
                              "this is a bug in ckptfs, please report it")
        index = aligned_buffer(doff - moff)
        index[:len(raw)] = raw
        region.write_slot(job.entry, job.slot, moff, index)
        # One barrier makes the tensor bytes and the index durable; only then the header that
        # vouches for them is written, alone in its page: a torn commit leaves at worst an
        # invalid header (no version), never a valid header over a torn index.
        region.backend.barrier()
        header = SlotHeader(SLOT_COMMITTED, job.counter, job.step, job.time_ns, job.entry.index, job.slot,
                            moff, len(raw), crc32(raw), doff, manifest.data_bytes)
        page = aligned_buffer(SLOT_HEADER_BYTES)
        page[:] = header.pack()
        region.write_slot(job.entry, job.slot, 0, page)
        region.backend.barrier()  # header durable before the pointer moves
        published = self._publish(job)
        region.persist_words(job.entry)
        self._note_slot_age(job.slot, job.counter)
        self._release_claim(job)
        result = SaveResult(self.model, job.step, job.counter, job.slot, manifest.data_bytes, published,
                            job.stall_s, time.perf_counter() - job.started)
        self._finish(job, result=result)

    def _publish(self, job: _InFlight) -> bool:
        """PCcheck Listing 1: CAS the latest pointer only while it names an older counter."""
        desired = pack_latest(job.counter, job.slot)
        while True:
            seen = self.region.latest_word(job.entry)
            current = unpack_latest(seen)
            if current is not None and current[0] >= job.counter:
                return False
            swapped, _ = self.region.cas_latest(job.entry, seen, desired)
            if swapped:
                return True

    def _fail(self, job: _InFlight, error: BaseException) -> None:
        with job.mutex:
            if job.error is not None or job.future.done():
                return
            job.error = error
        job.ready.set()
        self._note_slot_age(job.slot, -1)
        self._release_claim(job)
        log.error("save of %s step %d failed: %s", self.model, job.step, error)
        self._finish(job, error=error)

    def _finish(self, job: _InFlight, result=None, error=None) -> None:
        self._progress.finish(job.counter)
        self._permits.release()
        with self._outstanding_lock:
            self._outstanding.discard(job.future)
        if error is not None and not job.future.snapshotted.done():
            job.future.snapshotted.set_exception(error)
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)


def _piece_crcs(buf: StagingBuffer, chunk: Chunk) -> list[tuple[int, int, int, int]]:
    """(tensor, tensor_start, length, crc32) of every tensor piece in a filled staging buffer."""
    view = memoryview(buf.mapping)
    try:
        return [(p.tensor, p.tensor_start, p.length, crc32(view[p.buffer_start:p.buffer_start + p.length]))
                for p in chunk.pieces]
    finally:
        view.release()


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
