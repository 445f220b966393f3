"""ckptfs as the storage of torch.distributed.checkpoint: ``dcp.save`` / ``async_save`` / ``load``
with ``storage_writer=StorageWriter(store, model, step)`` and ``StorageReader(store, model)``.

DCP plans (which rank writes which tensor or shard, replicated state once) and reshards on
load; ckptfs stores the bytes and keeps the commit order (PCcheck §4.1):
  1. every rank writes its part of step s (the tensors and shards of its write items) as a
     version of its part model ``.MODEL.rank<R>`` (hidden in the mount: a leading dot), kept,
     so that no ring reuses it while a global version may name it; ``write_data`` completes
     when the part is durable and committed;
  2. DCP gathers the results on the coordinator, whose ``finish`` commits the global version:
     a version of MODEL at step s holding no tensors, only ``dcp-metadata.json`` (DCP's metadata
     in JSON, ``ckptfs.dist.codec``) with, per item, the rank, the part's counter and the item's
     position in it. Only then is step s a version anyone sees, and ``latest`` of MODEL is the
     newest step whose every part is durable. A step older than the global latest is not
     committed (an older save finishing after a newer one never wins);
  3. after the commit, parts older than the new global version are unkept (the rings reuse
     them); parts of steps that never completed go the same way at the next global commit.
All ranks share one region here (one node). ``load`` reads the newest global version (or
``step``) and each rank reads the pieces of the parts its load plan asks for.
"""
from __future__ import annotations

import io
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.distributed.checkpoint import StorageReader as _DCPReader
from torch.distributed.checkpoint import StorageWriter as _DCPWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ckptfs.dist.codec import decode_metadata, encode_metadata
from ckptfs.errors import CorruptionError, NotFoundError, no_version_yet

METADATA_FILE = "dcp-metadata.json"
_writers: dict[tuple[str, str], object] = {}  # (region, part model) -> its Writer, kept across steps
_writers_lock = threading.Lock()
_commit_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ckptfs-dcp")


def part_model(model: str, rank: int) -> str:
    """The model holding rank ``rank``'s parts of ``model``'s DCP checkpoints."""
    return f".{model}.rank{rank}"


class StorageWriter(_DCPWriter):
    """Writes one DCP checkpoint (step ``step`` of ``model``) into ``store``'s region."""

    def __init__(self, store, model: str, step: int, *, max_inflight: int = 2):
        super().__init__()
        self.store = store
        self.model = model
        self.step = step
        self.max_inflight = max_inflight
        self.rank = 0
        self.is_coordinator = True

    # ---------------------------------------------------------------- DCP's StorageWriter
    def reset(self, checkpoint_id=None) -> None:
        pass  # the checkpoint is (model, step), given to the constructor

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False  # never chosen from a path: pass storage_writer=StorageWriter(...)

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank", _rank())

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=f"ckptfs:{self.model}@{self.step}")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        """This rank's items as one kept version of its part model; completes when durable."""
        tensors, results = [], []
        for pos, item in enumerate(plan.items):
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                tensor = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            else:
                tensor = data.detach()
            tensors.append(tensor)
            results.append((item, tensor))
        writer = _part_writer(self.store, part_model(self.model, self.rank), self.max_inflight)
        save = writer.save({"items": tensors}, step=self.step, keep=True)
        done: Future = Future()

        def wait() -> None:
            try:
                r = save.result()
                done.set_result([WriteResult(index=item.index, size_in_bytes=_nbytes(t),
                                             storage_data={"rank": self.rank, "counter": r.counter, "pos": pos})
                                 for pos, (item, t) in enumerate(results)])
            except BaseException as e:  # noqa: BLE001 - delivered to DCP through the future
                done.set_exception(e)

        _commit_pool.submit(wait)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """On the coordinator, once every rank's part is durable: the global version."""
        metadata.storage_data = {r.index: r.storage_data for rank_results in results for r in rank_results}
        latest = _latest(self.store, self.model)
        if latest is not None and latest.step >= self.step:
            _reclaim(self.store, self.model, keep_step=latest.step)
            return  # a newer (or the same) step is already the global latest
        parts = sorted({(r.storage_data["rank"], r.storage_data["counter"]) for rr in results for r in rr})
        with self.store.writer(self.model, max_inflight=1) as w:
            w.save({"dcp": {"step": self.step, "parts": [list(p) for p in parts]}}, step=self.step,
                   extra={METADATA_FILE: encode_metadata(metadata)}).result()
        _reclaim(self.store, self.model, keep_step=self.step)


class StorageReader(_DCPReader):
    """Reads the newest global DCP checkpoint of ``model`` (or ``step``) from ``store``."""

    def __init__(self, store, model: str, step: int | None = None):
        super().__init__()
        self.store = store
        self.model = model
        self.step = step
        self.metadata: Metadata | None = None

    def reset(self, checkpoint_id=None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False

    def read_metadata(self, *args, **kwargs) -> Metadata:
        with _global_version(self.store, self.model, self.step) as v:
            self.metadata = decode_metadata(dict(v.manifest.files)[METADATA_FILE])
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        self.metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        storage = self.metadata.storage_data
        by_part: dict[tuple[int, int], list] = {}
        for item in plan.items:
            where = storage[item.storage_index]
            by_part.setdefault((where["rank"], where["counter"]), []).append((item, where["pos"]))
        for (rank, counter), items in sorted(by_part.items()):
            stored = _read_part(self.store, self.model, rank, counter)
            for item, pos in items:
                tensor = stored[pos]
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, io.BytesIO(tensor.numpy().tobytes()))
                    continue
                for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                    tensor = tensor.narrow(dim, offset, length)
                target = planner.resolve_tensor(item).detach()
                target.copy_(tensor)
                planner.commit_tensor(item, target)
        done: Future = Future()
        done.set_result(None)
        return done


# -------------------------------------------------------------------------------- helpers
def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _part_writer(store, model: str, max_inflight: int):
    """One writer per part model and region in this process, reused by every step (its staging
    pool and ring stay warm)."""
    key = (store.path, model)
    with _writers_lock:
        w = _writers.get(key)
        if w is None or w._closed:
            w = store.writer(model, max_inflight=max_inflight)
            _writers[key] = w
        return w


def _latest(store, model: str):
    try:
        return store.latest(model)
    except NotFoundError:
        return None


def _global_version(store, model: str, step: int | None):
    """The pinned global version of ``model`` at ``step`` (None: the newest)."""
    if step is None and _latest(store, model) is None:
        raise no_version_yet(model)
    v = store.open_version(model, step)
    if METADATA_FILE not in dict(v.manifest.files):
        v.close()
        raise NotFoundError(f"step {v.info.step} of {model!r} is not a DCP checkpoint (it has no {METADATA_FILE}); "
                            "load it with Store.load")
    return v


def _read_part(store, model: str, rank: int, counter: int) -> list[torch.Tensor]:
    name = part_model(model, rank)
    match = [v for v in store.versions(name) if v.counter == counter]
    if not match:
        raise CorruptionError(f"the part of rank {rank} (counter {counter}) of {model!r} is gone from {name!r}; "
                              "this global version cannot be loaded, use an older one")
    with store.open_version(name, match[0].step) as v:
        if v.info.counter != counter:
            raise CorruptionError(f"the part of rank {rank} of {model!r} was overwritten while read")
        return v.load()["items"]


def _reclaim(store, model: str, keep_step: int) -> None:
    """Unkeep every part older than global step ``keep_step`` (superseded, or of a step that never
    completed), so that the part models' rings reuse them."""
    for name in store.models():
        if not name.startswith(f".{model}.rank"):
            continue
        for v in store.versions(name):
            if v.kept and v.step < keep_step:
                try:
                    store.unkeep(name, v.step)
                except NotFoundError:
                    pass  # reused meanwhile: nothing to give back
