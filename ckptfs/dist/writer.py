"""ckptfs's own writer on every rank of a job: ``store.writer(model, group=...)``.

    with store.writer("gpt2", group=dist.group.WORLD, max_inflight=2) as w:
        w.save({"model": model_sd, "optim": optim_sd}, step=s, async_snapshot=True)
    store.load("gpt2", group=dist.group.WORLD, into={"model": model_sd, "optim": optim_sd})

The engine is torch.distributed.checkpoint: its planners decide which rank writes which shard
(replicated state once) and reshard on load; ckptfs is the storage and the commit protocol
under it (``StorageWriter`` / ``StorageReader``, docs/DISTRIBUTED.md). What this adds is the
writer's contract of a single process, for many:

* one copy, pipelined with the writes: a save hands the rank's items (its shards, on any
  device) to its part's writer, whose snapshot copies them chunk by chunk into its staging
  buffers while the chunks already copied are written; the caller may change the state once
  ``future.snapshotted`` completes (on the caller's thread, or with ``async_snapshot`` on a
  thread of the writer's own);
* the plan of a structure is made once: the first save of a structure goes through
  ``dcp.save`` (DCP's planners); while every rank's structure (keys, shapes, dtypes,
  placements) stays the same, the later saves reuse that plan and skip DCP's planning;
* N in flight: up to ``max_inflight`` saves are in their snapshot or their commit; one more
  save waits (backpressure, ``BusyError`` after ``timeout_s``) and nothing else blocks the
  caller. The snapshots, and the global commits, run in call order on a thread each, over a
  gloo group each (a group's collectives must come in one order on every rank), never behind
  the job's NCCL traffic;
* a rank that never comes to a save fails every other rank's save after ``timeout_s``, naming it.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from ckptfs.dist.codec import encode_metadata
from ckptfs.dist.group import coordination, exchange, meet, this_rank, world_size
from ckptfs.dist.reader import StorageReader
from ckptfs.dist.resolve import ItemResolver, resolve_items
from ckptfs.dist.storage import StorageWriter, close_idle_writers, write_results
from ckptfs.dist.structure import describe, matches
from ckptfs.errors import BusyError, CkptfsError
from ckptfs.gcpause import paused_gc
from ckptfs.writer.job import check_positive, is_kept


log = logging.getLogger("ckptfs")
_open_writers: "weakref.WeakSet[DistWriter]" = weakref.WeakSet()


def _commit_in_flight_at_exit() -> None:
    """A script that ends without closing its writer still gets its saves committed, as
    Writer's. Run among threading's exit hooks, before concurrent.futures' (they run in reverse
    order of registration, and that module was imported first), which stop every executor: an
    atexit hook came too late, and a snapshot still running found its commit refused. Only this
    process's own writers: a forked child (a DataLoader worker) ends with copies of its parent's,
    whose saves it would wait for in vain. A save that fails here is logged: nobody reads its
    future any more."""
    for writer in [w for w in list(_open_writers) if w._pid == os.getpid()]:
        with writer._lock:
            pending = list(writer._pending)
        try:
            writer.close()
        except BaseException as e:  # noqa: BLE001 - report and go on with the others
            log.error("ckptfs: a save of %s failed at exit: %s", writer.model, e)
        for future in pending:
            if future.done() and not future.cancelled() and future.exception() is not None:
                log.error("ckptfs: a save of %s failed at exit: %s", writer.model, future.exception())


try:
    threading._register_atexit(_commit_in_flight_at_exit)  # noqa: SLF001 - concurrent.futures' own way
except RuntimeError:  # imported while the interpreter ends: no save of it can be in flight
    pass


@dataclass(frozen=True)
class DistSaveResult:
    """What the future of a save of many ranks returns (on every rank)."""

    model: str
    step: int
    stall_s: float  # the caller's wait: backpressure and (without async_snapshot) the snapshot
    durable_s: float  # from save() until the step was the global latest on every node
    part_durable_at: float  # time.time() when this rank's part was durable
    committed_at: float  # time.time() when every node had recorded the step


@dataclass(frozen=True)
class _Plan:
    """This rank's final DCP save plan of one structure, kept for the saves that follow."""

    structure: list  # the structure it was made for (ckptfs.dist.structure.describe)
    keys: str  # the digest of that structure's key paths, which every rank agreed on (_key_digest)
    made_at: int  # the step whose dcp.save made it: the same on every rank that has it
    items: list  # this rank's WriteItems
    metadata: str | None  # DCP's global metadata, encoded (on the coordinator; else None)
    resolver: ItemResolver  # the items' data in a state of this structure
    places: dict = field(default_factory=dict)  # StorageWriter.plan_places of the saves reusing it


@dataclass
class _Written:
    """One save past its snapshot: what its global commit needs."""

    storage: StorageWriter
    items: list
    tensors: list
    part: Future  # the part's SaveFuture (or a failed future: the commit tells every rank)
    metadata: object  # as StorageWriter.commit's


DIST_OPTIONS = ("max_inflight", "timeout_s", "keep_every")  # DistWriter's options (store.writer checks them)


class DistWriter:
    """Saves of ``model`` from every rank of ``group`` (see the module). Open it on every rank,
    with the same arguments; every rank saves the same steps, in the same order."""

    def __init__(self, store, model: str, *, group=None, max_inflight: int = 2, timeout_s: float = 300.0,
                 keep_every: int | None = None):
        check_positive("max_inflight", max_inflight)
        if keep_every is not None:
            check_positive("keep_every", keep_every)
        self.store = store
        self.model = model
        self.max_inflight = max_inflight
        self.timeout_s = timeout_s
        self.keep_every = keep_every
        self._group = _gloo_group(group, timeout_s, model)  # the snapshots' agreement and DCP's planning
        self._commit_group = _gloo_group(group, timeout_s, model, "commit")
        self._slots = threading.BoundedSemaphore(max_inflight)
        self._lock = threading.Lock()
        self._snapshots = ThreadPoolExecutor(1, thread_name_prefix=f"ckptfs-dist-snapshot-{model}")
        self._commits = ThreadPoolExecutor(1, thread_name_prefix=f"ckptfs-dist-commit-{model}")
        self._pending: set[Future] = set()
        self._plan: _Plan | None = None
        self._last_snapshot: Future | None = None
        self._closed = False
        # the steps of this writer's snapshots taken and not yet committed, and its newest committed
        # step (_refuse_going_back)
        self._steps_in_flight: list[int] = []
        self._newest_committed = -1  # steps are never negative
        self._pid = os.getpid()  # see _commit_in_flight_at_exit
        _open_writers.add(self)

    def save(self, state: dict, step: int, *, async_snapshot: bool = False, keep: bool | None = None,
             extra: dict | None = None) -> Future:
        """Save ``state`` (this rank's state dict: tensors, DTensors, sharded tensors, plain
        values) as step ``step`` of the job; returns a future (with ``snapshotted``, as
        ``Writer.save``'s) that completes with a DistSaveResult once the step is the job's
        global latest on every node, or fails on every rank. Without ``async_snapshot`` the
        snapshot's errors (ranks that disagree or never came, a refused state) raise here, as
        ``Writer.save``'s do. ``keep`` and ``extra``: as ``Writer.save``'s, for the global
        version."""
        if self._closed:
            raise CkptfsError("this writer is closed; open a new one with store.writer(..., group=...)")
        keep = is_kept(step, keep, self.keep_every)
        started = time.perf_counter()
        if not self._slots.acquire(timeout=self.timeout_s):
            raise BusyError(f"{self.max_inflight} saves of {self.model!r} still in flight after timeout_s="
                            f"{self.timeout_s:g}; raise max_inflight or save less often")
        future: Future = Future()
        future.snapshotted = Future()
        with self._lock:
            self._pending.add(future)
        self._last_snapshot = future.snapshotted

        def snapshot() -> None:
            try:
                written = self._snapshot(state, step, keep, extra)
                with self._lock:
                    self._steps_in_flight.append(step)
            except BaseException as e:  # noqa: BLE001 - delivered through both futures
                future.snapshotted.set_exception(e)
                self._done(future)
                future.set_exception(e)
                raise
            stall_s = 0.0 if async_snapshot else time.perf_counter() - started
            future.snapshotted.set_result(time.perf_counter() - started)
            try:  # in snapshot order, so in the same order of steps on every rank
                self._commits.submit(self._commit, future, written, step, started, stall_s)
            except BaseException as e:  # noqa: BLE001 - e.g. the interpreter ending: said, not lost
                with self._lock:
                    self._steps_in_flight.remove(step)
                self._done(future)
                future.set_exception(CkptfsError(f"step {step} of {self.model!r} was snapshotted but never "
                                                 f"committed: {e}"))
                log.error("ckptfs: step %d of %s was snapshotted but never committed: %s", step, self.model, e)

        task = self._snapshots.submit(snapshot)
        if not async_snapshot:
            task.result()
        return future

    def _refuse_going_back(self, step: int) -> None:
        """CkptfsError for a step older than one this writer's snapshots took and whose commit did
        not fail (on the snapshot thread, after the ranks agreed on the step: in the order of the
        saves, on every rank alike). Its commits come in that order,
        so such a step is the job gone back, which would never become latest: its future
        succeeded with nothing recorded."""
        with self._lock:
            newest = max([self._newest_committed, *self._steps_in_flight])
        if step < newest:
            raise CkptfsError(f"step {step} of {self.model!r} is older than step {newest}, which this writer "
                              "saved, and an older step never becomes the job's latest: to go back, close this "
                              "writer, remove the later steps in every node's region (`ckptfs rm --allow-latest "
                              f"{self.model} STEP...`) and save with a new one")

    def _snapshot(self, state: dict, step: int, keep: bool, extra: dict | None) -> _Written:
        """Agree with the other ranks, then start this rank's part: through the plan made for
        this structure, or through dcp.save (which plans) when any rank has none."""
        from torch.distributed.checkpoint.state_dict_saver import _stateful_to_state_dict

        state = _stateful_to_state_dict(state)
        plan = self._plan if self._plan is not None and matches(state, self._plan.structure) else None
        keys = plan.keys if plan is not None else _key_digest(state)  # the same keys: the same structure
        everyone = self._agree(state, step, keys, None if plan is None else plan.made_at)
        # after the agreement: ranks at different steps are told so at once, on every rank (refused
        # alone, the rank at an older step left the others waiting timeout_s for it)
        self._refuse_going_back(step)
        replan = plan is None or len({p["plan"] for p in everyone}) > 1
        storage = (_PartOnly if replan else StorageWriter)(
            self.store, self.model, step, max_inflight=self.max_inflight, timeout_s=self.timeout_s,
            group=self._commit_group, keep=keep, extra=extra)
        if replan:
            return self._plan_and_write(state, step, keys, storage)
        rank = this_rank()
        storage.set_up_storage_writer(rank == 0, rank=rank)
        storage.plan_places = plan.places
        try:
            tensors, part = storage.write_part(plan.items, plan.resolver.resolve(state))
        except BaseException as e:  # noqa: BLE001 - the commit tells every rank, which then all fail
            tensors, part = [], Future()
            part.set_exception(e)
        return _Written(storage, plan.items, tensors, part, plan.metadata)

    def _plan_and_write(self, state: dict, step: int, keys: str, storage: "_PartOnly") -> _Written:
        """dcp.save over ``storage``, whose write step only starts the part; the plan it made is
        kept for the saves of the same structure. A group of one rank plans without DCP's
        collectives (``no_dist``): gathering its plans from itself pickled them, half of a first
        save at 40,000 tensors (17 -> 8 s)."""
        import torch.distributed.checkpoint as dcp

        from torch.distributed.checkpoint.api import CheckpointException

        structure = describe(state)
        try:
            dcp.save(state, storage_writer=storage, process_group=self._group, no_dist=world_size(self._group) == 1)
        except BaseException as e:
            if storage.written is not None:
                storage.release_part()  # no commit follows: a later save may reclaim the part
            if isinstance(e, CheckpointException):
                raise_unwrapped(e, f"step {step} of {self.model!r}", "nothing of it is committed")
            raise
        written = storage.written
        if written.metadata is not None:  # encoded once per plan, not at every commit
            try:
                written.metadata = encode_metadata(written.metadata)
            except Exception as e:  # noqa: BLE001 - a failed part: the commit tells every rank, which wait there
                written.part = Future()
                written.part.set_exception(e)
                return written
        self._plan = _Plan(structure, keys, step, written.items, written.metadata, storage.resolver)
        written.storage.plan_places = self._plan.places  # its first commit keeps them
        return written

    def _commit(self, future: Future, written: _Written, step: int, started: float, stall_s: float) -> None:
        storage = written.storage
        try:
            storage.commit(written.items, written.tensors, written.part, written.metadata, reclaim=False,
                           results=False)
            result = DistSaveResult(self.model, step, stall_s, time.perf_counter() - started,
                                    storage.part_durable_at, storage.committed_at)
        except BaseException as e:  # noqa: BLE001 - delivered through the future
            with self._lock:  # a step not committed does not hold the later saves back (_refuse_going_back)
                self._steps_in_flight.remove(step)
            self._done(future)
            future.set_exception(e)
            storage.reclaim_quietly()  # a job whose saves keep failing must not fill the region
            return
        with self._lock:
            self._steps_in_flight.remove(step)
            self._newest_committed = max(step, self._newest_committed)
        self._done(future)
        future.set_result(result)
        # after the caller is told: before the next commit, on this thread
        storage.reclaim_quietly()

    def _agree(self, state: dict, step: int, keys: str, plan_made_at: int | None) -> list[dict]:
        """Before anything is written: every rank came to this save (CkptfsError naming those
        that did not, after ``timeout_s``) with the same model, step and keys (``keys``: the
        digest of ``state``'s, ``_key_digest``). Returns every rank's answer, with the step whose
        plan it would reuse (``plan``; None: it has none).

        The ranks meet through the job's key-value store first (``meet``), and exchange their
        answers on the gloo group only once all have come: a rank that skipped this save and went
        on into a training collective keeps the others waiting until ``timeout_s``, and a gloo
        collective that timed out there left the group unusable, failing every later save."""
        what = f"the start of step {step} of {self.model!r}"
        meet(self._group, {"model": self.model, "step": step}, self.timeout_s, what,
             passed_to="store.writer (the model) and Writer.save (the step)")
        everyone = exchange({"rank": this_rank(), "keys": keys, "plan": plan_made_at}, self._group, what)
        if len({p["keys"] for p in everyone}) > 1:
            # rare: the key lists themselves, to say which keys differ
            lists = exchange(sorted(_key_paths(state)), self._group, f"the comparison of the keys of step {step}")
            every = set.intersection(*map(set, lists))
            odd = {r: sorted(set(keys) - every)[:3] for r, keys in enumerate(lists) if set(keys) != every}
            said = "; ".join(f"rank {r} also has {', '.join(map(repr, keys))}" for r, keys in odd.items() if keys)
            said = said or "some ranks lack keys the others have"
            raise CkptfsError(f"the ranks do not save the same keys in step {step} of {self.model!r} ({said}): "
                              "every rank must save the same state dict keys (keys of one rank, such as a "
                              "dataloader's position per rank, go through dcp.save with ckptfs.dcp.StorageWriter, "
                              "which takes them); nothing was committed")
        return everyone

    def _done(self, future) -> None:
        with self._lock:
            self._pending.discard(future)
        self._slots.release()

    def wait_snapshot(self) -> None:
        """Block until the last save's snapshot is taken (this rank's state may then change, e.g.
        by ``optimizer.step()``); raises the error that stopped it, if any. As
        ``Writer.wait_snapshot``."""
        if self._last_snapshot is not None:
            self._last_snapshot.result()

    def wait(self) -> None:
        """Wait for every save in flight (errors are in their futures)."""
        with self._lock:
            pending = list(self._pending)
        for f in pending:
            try:
                f.result()
            except BaseException:  # noqa: BLE001 - the caller has the future
                pass

    def close(self) -> None:
        """Wait for the saves in flight, then stop; a closed writer refuses saves. The writers of
        the rank's part (and the global record) that this process keeps for the saves close too,
        where idle: left open, they held the rank's last saved tensors, their threads and the
        model (``ckptfs rm --all`` refused) until the store closed."""
        if self._closed:
            return
        self._closed = True
        self._snapshots.shutdown(wait=True)
        self.wait()
        self._commits.shutdown(wait=True)
        if self._pid == os.getpid() and self.store is not None:
            close_idle_writers(self.store, self.model)

    def __enter__(self) -> "DistWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _PartOnly(StorageWriter):
    """The storage of a DistWriter's dcp.save: DCP plans; the write step starts this rank's part
    and returns once its snapshot is taken; the global commit is left to the DistWriter's commit
    thread (``written``), so that dcp.save returns while the part is still being written."""

    written: _Written | None = None
    resolver: ItemResolver | None = None  # for the saves that reuse this plan

    def write_data(self, plan, planner):
        from torch.futures import Future as TorchFuture

        self.resolver = ItemResolver(plan.items, planner)
        tensors, part = self.write_part(plan.items, resolve_items(plan.items, planner))
        metadata = getattr(planner, "metadata", None) if self.is_coordinator else None
        self.written = _Written(self, plan.items, tensors, part, metadata)
        done: TorchFuture = TorchFuture()
        done.set_result(write_results(plan.items, tensors, self.rank, None))
        return done


def _key_digest(state: dict) -> str:
    """The SHA-256 of ``state``'s sorted key paths: what the ranks compare to agree on the keys."""
    return hashlib.sha256("\n".join(sorted(_key_paths(state))).encode("utf-8", "surrogatepass")).hexdigest()


def _key_paths(obj, prefix: str = ""):
    """The dotted key path of every leaf of a state dict (nested dicts; other values are leaves)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _key_paths(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1]


def load(store, model: str, into: dict, *, group=None, step: int | None = None, peers=(),
         timeout_s: float = 300.0, keys=None) -> dict:
    """Load the newest step of ``model`` that every node records (or ``step``) into ``into``
    (this rank's state dict, of any sharding and world size: DCP reshards), in place, on every
    rank of ``group``; returns ``into``. ``peers``: other nodes' regions reachable from here.
    ``keys`` (Store.load's): DCP loads the keys of the state dict it is given, so ``into``
    holds exactly those (ValueError otherwise)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    if into is None:
        raise ValueError("a load of many ranks needs into= (the state dict to load in place, e.g. "
                         "{'model': model.state_dict(), 'optim': optimizer.state_dict()})")
    if keys is not None:
        from ckptfs.restore import key_list

        wanted = key_list(keys)
        if not isinstance(into, dict) or any(k not in wanted for k in into) or any(k not in into for k in wanted):
            raise ValueError(f"keys={wanted!r} with into= of a multi-rank version: DCP loads the keys into= holds, "
                             f"and into= holds {list(into) if isinstance(into, dict) else into!r:.80}; pass into= "
                             "with exactly those keys (or leave keys= out)")
    gloo = _gloo_group(group, timeout_s, model, "load")
    reader = StorageReader(store, model, step, peers=peers, timeout_s=timeout_s, group=gloo)
    try:
        with paused_gc(), _without_dcp_fallback_notice():  # (paused_gc: DCP's planning and ours make and drop
            # many objects, see ckptfs.gcpause) a group of one rank: DCP plans without its
            # collectives (at 40,000 tensors 4.3-4.9 -> 2.8-3.4 s a load), as _plan_and_write does
            dcp.load(into, storage_reader=reader, process_group=gloo, no_dist=world_size(gloo) == 1)
    except CheckpointException as e:
        if reader.metadata_error is not None:  # ours, not DCP's AssertionError that words it again
            raise reader.metadata_error from None
        raise_unwrapped(e, f"the load of {model!r}", "this rank's state is partly loaded: load again once that is "
                                                     "mended")
    return into


class _NoFallbackNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Global metadata is not found")


_NO_FALLBACK_NOTICE = _NoFallbackNotice()


@contextlib.contextmanager
def _without_dcp_fallback_notice():
    """DCP logs every failed ``read_metadata`` with its traceback on the root logger ("Global
    metadata is not found. Falling back to rank local metadata."), which ckptfs's reader has
    none of: each rank of a job's first start logged a traceback before the load's own
    NotFoundError. The load raises ckptfs's error, once (``reader.metadata_error``)."""
    root = logging.getLogger()
    root.addFilter(_NO_FALLBACK_NOTICE)
    try:
        yield
    finally:
        root.removeFilter(_NO_FALLBACK_NOTICE)


def raise_unwrapped(e, what: str, then: str) -> None:
    """Raise DCP's CheckpointException ``e`` (every failed rank's error wrapped, a BaseException)
    as ckptfs says it: this rank's own error where it failed, else a CkptfsError naming the first
    rank that did (``what`` failed on rank R (its error); ``then``)."""
    failures = {rank: error for rank, (error, _) in e.failures.items()}
    rank = this_rank()
    if rank in failures:
        raise failures[rank] from None
    other, error = min(failures.items())
    raise CkptfsError(f"{what} failed on rank {other} ({type(error).__name__}: {error}); {then}") from None


def load_in_this_process(store, model: str, step: int, into, keys=None):
    """``Store.load(into=)`` without ``group`` of a multi-rank version: DCP's load in this process
    alone, into ``into`` (``load``). In a job of many ranks it must be every rank's load
    (``group=``), or the whole state without ``into``: ValueError."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(f"{model} step {step} was saved by many ranks: load it at every rank with group= "
                         "(and into= this rank's state dict), or without into= for its whole state")
    with warnings.catch_warnings():  # DCP's "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        return load(store, model, into, step=step, keys=keys)


def _gloo_group(group, timeout_s: float, model: str, purpose: str = "save"):
    """The gloo group the ranks of ``group`` coordinate through for ``model`` and ``purpose`` (see
    ``coordination``): ckptfs's own over every rank (``group`` None or the world), None without
    torch.distributed."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    if group is not None and group is not dist.group.WORLD and \
            dist.get_process_group_ranks(group) != list(range(dist.get_world_size())):
        raise ValueError("group= must be the whole job (dist.group.WORLD): every rank saves its part of a "
                         "checkpoint")
    return coordination(timeout_s, model, purpose)
