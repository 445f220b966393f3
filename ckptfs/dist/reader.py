"""ckptfs as the storage DCP loads from: ``dcp.load(sd, storage_reader=StorageReader(store, model))``.

Every rank: the ranks agree on the newest step that every node's region records (a crash between
two nodes' commits leaves them one step apart for a while: the older is taken, and its parts were
not released), read its metadata from their own region (JSON: ``ckptfs.dist.codec``; checked to
be the same checkpoint on every node), and each reads the pieces its load plan asks for from the
parts (``ckptfs.dist.load``), in whichever given region holds them. DCP's planner reshards.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import sys
from concurrent.futures import ThreadPoolExecutor

from torch.distributed.checkpoint import StorageReader as _DCPReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from ckptfs.dist.codec import decode_metadata
from ckptfs.dist.group import exchange, meet_before_dcp, storage_group
from ckptfs.dist.load import PartRead, read_parts, wanted_tensors
from ckptfs.dist.names import METADATA_FILE, checkpoint_id_of, is_global_version, step_of_checkpoint_id
from ckptfs.dist.parts import item_records, open_part, shown_item_name
from ckptfs.dist.single import ONE_PROCESS, one_process_metadata, open_one_process
from ckptfs.errors import CkptfsError, CorruptionError, NotFoundError, no_version_yet
from ckptfs.gcpause import GCHold, paused_gc
from ckptfs.scan import ReadAhead, ReadBuffers

log = logging.getLogger("ckptfs")


OPEN_THREADS = 8  # the parts of a load opened at once


class StorageReader(_DCPReader):
    """Reads the newest global DCP checkpoint of ``model`` (or ``step``) that every node
    records. ``store``: this rank's node's region; ``peers``: other regions whose parts it may
    need (another node's, reachable from here, as in a test of two nodes on one machine)."""

    def __init__(self, store, model: str, step: int | None = None, *, peers=(), timeout_s: float = 300.0,
                 group=None):
        super().__init__()
        self.group = group
        self.dcp_solo = False  # DCP's no_dist, or a process_group= of one rank (group.storage_group)
        self.store = store
        self.model = model
        self.step = step
        self.timeout_s = timeout_s
        self.regions = {s.region.superblock.uuid.hex(): s for s in (store, *peers)}
        self.metadata: Metadata | None = None
        self.metadata_error: BaseException | None = None  # what stopped read_metadata (see there)
        self._ahead: _LoadAhead | None = None  # see prepare_local_plan
        self._gc_hold = GCHold()  # see checkpoint_id

    def reset(self, checkpoint_id=None) -> None:
        """Nothing of an earlier load is kept (its failure would fail every later load of a
        reader used again: an eval loop polling for a step). A ``checkpoint_id`` given to DCP
        names the step to load from now on (``names.step_of_checkpoint_id``; ValueError for one
        that names none)."""
        if checkpoint_id is not None:
            self.step = step_of_checkpoint_id(checkpoint_id, self.model, "StorageReader")
        self._drop_ahead()
        self._gc_hold.release()
        self.metadata, self.metadata_error = None, None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False

    @property
    def checkpoint_id(self) -> str:
        """This load's name in DCP's logs: ``ckptfs:MODEL@STEP`` (``@newest`` without a step).
        Where DCP reads it just before its planning gather, the ranks meet first
        (``meet_before_dcp``): a rank that never calls ``dcp.load`` is named after ``timeout_s``.
        From there to the end of read_data the cyclic GC is paused: DCP's metadata and
        planning, much of it between our calls, started a full collection of the rank's heap in
        most loads (see ckptfs.gcpause). A load that fails before read_data resumes it as DCP's
        call returns (GCHold: within a quarter of a second), or after ``timeout_s``."""
        if meet_before_dcp(self, "_load_state_dict", f"dcp.load of {self.model!r}", load=True):
            self._gc_hold.hold(self.timeout_s, sys._getframe(1))  # until DCP's _load_state_dict returns
            # a load starts (DCP resets a reader only when given a checkpoint_id): nothing of an
            # earlier one is kept; its failure failed every later load of a reader used again
            self.metadata, self.metadata_error = None, None
        return checkpoint_id_of(self.model, self.step)

    def read_metadata(self, *args) -> Metadata:
        # Every rank runs this (DCP's local step of a load): the ranks agree on the step here, in
        # collectives. No ``**kwargs``: DCP calls a reader that takes them again after a failure
        # (``rank=``, for a rank-local metadata ckptfs has none of), logging a second traceback;
        # a call again raises the same error at once, as its collectives would have met the
        # other ranks' next ones and waited timeout_s for nothing.
        if self.metadata_error is not None:
            raise self.metadata_error
        try:
            with paused_gc():  # the metadata's thousands of objects: see ckptfs.gcpause
                return self._read_metadata()
        except BaseException as e:
            self.metadata_error = e
            self._gc_hold.release()  # no load follows (none to read yet, another job's region)
            raise

    def _read_metadata(self) -> Metadata:
        # the group first: made collectively, it must not wait for a rank that failed before it
        group = storage_group(self, "load")
        failure = None
        try:
            steps = {v.step for v in self.store.versions(self.model, missing_ok=True)}
        except Exception as e:  # noqa: BLE001 - said to the other ranks, which would wait for this one
            steps, failure = set(), e
        if self.step is not None:
            steps &= {self.step}
        everyone = exchange((sorted(steps), None if failure is None else f"{type(failure).__name__}: {failure}"),
                            group, f"the agreement on a step of {self.model!r} to load")
        if failure is not None:
            raise failure
        failed = [why for _, why in everyone if why is not None]
        if failed:
            raise CkptfsError(f"the load of {self.model!r} failed on another rank, listing its steps ({failed[0]})")
        agreed = set.intersection(*[set(s) for s, _ in everyone])
        newest = max((step for s, _ in everyone for step in s), default=None)
        if newest is not None and newest > max(agreed, default=-1):
            self._check_newer_step(newest, newest in steps, agreed, [set(s) for s, _ in everyone], group)
        if not agreed:
            if self.step is not None:
                raise NotFoundError(f"step {self.step} of {self.model!r} is not a version that every node records; "
                                    "`ckptfs ls` lists the steps")
            raise no_version_yet(self.model)
        # the newest step every node records, or (no step asked for) the newest older one whose
        # record every rank reads intact, as a load of one process falls back
        older = sorted(agreed, reverse=True)[1:] if self.step is None else []
        for step in sorted(agreed, reverse=True):
            metadata, record, failure = self._read_step(step)
            damaged = self._compare_nodes(step, record, failure, group, may_fall_back=bool(older))
            if damaged is None:
                self.metadata = metadata
                return metadata
            log.warning("%s; trying step %d of %r instead, the newest older one every node records",
                        damaged, older[0], self.model)
            older.pop(0)
        raise AssertionError("unreachable: the oldest step is read without a fall-back")

    def _check_newer_step(self, newest: int, mine: bool, agreed: set, steps: list[set], group) -> None:
        """Some nodes record ``newest``, newer than every step all nodes record (``agreed``).
        Where it was saved with the region of a node that lacks it, its commit was cut between
        the leaders' records: the newest step all nodes record is the one to load. Where it
        names none of them, it was saved without those nodes (a run on fewer nodes got further),
        or their regions were replaced since: loading an older step silently threw that progress
        away (and with nothing older, 'no committed version yet' restarted the job from step 0).
        Then CkptfsError, on every rank, says so. ``mine``: whether this rank's region records
        ``newest``; ``steps``: what every rank's records, in rank order."""
        named = None  # the regions of every node that saved ``newest`` (None: not known)
        if mine:
            try:
                with self.store.open_version(self.model, newest, whole=False) as v:
                    if is_global_version(v.manifest):
                        saved = v.load()
                        named = saved["dcp"].get("regions") if isinstance(saved.get("dcp"), dict) else None
                    else:  # saved by one process
                        named = [self.store.region.superblock.uuid.hex()]
            except Exception:  # noqa: BLE001 - not to be told apart here: the older step, as before
                named = None
        here = self.store.region.superblock.uuid.hex()
        answers = exchange((here, named), group, f"the look at step {newest} of {self.model!r}")
        lacking = {region for (region, _), s in zip(answers, steps) if newest not in s}
        if any(theirs is None for (_, theirs), s in zip(answers, steps) if newest in s):
            return
        if lacking & {region for _, theirs in answers if theirs for region in theirs}:
            return  # a commit cut between the leaders' records
        have = [rank for rank, s in enumerate(steps) if newest in s]
        lack = [rank for rank, s in enumerate(steps) if newest not in s]
        older = max(agreed, default=None)
        raise CkptfsError(
            f"step {newest} of {self.model!r}, the newest, is recorded in the region of rank(s) "
            f"{', '.join(map(str, have))} only, and was saved without the region of rank(s) "
            f"{', '.join(map(str, lack))} (a run without their nodes got further, or their regions were replaced "
            "since): resume with the nodes and regions that saved it" + (
                f", or load step={older}, the newest every node records (the newer steps must then be removed "
                f"before they are saved again: `ckptfs rm --allow-latest {self.model} STEP...`)" if older is not None
                else "; no step is recorded by every node"))

    def _read_step(self, step: int) -> tuple[Metadata | None, bytes, Exception | None]:
        """(the DCP Metadata of ``step``, the bytes the nodes compare, None), or (None, b"", the
        error that stopped this rank: said to the others, which would wait for it)."""
        try:
            with self.store.open_version(self.model, step, whole=False) as v:
                if is_global_version(v.manifest):
                    text = dict(v.manifest.files)[METADATA_FILE]
                    return decode_metadata(text), text.encode(), None
                # saved by one process: its metadata made from its index (ckptfs.dist.single)
                return one_process_metadata(v, self.store.region.superblock.uuid.hex()), v.manifest.encode(), None
        except Exception as e:  # noqa: BLE001 - said to the other ranks, which would wait for this one
            return None, b"", e

    def _compare_nodes(self, step: int, record: bytes, failure: Exception | None, group,
                       may_fall_back: bool = False) -> str | None:
        """Every rank's outcome of ``_read_step``: this rank's failure, another's, or nodes whose
        regions hold different checkpoints as ``step`` (a node whose region holds the model of
        another job at the same step would load a mixture) raise, on every rank. With
        ``may_fall_back``, a record found damaged (CorruptionError) on some rank is returned
        instead, in words, on every rank alike (from the same outcomes): the caller loads an
        older step. None: every rank read it."""
        outcomes = exchange((self.store.path, hashlib.sha256(record).hexdigest(),
                             None if failure is None else f"{type(failure).__name__}: {failure}"), group,
                            f"the comparison of step {step} of {self.model!r} across the nodes")
        damaged = [why for _, _, why in outcomes if why is not None and why.startswith(f"{CorruptionError.__name__}: ")]
        if may_fall_back and damaged:
            return damaged[0][len(CorruptionError.__name__) + 2:]
        if failure is not None:
            raise failure
        failed = [(path, why) for path, _, why in outcomes if why is not None]
        if failed:
            raise CkptfsError(f"the load of step {step} of {self.model!r} failed on another rank, reading "
                              f"{failed[0][0]} ({failed[0][1]})")
        kinds: dict[str, list[str]] = {}
        for path, digest, _ in outcomes:
            kinds.setdefault(digest, []).append(path)
        if len(kinds) > 1:
            raise CorruptionError(f"the nodes' regions hold different checkpoints as step {step} of {self.model!r} "
                                  f"({' / '.join(', '.join(sorted(set(p))) for p in kinds.values())}): one of them "
                                  "belongs to another job; load with the regions of this job only")
        return None

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        self.metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        # The plan is known here, before DCP's planning gathers every rank's (which waits for the
        # slowest, and often for a collection of the garbage DCP made): the parts are opened and
        # their first chunks read now, into the load's read buffers; read_data checks them
        # first. Anything that fails here is left to read_data, which reads as if nothing was.
        self._drop_ahead()
        try:
            with paused_gc():
                self._ahead = _LoadAhead(self, plan)
        except Exception:  # noqa: BLE001 - an optimization: read_data meets the same error and says it
            self._ahead = None
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        try:
            with paused_gc():
                self._read_data(plan, planner)
        finally:
            self._gc_hold.release()
        done: Future = Future()
        done.set_result(None)
        return done

    def _read_data(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.items != plan.items:  # DCP's global planning changed the plan
            ahead.close()
            ahead = None
        if ahead is None:
            ahead = _LoadAhead(self, plan, read=False)
        with contextlib.closing(ahead):
            reads = [PartRead(data, items, planner, scan) for data, items, scan in ahead.parts]
            read_parts(reads, ahead.buffers, ahead.reading)
            ahead.reading = None
        for item, raw in ahead.values:  # a one-process version's values, pickled from its index
            planner.load_bytes(item, io.BytesIO(raw))

    def _drop_ahead(self) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.close()

    def _store_of(self, region: str, rank: int):
        store = self.regions.get(region)
        if store is None:
            what = f"the part of rank {rank}" if rank != ONE_PROCESS else "the version (saved by one process)"
            raise NotFoundError(f"{what} of {self.model!r} is in region {region} (another node's), "
                                "which this rank cannot read: pass that region's store in peers=, or load where "
                                "the parts are (a shared tier to drain them to is not built yet)")
        return store


class _LoadAhead:
    """A load plan's parts, pinned (until ``close``), each with its items ((ReadItem, stored
    tensor index)) and its Scan, made from the plan alone; with ``read``, their first chunks
    read from now on (a ReadAhead, ``reading``) into the load's read buffers."""

    def __init__(self, reader: StorageReader, plan: LoadPlan, read: bool = True):
        self.items = plan.items
        self.buffers = ReadBuffers()
        self.reading: ReadAhead | None = None
        self._pins = contextlib.ExitStack()
        try:
            storage = reader.metadata.storage_data
            by_part: dict[tuple, list] = {}
            self.values = []  # (ReadItem, bytes) of a one-process version's values
            for item in plan.items:
                where = storage[item.storage_index]
                if "bytes" in where:
                    self.values.append((item, where["bytes"]))
                    continue
                by_part.setdefault((where["region"], where["rank"], where["counter"]), []).append((item, where["pos"]))
            # the parts opened at once: each is a few cold reads of headers and an index
            pool = ThreadPoolExecutor(min(OPEN_THREADS, len(by_part) or 1), thread_name_prefix="ckptfs-open")
            opening = []
            try:
                for key, items in sorted(by_part.items()):
                    opening.append(pool.submit(_open_part, reader, key, items))
            finally:
                pool.shutdown(wait=True)
                for done in opening:  # every part opened is held (and closed by close), whatever failed
                    if not done.cancelled() and done.exception() is None:
                        self._pins.enter_context(done.result()[0])
            self.parts = [done.result()[1:] for done in opening]  # the first error
            if read:
                self.reading = ReadAhead([scan for _, _, scan in self.parts], self.buffers)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """The reads ahead end, the buffers go, the parts are unpinned (idempotent)."""
        if self.reading is not None:
            self.reading.cancel()
            self.reading = None
        self.buffers.close()
        self._pins.close()


def _open_part(reader: StorageReader, key: tuple[str, int, int], items: list):
    """(the pinned part, its VersionData, items as (ReadItem, stored tensor index), its Scan)
    of the part ``key`` (region, rank, counter) for ``items`` ((ReadItem, position in the
    part's item list)); the part is closed again if anything fails."""
    region, rank, counter = key
    store = reader._store_of(region, rank)
    if rank == ONE_PROCESS:  # the version itself: an item's position is its stored tensor's index
        part = open_one_process(store, reader.model, counter)
    else:
        part = open_part(store, reader.model, rank, counter, names={
            pos: shown_item_name(item.storage_index.fqn, item.storage_index.offset, rank) for item, pos in items})
    try:
        if rank != ONE_PROCESS:
            stored = item_records(part)
            items = [(item, stored[pos]) for item, pos in items]
        return part, part.data, items, part.data.scanner(only=wanted_tensors(part.manifest.tensors, items))
    except BaseException:
        part.close()
        raise
