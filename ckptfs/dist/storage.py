"""ckptfs as the storage of torch.distributed.checkpoint: ``dcp.save`` / ``async_save`` / ``load``
with ``storage_writer=StorageWriter(store, model, step)`` and ``StorageReader(store, model)``.

DCP plans (which rank writes which tensor or shard, replicated state once) and reshards on
load; ckptfs stores the bytes and keeps the commit order (PCcheck §4.1, docs/DISTRIBUTED.md).
Each rank passes the store of its node's region; ranks whose stores open the same region (same
uuid) form a node, the lowest of them its leader. In ``write_data`` (every rank):
  1. the rank writes its items as one version of its part model ``.MODEL.rank<R>`` (hidden in
     the mount), **kept**: no ring reuses it while a global version may name it;
  2. once it is durable, the ranks exchange, over a gloo group of their own (``coordination``),
     their part counters, their items' places and (from the coordinator) DCP's metadata. A rank
     that failed or died fails every rank's save: nothing below happens;
  3. every node's leader commits the **global version** of step s in its region: a version of
     MODEL holding no tensors, only ``dcp-metadata.json`` (DCP's metadata and where each item
     is, as JSON: ``ckptfs.dist.codec``), unless the region's latest is already a newer step
     (an older save finishing after a newer one never wins);
  4. the ranks exchange again (every node recorded s); then each leader unkeeps its node's parts
     older than s (superseded, or of steps that never completed), and the save completes. (A
     rank also unkeeps, before it writes a part, its older parts that no global version of its
     region names: a job whose saves keep failing does not fill the region with them.)
``load`` (every rank): the ranks agree on the newest step that every node's region records (a
crash between two nodes' commits leaves them one step apart for a while: the older is taken,
and its parts were not released, 4), read its metadata from their own region, and each reads
the pieces its load plan asks for from the parts, in whichever given region holds them.
"""
from __future__ import annotations

import hashlib
import io
import logging
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.distributed.checkpoint import StorageReader as _DCPReader
from torch.distributed.checkpoint import StorageWriter as _DCPWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ckptfs.dist.codec import PlacedMetadata, decode_metadata, encode_index, encode_metadata
from ckptfs.dist.group import Arrival, check_agreement, coordination, exchange, meet, this_rank
from ckptfs.dist.load import read_into_plan
from ckptfs.dist.names import METADATA_FILE, is_global_version, part_model
from ckptfs.errors import CkptfsError, CorruptionError, NotFoundError, no_version_yet

log = logging.getLogger("ckptfs")
_writers: dict[tuple[str, str], object] = {}  # (region, model) -> its Writer, kept across steps (_kept_writer)
_writers_lock = threading.Lock()
_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ckptfs-dcp")


class StorageWriter(_DCPWriter):
    """Writes step ``step`` of ``model``: this rank's part into ``store`` (its node's region),
    and, on each node's leader, the global version once every part of every rank is durable.
    ``timeout_s``: the longest the ranks wait for each other (a dead or missing rank fails the
    save, and is named). ``keep`` and ``extra``: as ``Writer.save``'s, for the global version."""

    def __init__(self, store, model: str, step: int, *, max_inflight: int = 2, timeout_s: float = 300.0,
                 group=None, keep: bool = False, extra: dict | None = None):
        super().__init__()
        self.group = group  # the gloo group to coordinate through (default: one of ckptfs's own)
        self.store = store
        self.model = model
        self.step = step
        self.keep = keep  # the global version is a milestone (see Writer.save)
        self.part_durable_at = self.committed_at = None  # set by the commit (see _commit)
        self.extra = dict(extra or {})  # small files of the global version (e.g. config.json)
        self.max_inflight = max_inflight
        self.timeout_s = timeout_s
        self.rank = 0
        self.is_coordinator = True
        self._group = None
        self._node_ranks: list[int] = []  # on a node's leader after the commit: whose parts to reclaim
        # Set by a writer whose saves reuse one DCP plan (the same on every rank): filled at the
        # plan's first commit (on a node's leader with the global metadata and every item's
        # place, PlacedMetadata; elsewhere with nothing), so that the later commits exchange only
        # their counters (GPT-2 small at W=4: the metadata is ~0.5 MB of JSON, sent to every rank
        # at every step otherwise).
        self.plan_places: dict | None = None

    # ---------------------------------------------------------------- DCP's StorageWriter
    def reset(self, checkpoint_id=None) -> None:
        pass  # the checkpoint is (model, step), given to the constructor

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False  # never chosen from a path: pass storage_writer=StorageWriter(...)

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        # every rank runs this, in the same order: the place to make the coordination group
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank", this_rank())
        self._group = self.group if self.group is not None else coordination(self.timeout_s)

    @property
    def checkpoint_id(self) -> str:
        """This save's name in DCP's logs and metadata: ``ckptfs:MODEL@STEP``. Where DCP reads it
        just before its planning gather, the ranks meet first (``meet_before_dcp``)."""
        meet_before_dcp(self, "_save_state_dict", f"dcp.save of step {self.step} of {self.model!r}")
        return f"ckptfs:{self.model}@{self.step}"

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        """This rank's part, then the global commit (see the module's docstring); the future
        completes when the step is the global latest on every node, or fails on every rank."""
        tensors, save = self.write_part(plan.items, planner)
        metadata = getattr(planner, "metadata", None) if self.is_coordinator else None
        done: Future = Future()

        def commit() -> None:
            try:
                done.set_result(self.commit(plan.items, tensors, save, metadata))
            except BaseException as e:  # noqa: BLE001 - delivered to DCP through the future
                done.set_exception(e)

        _pool.submit(commit)
        return done

    def write_part(self, items: list, planner: SavePlanner):
        """Start this rank's part of the step: ``items`` (this rank's final save plan) resolved
        through ``planner`` (set up with the state) and saved as a kept version of the part
        model. Returns (the items' tensors, the part's SaveFuture) once its snapshot is taken:
        the state may change from then on."""
        tensors = [_as_tensor(item, planner.resolve_data(item)) for item in items]
        name = part_model(self.model, self.rank)
        writer = _kept_writer(self.store, name, self.max_inflight)
        with _writers_lock:
            _in_flight.add((self.store.path, name, self.step))
        try:
            save = writer.save({"items": tensors}, step=self.step, keep=True)
        except BaseException:
            self.release_part()
            raise
        return tensors, save

    def release_part(self) -> None:
        """This rank's part of the step is no longer in flight (committed, or given up): from now
        on a later step's ``_release_abandoned`` may unkeep it unless a global version names it."""
        _done_with(self.store, part_model(self.model, self.rank), self.step)

    def commit(self, items: list, tensors: list, save, metadata: Metadata | None, *,
               reclaim: bool = True, results: bool = True) -> list[WriteResult] | None:
        """Once the part (``save``, from ``write_part``) is durable, or failed: the global commit
        (see the module's docstring), on every rank in the same order of steps; returns DCP's
        write results (with ``results``; else None). ``metadata``: DCP's global metadata on the
        coordinator (or its ``encode_metadata`` text), else None.
        ``reclaim``: then reclaim the older parts, whether the commit succeeded or failed (else
        the caller calls ``reclaim`` later, once it has told its own caller how the step went)."""
        try:
            try:
                counter = save.result().counter
                ok, error = True, None
            except BaseException as e:  # noqa: BLE001 - told to every rank, raised by _commit
                counter, ok, error = None, False, f"rank {self.rank}: {e}"
            self._commit(items, counter, ok, error, metadata)
        except BaseException:
            self.release_part()
            if reclaim:
                self.reclaim_quietly()
            raise
        self.release_part()  # only now: a part durable but not yet committed stays kept
        if reclaim:
            self.reclaim()
        return write_results(items, tensors, self.rank, counter) if results else None

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Nothing is left: every node committed the global version in ``write_data``."""

    # ---------------------------------------------------------------- the global commit
    def _commit(self, items, counter, ok, error, metadata) -> None:
        # (wall clock) this rank's part durable, and the step recorded on every node: the
        # global-commit latency is the last of the first to the second (tools/bench_dist.py)
        self.part_durable_at = time.time()
        region = self.store.region.superblock.uuid.hex()
        places = self.plan_places
        mine = {"rank": self.rank, "region": region, "ok": ok, "error": error, "counter": counter,
                "model": self.model, "step": self.step, "items": None, "metadata": None}
        if not places:
            mine.update(items=[encode_index(item.index) for item in items],
                        metadata=metadata if metadata is None or isinstance(metadata, str) else encode_metadata(metadata))
        everyone = exchange(mine, self._group, f"the exchange of parts of {self.model!r} step {self.step}",
                             Arrival(self._group, f"{self.model}/parts"))
        check_agreement(everyone)
        failed = [p["error"] for p in everyone if not p["ok"]]
        if failed:
            raise CkptfsError(f"step {self.step} of {self.model!r} was not committed: " + "; ".join(failed))
        leaders = {p["region"]: p["rank"] for p in sorted(everyone, key=lambda p: -p["rank"])}
        leader = leaders[region] == self.rank
        recorded, why = True, None
        if leader:
            try:
                placed = places["placed"] if places else _placed(everyone)
                if places is not None:
                    places["placed"] = placed  # the later commits of the plan send no items
                _record_here(self.store, self.model, self.step, placed.render({p["rank"]: p["counter"] for p in everyone}),
                             self.keep, self.extra)
            except BaseException as e:  # noqa: BLE001 - told to every rank
                recorded, why = False, f"rank {self.rank} (region {region}): {e}"
        acks = exchange({"ok": recorded, "error": why}, self._group,
                         f"the acknowledgement of {self.model!r} step {self.step}")
        failed = [a["error"] for a in acks if not a["ok"]]
        if failed:
            raise CkptfsError(f"step {self.step} of {self.model!r} is not recorded on every node: " + "; ".join(failed))
        if places is not None and not places:
            places["placed"] = None  # not a leader: nothing of the plan's places to keep
        self.committed_at = time.time()
        if leader:
            self._node_ranks = [p["rank"] for p in everyone if p["region"] == region]

    def reclaim(self) -> None:
        """After the commit, or its failure (off the caller's stall: a save's snapshot never waits
        for it): unkeep this rank's older parts that no global version names (see
        ``_release_abandoned``), and, on each node's leader after a commit, the node's parts
        older than the step."""
        _release_abandoned(self.store, self.model, part_model(self.model, self.rank), self.step)
        if self._node_ranks:
            _reclaim(self.store, self.model, self._node_ranks, keep_step=self.step)

    def reclaim_quietly(self) -> None:
        """``reclaim``, its failure only logged: the commit's outcome is what the caller is told,
        and a later commit reclaims again."""
        try:
            self.reclaim()
        except Exception as e:  # noqa: BLE001 - a later commit reclaims again
            log.warning("ckptfs: reclaiming the parts of %s older than step %d failed: %s", self.model, self.step, e)


class StorageReader(_DCPReader):
    """Reads the newest global DCP checkpoint of ``model`` (or ``step``) that every node
    records. ``store``: this rank's node's region; ``peers``: other regions whose parts it may
    need (another node's, reachable from here, as in a test of two nodes on one machine)."""

    def __init__(self, store, model: str, step: int | None = None, *, peers=(), timeout_s: float = 300.0,
                 group=None):
        super().__init__()
        self.group = group
        self.store = store
        self.model = model
        self.step = step
        self.timeout_s = timeout_s
        self.regions = {s.region.superblock.uuid.hex(): s for s in (store, *peers)}
        self.metadata: Metadata | None = None

    def reset(self, checkpoint_id=None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False

    @property
    def checkpoint_id(self) -> str:
        """This load's name in DCP's logs: ``ckptfs:MODEL@STEP`` (``@newest`` without a step).
        Where DCP reads it just before its planning gather, the ranks meet first
        (``meet_before_dcp``): a rank that never calls ``dcp.load`` is named after ``timeout_s``."""
        meet_before_dcp(self, "_load_state_dict", f"dcp.load of {self.model!r}")
        return f"ckptfs:{self.model}@{'newest' if self.step is None else self.step}"

    def read_metadata(self, *args, **kwargs) -> Metadata:
        # every rank runs this (DCP's local step of a load): the ranks agree on the step here
        steps = _recorded_steps(self.store, self.model)
        if self.step is not None:
            steps &= {self.step}
        group = self.group if self.group is not None else coordination(self.timeout_s)
        agreed = set.intersection(*[set(s) for s in exchange(sorted(steps), group,
                                                              f"the agreement on a step of {self.model!r} to load")])
        if not agreed:
            if self.step is not None:
                raise NotFoundError(f"step {self.step} of {self.model!r} is not a DCP checkpoint that every node "
                                    "records; `ckptfs ls` lists the steps")
            raise no_version_yet(self.model)
        step = max(agreed)
        with _global_version(self.store, self.model, step) as v:
            text = dict(v.manifest.files)[METADATA_FILE]
        # every node's record of the step must be the same checkpoint: a node whose region holds
        # the model of another job at the same step would load a mixture
        digests = exchange((self.store.path, hashlib.sha256(text.encode()).hexdigest()), group,
                           f"the comparison of step {step} of {self.model!r} across the nodes")
        if len({d for _, d in digests}) > 1:
            kinds: dict[str, list[str]] = {}
            for path, d in digests:
                kinds.setdefault(d, []).append(path)
            raise CorruptionError(f"the nodes' regions hold different checkpoints as step {step} of {self.model!r} "
                                  f"({' / '.join(', '.join(sorted(set(p))) for p in kinds.values())}): one of them "
                                  "belongs to another job; load with the regions of this job only")
        self.metadata = decode_metadata(text)
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        self.metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        storage = self.metadata.storage_data
        by_part: dict[tuple, list] = {}
        for item in plan.items:
            where = storage[item.storage_index]
            by_part.setdefault((where["region"], where["rank"], where["counter"]), []).append((item, where["pos"]))
        for (region, rank, counter), items in sorted(by_part.items()):
            with open_part(self._store_of(region, rank), self.model, rank, counter) as part:
                stored = item_records(part)
                read_into_plan(part.data, [(item, stored[pos]) for item, pos in items], planner)
        done: Future = Future()
        done.set_result(None)
        return done

    def _store_of(self, region: str, rank: int):
        store = self.regions.get(region)
        if store is None:
            raise NotFoundError(f"the part of rank {rank} of {self.model!r} is in region {region} (another node's), "
                                "which this rank cannot read: pass that region's store in peers=, or load where "
                                "the parts are (a shared tier to drain them to is not built yet)")
        return store


# -------------------------------------------------------------------------------- helpers
def _placed(everyone: list[dict]) -> PlacedMetadata:
    """The global version's ``dcp-metadata.json`` to be: DCP's metadata (the coordinator's), with
    each item's place, from every rank's part of the exchange."""
    (metadata,) = [p["metadata"] for p in everyone if p["metadata"] is not None] or [None]
    if metadata is None:
        raise CkptfsError("the coordinator's planner has no global metadata (ckptfs needs DCP's DefaultSavePlanner "
                          "or one that keeps .metadata)")
    return PlacedMetadata(metadata, [(index, {"region": p["region"], "rank": p["rank"], "pos": pos})
                                     for p in everyone for pos, index in enumerate(p["items"])])


_recorded: dict[tuple[str, str], set[int]] = {}  # (region, model) -> steps this process recorded there


def _record_here(store, model: str, step: int, record: str, keep: bool = False, extra: dict | None = None) -> None:
    """Commit the global version of ``step`` in this node's region, unless a newer step is latest:
    one of this job's saves that finished first (an older save never wins), or else one of
    another job, or of an earlier run that got further than where this one resumed. The step
    would then never become latest, and this job's saves would all vanish: CkptfsError, saying
    what to do."""
    latest = _latest(store, model)
    key = (store.region.superblock.uuid.hex(), model)
    if latest is not None and latest.step > step and latest.step not in _recorded.get(key, ()):
        raise CkptfsError(
            f"{model!r} in region {store.path} is already at step {latest.step} (another job's, or an earlier run "
            f"that got further), so step {step} would never become its latest: save under another model name, "
            f"or remove the versions after the step you resumed from (`ckptfs rm {model} STEP...`)")
    if latest is not None and latest.step >= step:
        return
    w = _kept_writer(store, model, 1)
    w.save({"dcp": {"step": step}}, step=step, extra={**(extra or {}), METADATA_FILE: record}, keep=keep).result()
    _recorded.setdefault(key, set()).add(step)


def write_results(items: list, tensors: list, rank: int, counter: int | None) -> list[WriteResult]:
    """DCP's write results of a rank's part (ckptfs's own record of the places is the global
    version's metadata, ``_placed``; these are what DCP's finish step expects)."""
    return [WriteResult(index=item.index, size_in_bytes=_nbytes(t),
                        storage_data={"rank": rank, "counter": counter, "pos": pos})
            for pos, (item, t) in enumerate(zip(items, tensors))]


def meet_before_dcp(storage, dcp_function: str, what: str) -> None:
    """The ranks meet (``ckptfs.dist.group.meet``: at most ``storage.timeout_s``) if the caller
    of ``storage.checkpoint_id`` is DCP's ``dcp_function`` (``_save_state_dict`` /
    ``_load_state_dict``), which reads it just before its planning gather, outside the handler
    that gathers the ranks' errors: the one place where a storage can stop a ``dcp.save`` or
    ``dcp.load`` before that gather. There a rank that never calls it would keep the others
    waiting until their process group's timeout, with an error that names no one; after the
    meeting they fail after ``timeout_s`` naming it, and ranks at different steps or models fail
    at once. Read anywhere else (DCP's logging, ``async_save``'s calling thread too), nothing
    happens, so that no rank waits for another outside the thread that plans."""
    if sys._getframe(2).f_code.co_name != dcp_function:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        load = isinstance(storage, StorageReader)
        step = storage.step if storage.step is not None else "newest"
        meet(storage.group or dist.group.WORLD, {"model": storage.model, "step": step}, storage.timeout_s, what,
             load=load)


def _as_tensor(item, data) -> torch.Tensor:
    if item.type == WriteItemType.BYTE_IO:
        raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return data.detach()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _kept_writer(store, model: str, max_inflight: int):
    """One writer per part model (or global model) and open region in this process, reused by
    every step (its staging pool and ring stay warm); a store opened again gets a new one."""
    key = (store.path, model)
    with _writers_lock:
        w = _writers.get(key)
        if w is None or w._closed or w.region is not store.region:
            if w is not None and not w._closed:
                _close_stale(w)
            w = store.writer(model, max_inflight=max_inflight)
            _writers[key] = w
        return w


def _close_stale(writer) -> None:
    """Close the cached writer of a store that was closed (its saves ended with it)."""
    try:
        writer.close()
    except Exception as e:  # noqa: BLE001 - its region is gone; nothing of it is needed
        log.debug("ckptfs: closing the writer of a closed store: %s", e)


def _latest(store, model: str):
    try:
        return store.latest(model)
    except NotFoundError:
        return None


def _recorded_steps(store, model: str) -> set[int]:
    try:
        return {v.step for v in store.versions(model)}
    except NotFoundError:
        return set()


def _global_version(store, model: str, step: int | None):
    """The pinned global version of ``model`` at ``step`` (None: the newest)."""
    if step is None and _latest(store, model) is None:
        raise no_version_yet(model)
    v = store.open_version(model, step)
    if not is_global_version(v.manifest):
        v.close()
        raise NotFoundError(f"step {v.info.step} of {model!r} is not a DCP checkpoint (it has no {METADATA_FILE}); "
                            "load it with Store.load")
    return v


def checkpoint_bytes(store, model: str, step: int) -> tuple[int, int, int] | None:
    """(bytes of the parts in ``store``'s region, ranks, ranks whose part is in another region)
    of the global DCP version ``step`` of ``model``, or None if that version is not one."""
    with store.open_version(model, step) as v:
        text = dict(v.manifest.files).get(METADATA_FILE)
    if text is None:
        return None
    here = store.region.superblock.uuid.hex()
    parts = part_places(decode_metadata(text))
    nbytes = 0
    for rank, region, counter in parts:
        if region == here:
            nbytes += sum(x.data_bytes for x in store.versions(part_model(model, rank)) if x.counter == counter)
    return nbytes, len({rank for rank, _, _ in parts}), len({rank for rank, region, _ in parts if region != here})


def part_places(metadata: Metadata) -> list[tuple[int, str, int]]:
    """(rank, region, counter) of every part a global version's metadata names, by rank."""
    return sorted({(w["rank"], w["region"], w["counter"]) for w in metadata.storage_data.values()})


def open_part(store, model: str, rank: int, counter: int, checked: set[int] | None = None):
    """The pinned part version of ``rank`` with ``counter``; CorruptionError if it is gone.
    ``checked``: as ``Store.open_version``'s."""
    name = part_model(model, rank)
    match = [v for v in store.versions(name) if v.counter == counter]
    if match:
        v = store.open_version(name, match[0].step, checked=checked)
        if v.info.counter == counter:
            return v
        v.close()
    raise CorruptionError(f"the part of rank {rank} (counter {counter}) of {model!r} is gone from {name!r}; "
                          "this global version cannot be loaded, use an older one")


def item_records(part) -> dict[int, int]:
    """{position in the part's item list: its tensor's index in the manifest}."""
    return {int(ref.key_path[1]): ref.tensor_index for ref in part.manifest.refs() if ref.key_path[:1] == ("items",)}


_in_flight: set[tuple[str, str, int]] = set()  # (region, part model, step) of this process's saves not yet committed


def _done_with(store, name: str, step: int) -> None:
    with _writers_lock:
        _in_flight.discard((store.path, name, step))


def _release_abandoned(store, model: str, name: str, step: int) -> None:
    """After a rank's commit of ``step``, or its failure: unkeep its parts older than ``step`` that
    no global version of this region names (saves that failed or whose process died; this
    process's own saves still in flight excepted), so that a job whose saves keep failing does not
    fill the region (the part of a failed step goes at the next step's commit)."""
    latest = _latest(store, model)
    try:
        parts = store.versions(name)
    except NotFoundError:
        return
    with _writers_lock:
        busy = {s for path, n, s in _in_flight if path == store.path and n == name}
    _unkeep(store, name, [v for v in parts if v.step < step and (latest is None or v.step != latest.step)
                          and v.step not in busy])


def _reclaim(store, model: str, ranks, keep_step: int) -> None:
    """Unkeep the parts of ``ranks`` older than global step ``keep_step`` (superseded, or of a step
    that never completed), so that the part models' rings reuse them."""
    names = set(store.models())
    for name in (part_model(model, r) for r in ranks):
        if name in names:
            _unkeep(store, name, [v for v in store.versions(name) if v.step < keep_step])


def _unkeep(store, name: str, versions) -> None:
    """Unkeep those of ``versions`` (of part model ``name``) that are kept."""
    for v in versions:
        if v.kept:
            try:
                store.unkeep(name, v.step)
            except NotFoundError:
                pass  # reused meanwhile: nothing to give back
