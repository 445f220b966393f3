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
The load is ``ckptfs.dist.reader``; a part's places and lifecycle are ``ckptfs.dist.parts``.
"""
from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import socket
import stat
import threading
import time

import torch
from torch.distributed.checkpoint import StorageWriter as _DCPWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ckptfs.dist import parts
from ckptfs.dist.codec import PlacedMetadata, encode_index, encode_metadata
from ckptfs.dist.group import Arrival, check_agreement, exchange, meet_before_dcp, storage_group, this_rank
from ckptfs.dist.names import (METADATA_FILE, checkpoint_id_of, part_model, part_models, refuse_part_name,
                               step_of_checkpoint_id)
from ckptfs.dist.resolve import Resolved, resolve_items
from ckptfs.errors import CkptfsError, UnsupportedObjectError
from ckptfs.views import checked_extra
from ckptfs.writer.writer import Writer

__all__ = ["StorageWriter"]

log = logging.getLogger("ckptfs")
_writers: dict[tuple[str, str], object] = {}  # (region, model) -> its Writer, kept across steps (_kept_writer)
_writers_lock = threading.Lock()


def region_identity(store) -> str:
    """The machine (its boot id) and the file (device and inode) of ``store``'s region: the same
    for every rank that opens it, whatever the path, and different for a copy of it."""
    st = store.region.backend.stat()
    if stat.S_ISBLK(st.st_mode) or stat.S_ISCHR(st.st_mode):  # the device, whatever node names it
        return f"{_machine()}:device:{st.st_rdev}"
    return f"{_machine()}:{st.st_dev}:{st.st_ino}"


@functools.cache
def _machine() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def check_distinct_regions(everyone: list[dict]) -> None:
    """CkptfsError (on every rank alike) where two ranks' regions are copies of one region (the
    same uuid, another file or machine: a template image, a cloned disk). They count as one node,
    so only one of them recorded each step, whose other parts it named in its own region: every
    save was reported committed and nothing could be loaded."""
    seen: dict[str, dict] = {}
    for p in everyone:
        first = seen.setdefault(p["region"], p)
        if first["where"] != p["where"]:
            raise CkptfsError(f"the regions of ranks {first['rank']} and {p['rank']} are copies of one region (the "
                              f"same uuid {p['region'][:8]}..., other files): give each node a region of its own "
                              "(`ckptfs mkfs --force` on the copy gives it a uuid of its own, erasing it); nothing was "
                              "committed")


class StorageWriter(_DCPWriter):
    """Writes step ``step`` of ``model``: this rank's part into ``store`` (its node's region),
    and, on each node's leader, the global version once every part of every rank is durable.
    ``timeout_s``: the longest the ranks wait for each other (a dead or missing rank fails the
    save, and is named). ``keep`` and ``extra``: as ``Writer.save``'s, for the global version.

    It travels to another process as the path of its region, reopened there: DCP's process-based
    ``async_save`` (``async_checkpointer_type=AsyncCheckpointerType.PROCESS``) writes from a
    background process per rank, whose process group of its own coordinates the ranks there (a
    ``group`` given here stays behind)."""

    def __init__(self, store, model: str, step: int, *, max_inflight: int = 2, timeout_s: float = 300.0,
                 group=None, keep: bool = False, extra: dict | None = None):
        super().__init__()
        refuse_part_name(model)
        self.group = group  # the gloo group to coordinate through (default: one of ckptfs's own)
        self.dcp_solo = False  # DCP's no_dist, or a process_group= of one rank (group.storage_group)
        self.store = store
        self.model = model
        self.step = step
        self.keep = keep  # the global version is a milestone (see Writer.save)
        self.part_durable_at = self.committed_at = None  # set by the commit (see _commit)
        checked_extra(extra)  # refused here, on every rank: at the commit, every rank's part was written
        self.extra = dict(extra or {})  # small files of the global version (e.g. config.json)
        self.max_inflight = max_inflight
        self.timeout_s = timeout_s
        # when this job asked for the save: a newer step committed after it is one of the job's own
        # saves that finished first, whatever process recorded it (DCP's background process of
        # async_save records beside the training process); see _record_here
        self.started_ns = time.time_ns()
        self.rank = 0
        self.is_coordinator = True
        self._group = None
        self._recorded_here = False  # this rank, a node's leader, committed the global version here
        # Set by a writer whose saves reuse one DCP plan (the same on every rank): filled at the
        # plan's first commit (on a node's leader with the global metadata and every item's
        # place, PlacedMetadata; elsewhere with nothing), so that the later commits exchange only
        # their counters (GPT-2 small at W=4: the metadata is ~0.5 MB of JSON, sent to every rank
        # at every step otherwise).
        self.plan_places: dict | None = None

    def __getstate__(self) -> dict:
        # a Store holds its region's mapping and locks, a process group its process's sockets:
        # the receiving process opens the region itself and coordinates through its own group
        return dict(self.__dict__, store=os.path.abspath(self.store.path), group=None, _group=None)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.store = _store_at(state["store"])

    # ---------------------------------------------------------------- DCP's StorageWriter
    def reset(self, checkpoint_id=None) -> None:
        """The checkpoint is (model, step), given to the constructor; a ``checkpoint_id`` given
        to DCP beside it must name the same (``names.step_of_checkpoint_id``): ValueError, before
        anything is written, where it names another step."""
        if checkpoint_id is None:
            return
        step = step_of_checkpoint_id(checkpoint_id, self.model, "StorageWriter")
        if step != self.step:
            raise ValueError(f"checkpoint_id={checkpoint_id!r} names step {'newest' if step is None else step}, and "
                             f"StorageWriter(step={self.step}) saves step {self.step}: pass the same step to both")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False  # never chosen from a path: pass storage_writer=StorageWriter(...)

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        # every rank runs this, in the same order: the place to make the coordination group
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank", this_rank())
        self._group = storage_group(self, "save")

    @property
    def checkpoint_id(self) -> str:
        """This save's name in DCP's logs and metadata: ``ckptfs:MODEL@STEP``. Where DCP reads it
        just before its planning gather, the ranks meet first (``meet_before_dcp``)."""
        meet_before_dcp(self, "_save_state_dict", f"dcp.save of step {self.step} of {self.model!r}")
        return checkpoint_id_of(self.model, self.step)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        """This rank's part, then the global commit (see the module's docstring); the future
        completes when the step is the global latest on every node, or fails on every rank."""
        try:
            tensors, save = self.write_part(plan.items, resolve_items(plan.items, planner))
        except Exception as e:  # noqa: BLE001 - the commit tells every rank, which then all fail at once
            # (raised here, the others waited for this rank's part in the commit's exchange
            # until timeout_s, and the coordination group was broken for every later save)
            tensors, save = [], concurrent.futures.Future()
            save.set_exception(e)
        metadata = getattr(planner, "metadata", None) if self.is_coordinator else None
        done: Future = Future()

        def commit() -> None:
            try:
                done.set_result(self.commit(plan.items, tensors, save, metadata))
            except BaseException as e:  # noqa: BLE001 - delivered to DCP through the future
                done.set_exception(e)

        # A thread of its own: a commit waits for its part and for every rank's (seconds, up to
        # timeout_s), and the commits of saves in flight at once (a model and its EMA, each an
        # async_save) must all be waiting together; a pool of a few threads kept one queued
        # behind the others, which on another rank could wait for it. Not a daemon: the
        # interpreter's exit waits for a commit under way, as for any save.
        threading.Thread(target=commit, name=f"ckptfs-dcp-commit-{self.model}@{self.step}").start()
        return done

    def write_part(self, items: list, resolved: Resolved):
        """Start this rank's part of the step: ``resolved``, the data of ``items`` (this rank's
        final save plan; ``ckptfs.dist.resolve``), saved as a kept version of the part model
        (``parts.part_state``). Returns (its tensors, the part's SaveFuture) once its snapshot
        is taken: the state may change from then on."""
        name = part_model(self.model, self.rank)
        # a part hidden by a later save of its step may still be named by the global latest (a
        # step saved again whose global commit fails): parts.py gives parts back, not the writer
        writer = _kept_writer(self.store, name, self.max_inflight, give_back_hidden=False, timeout_s=self.timeout_s)
        parts.release_earlier_runs(self.store, self.model, name, self.step)
        parts.started(self.store, name, self.step)
        try:
            save = writer.save(parts.part_state(resolved.tensors, resolved.values), step=self.step, keep=True)
        except UnsupportedObjectError as e:  # its path is the part's (items.3): say the state's key instead
            self.release_part()
            raise UnsupportedObjectError(parts.named_by_fqn(str(e), items)) from None
        except BaseException:
            self.release_part()
            raise
        return resolved.tensors, save

    def release_part(self) -> None:
        """This rank's part of the step is no longer in flight (committed, or given up): from now
        on a later step's ``parts.release_abandoned`` may unkeep it unless a global version names it."""
        parts.done_with(self.store, part_model(self.model, self.rank), self.step)

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
                "model": self.model, "step": self.step, "items": None, "metadata": None, "where": None,
                "refuse": None}
        try:  # a failure here is told to every rank, as the part's: not raised alone before the exchange
            mine.update(where=region_identity(self.store),
                        refuse=refuse_to_record(self.store, self.model, self.step, self.started_ns, self.keep))
            if not places:
                mine.update(items=[encode_index(item.index) for item in items],
                            metadata=metadata if metadata is None or isinstance(metadata, str)
                            else encode_metadata(metadata))
        except Exception as e:  # noqa: BLE001 - an unreadable header, a planner's data that JSON cannot hold
            mine.update(ok=False, error=error or f"rank {self.rank}: {e}")
        everyone = exchange(mine, self._group, f"the exchange of parts of {self.model!r} step {self.step}",
                             Arrival(self._group, f"{self.model}/parts"))
        check_agreement(everyone)
        failed = [p["error"] for p in everyone if not p["ok"]]
        if failed:
            raise CkptfsError(f"step {self.step} of {self.model!r} was not committed: " + "; ".join(failed))
        check_distinct_regions(everyone)
        leaders = {p["region"]: p["rank"] for p in sorted(everyone, key=lambda p: -p["rank"])}
        leader = leaders[region] == self.rank
        refused = [p["refuse"] for p in everyone if p["refuse"] and leaders[p["region"]] == p["rank"]]
        if refused:  # the leaders' own verdicts (the steps each recorded are its process's to know)
            raise CkptfsError(f"step {self.step} of {self.model!r} was not committed on any node: {refused[0]}")
        recorded, why = True, None
        if leader:
            try:
                placed = places["placed"] if places else _placed(everyone)
                if places is not None:
                    places["placed"] = placed  # the later commits of the plan send no items
                _record_here(self.store, self.model, self.step, placed.render({p["rank"]: p["counter"] for p in everyone}),
                             self.started_ns, self.keep, self.extra, regions=sorted(leaders))
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
        self._recorded_here = leader

    def reclaim(self) -> None:
        """After the commit, or its failure (off the caller's stall: a save's snapshot never waits
        for it): unkeep this rank's older parts that no global version names (see
        ``parts.release_abandoned``), and, on each node's leader after a commit, every part in
        its region older than the step (``parts.reclaim``)."""
        parts.release_abandoned(self.store, self.model, part_model(self.model, self.rank), self.step)
        if self._recorded_here:
            parts.reclaim(self.store, self.model, keep_step=self.step)

    def reclaim_quietly(self) -> None:
        """``reclaim``, its failure only logged: the commit's outcome is what the caller is told,
        and a later commit reclaims again."""
        try:
            self.reclaim()
        except Exception as e:  # noqa: BLE001 - a later commit reclaims again
            log.warning("ckptfs: reclaiming the parts of %s older than step %d failed: %s", self.model, self.step, e)


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


def _record_here(store, model: str, step: int, record: str, started_ns: int, keep: bool = False,
                 extra: dict | None = None, regions: list[str] = ()) -> None:
    """Commit the global version of ``step`` in this node's region, unless a newer step is latest
    (an older step never becomes latest): one of this job's saves, recorded after this one was
    asked for at ``started_ns``, that finished first (then not recorded, said in the log; a
    milestone, ``keep``, raises CkptfsError), or one recorded before it was asked for (another
    job's, an earlier run that got further, this job gone back to an older step): CkptfsError,
    saying what to do (``refuse_to_record``). A step saved again (a job resumed at the step it
    saves next) is recorded again: the new version names the new parts, which hide the earlier
    save's in the part models (an earlier version not recorded again would name parts that no
    listing finds)."""
    refusal = refuse_to_record(store, model, step, started_ns, keep)
    if refusal is not None:
        raise CkptfsError(refusal)
    latest = store.latest(model, missing_ok=True)
    if latest is not None and latest.step > step and latest.time_ns >= started_ns:
        # one of this job's newer saves finished first: this one would be latest (the highest
        # counter), so it is not recorded, and said (a ring version, superseded as it came; a
        # milestone is refused in refuse_to_record)
        log.warning("ckptfs: step %d of %r finished after step %d, already latest, and is not recorded (an older "
                    "step never becomes latest)", step, model, latest.step)
        return
    checked_extra(extra)  # the caller's: the records' names are ours
    w = _kept_writer(store, model, 1)
    # ``regions``: the uuids of every node's region, which each records the step (a load tells a
    # commit cut between the leaders' records from a step saved without some node: reader.py)
    w.save({"dcp": {"step": step, "regions": list(regions)}}, step=step,
           extra={**(extra or {}), METADATA_FILE: record}, keep=keep).result()


def refuse_to_record(store, model: str, step: int, started_ns: int, keep: bool = False) -> str | None:
    """Why the node of ``store`` would not record ``step`` of ``model`` (``_record_here``), or
    None. Every leader says it in the exchange of parts, before any of them records: one that
    refused while another recorded left the nodes' regions holding different steps, and every
    later load failed. ``keep``: the step is a milestone, which must not go unrecorded in
    silence when a newer save of the job finished first."""
    latest = store.latest(model, missing_ok=True)
    if latest is None or latest.step <= step:
        return None
    if latest.time_ns >= started_ns:  # one of this job's newer saves finished first
        if keep:
            return (f"step {step} of {model!r} (keep=True) finished after step {latest.step}, already latest, and an "
                    "older step never becomes latest: the milestone was not recorded; save milestones with no newer "
                    "save in flight (wait for the previous save's future first)")
        return None
    # asked for after the newer step was recorded: another job's, an earlier run that got further,
    # or this job gone back (a load of an older step after a loss spike), which the region cannot
    # tell apart; it would never become latest (and was dropped in silence when this process had
    # recorded the newer step itself)
    return (f"{model!r} in region {store.path} is already at step {latest.step} (another job's, an earlier "
            f"run that got further, or this job gone back to an older step), so step {step} would never become its "
            f"latest: save under another model name, or remove the versions after the step you resumed from, in "
            f"every node's region (`ckptfs rm --allow-latest {model} STEP...`)")


def write_results(items: list, tensors: list, rank: int, counter: int | None) -> list[WriteResult]:
    """DCP's write results of a rank's part (ckptfs's own record of the places is the global
    version's metadata, ``_placed``; these are what DCP's finish step expects)."""
    return [WriteResult(index=item.index, size_in_bytes=_nbytes(t),
                        storage_data={"rank": rank, "counter": counter, "pos": pos})
            for pos, (item, t) in enumerate(zip(items, tensors))]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


_stores: dict[str, object] = {}  # region path -> the Store this process opened for StorageWriters it received


def _store_at(path: str):
    """This process's Store of the region at ``path`` (opened at the first StorageWriter that
    arrives from another process; kept, with its writers, for the next ones)."""
    from ckptfs.store import Store

    with _writers_lock:
        store = _stores.get(path)
        if store is None:  # never closed by anyone else: no caller holds it
            store = _stores[path] = Store(path)
        return store


def _kept_writer(store, model: str, max_inflight: int, give_back_hidden: bool = True, timeout_s: float = 120.0):
    """One writer per part model (or global model) and open region in this process, reused by
    every step (its staging pool and ring stay warm); a store opened again gets a new one.
    ``give_back_hidden``, ``timeout_s``: as the Writer's (the latter, the first save's: its
    claims waited the Writer's default, whatever the StorageWriter or DistWriter was given)."""
    key = (store.path, model)
    with _writers_lock:
        w = _writers.get(key)
        if (w is None or w._closed or w._pid != os.getpid() or w.region is not store.region
                or w.model_removed()):
            if w is not None and not w._stopped:  # a close cut short by Ctrl-C is taken up (a forked copy: no-op)
                _close_stale(w)
            # not store.writer, which refuses the names of part models to its callers
            # not sole: a DCP background process (async_save's) keeps writers of the same models
            w = Writer(store.region, model, max_inflight=max_inflight, give_back_hidden=give_back_hidden, sole=False,
                       timeout_s=timeout_s)
            _writers[key] = w
        return w


def close_idle_writers(store, model: str) -> None:
    """Close the writers this process keeps for ``model`` and its part models in ``store``'s
    region (``_kept_writer``) that have no save in flight: before a removal of the model (an
    open writer keeps it from being removed), and at a DistWriter's close; one with a save in
    flight stays (the removal is refused)."""
    with _writers_lock:
        models = {model, *part_models(store, model, [name for _, name in _writers])}
        idle = [(key, w) for key, w in _writers.items()
                if key[0] == store.path and key[1] in models and not w._stopped and not w.saves_in_flight()]
        for key, _ in idle:
            del _writers[key]
    for _, w in idle:
        _close_stale(w)


def _close_stale(writer) -> None:
    """Close the cached writer of a store that was closed (its saves ended with it), or of a
    model removed since."""
    try:
        writer.close()
    except Exception as e:  # noqa: BLE001 - its region is gone; nothing of it is needed
        log.debug("ckptfs: closing the writer of a closed store: %s", e)


