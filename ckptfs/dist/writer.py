"""ckptfs's own writer on every rank of a job: ``store.writer(model, group=...)``.

    with store.writer("gpt2", group=dist.group.WORLD, max_inflight=2) as w:
        w.save({"model": model_sd, "optim": optim_sd}, step=s, async_snapshot=True)
    store.load("gpt2", group=dist.group.WORLD, into={"model": model_sd, "optim": optim_sd})

The engine is torch.distributed.checkpoint: its planners decide which rank writes which shard
(replicated state once) and reshard on load; ckptfs is the storage and the commit protocol
under it (``StorageWriter`` / ``StorageReader``, docs/DISTRIBUTED.md). What this adds is the
writer's contract of a single process, for many:

* the snapshot: each save copies the rank's state (its shards, on any device) into a CPU copy
  made once per structure and reused while the structure is unchanged (DCP's state-dict copy
  helpers; pinned for CUDA), on the caller's thread or, with ``async_snapshot``, on a thread of
  its own; the caller may change the state once ``future.snapshotted`` completes;
* N in flight: up to ``max_inflight`` snapshots wait for, or are in, their save; one more save
  waits (backpressure, ``BusyError`` after ``timeout_s``) and nothing else blocks the caller;
* the saves run one after another on a thread of their own: DCP's collectives of two saves
  must not interleave, and they run on ckptfs's gloo group, never behind the job's NCCL traffic;
* a rank that never comes to a save fails every other rank's save after ``timeout_s``, naming it.
"""
from __future__ import annotations

import hashlib
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ckptfs.dist.group import Arrival, check_agreement, coordination, exchange, this_rank
from ckptfs.dist.storage import StorageReader, StorageWriter
from ckptfs.errors import BusyError, CkptfsError
from ckptfs.writer.job import check_positive, is_kept


@dataclass(frozen=True)
class DistSaveResult:
    """What the future of a save of many ranks returns (on every rank)."""

    model: str
    step: int
    stall_s: float  # the caller's wait: backpressure and (without async_snapshot) the copy
    durable_s: float  # from save() until the step was the global latest on every node
    part_durable_at: float  # time.time() when this rank's part was durable
    committed_at: float  # time.time() when every node had recorded the step


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
        self._group = _gloo_group(group, timeout_s)
        self._slots = threading.BoundedSemaphore(max_inflight)
        self._free = [_StagedCopy() for _ in range(max_inflight)]  # one per save in flight
        self._lock = threading.Lock()
        self._snapshots = ThreadPoolExecutor(1, thread_name_prefix=f"ckptfs-dist-snapshot-{model}")
        self._saves = ThreadPoolExecutor(1, thread_name_prefix=f"ckptfs-dist-save-{model}")
        self._pending: set[Future] = set()
        self._closed = False

    def save(self, state: dict, step: int, *, async_snapshot: bool = False, keep: bool | None = None,
             extra: dict | None = None) -> Future:
        """Save ``state`` (this rank's state dict: tensors, DTensors, sharded tensors, plain
        values) as step ``step`` of the job; returns a future (with ``snapshotted``, as
        ``Writer.save``'s) that completes with a DistSaveResult once the step is the job's
        global latest on every node, or fails on every rank. ``keep`` and ``extra``: as
        ``Writer.save``'s, for the global version."""
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
            copy = self._free.pop()
            self._pending.add(future)

        def snapshot():
            try:
                staged = copy.stage(state)
            except BaseException as e:  # noqa: BLE001 - delivered through both futures
                future.snapshotted.set_exception(e)
                raise
            future.snapshotted.set_result(time.perf_counter() - started)
            return staged

        if async_snapshot:
            staged_future = self._snapshots.submit(snapshot)
        else:
            staged_future = Future()
            try:
                staged_future.set_result(snapshot())
            except BaseException as e:  # noqa: BLE001 - raised below, after the slot is returned
                self._done(future, copy)
                future.set_exception(e)
                raise
        stall_s = time.perf_counter() - started
        self._saves.submit(self._save, future, copy, staged_future, step, keep, extra, started,
                           0.0 if async_snapshot else stall_s)
        return future

    def _save(self, future, copy, staged_future, step, keep, extra, started, stall_s) -> None:
        try:
            staged = staged_future.result()
            self._agree(staged, step)
            writer = StorageWriter(self.store, self.model, step, max_inflight=self.max_inflight,
                                   timeout_s=self.timeout_s, group=self._group, keep=keep, extra=extra)
            import torch.distributed.checkpoint as dcp

            dcp.save(staged, storage_writer=writer, process_group=self._group)
            result = DistSaveResult(self.model, step, stall_s, time.perf_counter() - started,
                                    writer.part_durable_at, writer.committed_at)
        except BaseException as e:  # noqa: BLE001 - delivered through the future
            self._done(future, copy)
            future.set_exception(e)
            return
        self._done(future, copy)
        future.set_result(result)

    def _agree(self, state: dict, step: int) -> None:
        """Before anything is written: every rank came to this save (CkptfsError naming those
        that did not, after ``timeout_s``) with the same model, step and keys."""
        paths = sorted(_key_paths(state))
        digest = hashlib.sha256("\n".join(paths).encode("utf-8", "surrogatepass")).hexdigest()
        mine = {"rank": this_rank(), "model": self.model, "step": step, "keys": digest}
        everyone = exchange(mine, self._group, f"the start of step {step} of {self.model!r}",
                             Arrival(self._group, f"{self.model}/save"))
        check_agreement(everyone)
        if len({p["keys"] for p in everyone}) > 1:
            # rare: the key lists themselves, to say which keys differ
            lists = exchange(paths, self._group, f"the comparison of the keys of step {step}")
            every = set.intersection(*map(set, lists))
            odd = {r: sorted(set(keys) - every)[:3] for r, keys in enumerate(lists) if set(keys) != every}
            said = "; ".join(f"rank {r} also has {', '.join(map(repr, keys))}" for r, keys in odd.items() if keys)
            said = said or "some ranks lack keys the others have"
            raise CkptfsError(f"the ranks do not save the same keys in step {step} of {self.model!r} ({said}): "
                              "every rank must save the same state dict keys; nothing was committed")

    def _done(self, future, copy) -> None:
        with self._lock:
            self._free.append(copy)
            self._pending.discard(future)
        self._slots.release()

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
        """Wait for the saves in flight, then stop; a closed writer refuses saves."""
        if self._closed:
            return
        self._closed = True
        self.wait()
        self._snapshots.shutdown(wait=True)
        self._saves.shutdown(wait=True)

    def __enter__(self) -> "DistWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _StagedCopy:
    """A CPU copy of a state dict, made once per structure (keys, shapes, dtypes, devices,
    placements) and refilled in place while the structure is unchanged."""

    def __init__(self):
        self._signature = None
        self._copy = None

    def stage(self, state: dict) -> dict:
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        signature = _signature(state)
        if signature != self._signature:
            self._copy = _create_cpu_state_dict(state, pin_memory=torch.cuda.is_available())
            self._signature = signature
        return _copy_state_dict(state, self._copy)


def _signature(obj):
    """What a staged copy's layout depends on; plain values by their type only (their values
    are copied at each save)."""
    if isinstance(obj, dict):
        return tuple((k, _signature(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(_signature(v) for v in obj))
    if isinstance(obj, torch.Tensor):
        placements = getattr(obj, "placements", None)
        return (tuple(obj.shape), obj.dtype, str(obj.device), type(obj).__name__,
                None if placements is None else tuple(map(str, placements)))
    return type(obj).__name__


def _key_paths(obj, prefix: str = "") -> list[str]:
    """The dotted key path of every leaf of a state dict (nested dicts; other values are leaves)."""
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in _key_paths(v, f"{prefix}{k}.")]
    return [prefix[:-1]]


def load(store, model: str, into: dict, *, group=None, step: int | None = None, peers=(),
         timeout_s: float = 300.0) -> dict:
    """Load the newest step of ``model`` that every node records (or ``step``) into ``into``
    (this rank's state dict, of any sharding and world size: DCP reshards), in place, on every
    rank of ``group``; returns ``into``. ``peers``: other nodes' regions reachable from here."""
    import torch.distributed.checkpoint as dcp

    if into is None:
        raise ValueError("a load of many ranks needs into= (the state dict to load in place, e.g. "
                         "{'model': model.state_dict(), 'optim': optimizer.state_dict()})")
    gloo = _gloo_group(group, timeout_s)
    reader = StorageReader(store, model, step, peers=peers, timeout_s=timeout_s, group=gloo)
    dcp.load(into, storage_reader=reader, process_group=gloo)
    return into


def _gloo_group(group, timeout_s: float):
    """The gloo group the ranks of ``group`` coordinate through: ckptfs's own over every rank
    (``group`` None or the world), None without torch.distributed."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    if group is not None and group is not dist.group.WORLD and \
            dist.get_process_group_ranks(group) != list(range(dist.get_world_size())):
        raise ValueError("group= must be the whole job (dist.group.WORLD): every rank saves its part of a "
                         "checkpoint")
    return coordination(timeout_s)
