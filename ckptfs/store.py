"""The public entry point: a Store is an open region with the operations users need."""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Callable, NoReturn

from ckptfs.errors import (BusyError, CkptfsError, CorruptionError, HeldError, NotFoundError, PartGoneError,
                           RegionFormatError, RegionFullError, in_words, no_step, no_version_yet, not_a_region)
from ckptfs.manifest import Manifest
from ckptfs import mounttable
from ckptfs.region.region import Region, SlotVersion
from ckptfs.region.slots import hidden_by
from ckptfs.region.ring import latest_after_removal, mark_kept, room_after_keeping
from ckptfs.version import Version, VersionInfo, version_info

if TYPE_CHECKING:  # the reader and the writer need torch, which listing a region does not
    from ckptfs.reader import VerifyProblem
    from ckptfs.writer.writer import Writer

log = logging.getLogger("ckptfs")

PIN_RETRIES = 20
PIN_WAIT_S = 1.0  # the longest open_version waits for a version held exclusively (a slow disk's barrier)


def default_region_path() -> str:
    """``$CKPTFS_REGION``, else ``$XDG_DATA_HOME/ckptfs/default.region`` (~/.local/share/...)."""
    env = os.environ.get("CKPTFS_REGION")
    if env:
        return env
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "ckptfs", "default.region")


def _save_gone(model: str, counter: int) -> NotFoundError:
    return NotFoundError(f"{model!r} no longer holds the save with counter {counter}: its slot was reused")


class Store:
    """An open region.

    ``Store()`` opens the default region (see ``default_region_path``), creating it sparse on
    first use unless ``create=False`` (read-only tools: they never make a 64 GiB file);
    ``Store(path)`` opens an existing one; ``Store.create(path, size_bytes)`` formats.
    """

    def __init__(self, path: str | None = None, *, writable: bool = True, create: bool = True):
        default = path is None
        path = default_region_path() if default else path
        self.created = False  # made here: the default region, at a writer's first use
        if os.path.isdir(path):
            raise not_a_region(path, "a directory")
        if not os.path.exists(path):
            if not (default and create):
                raise NotFoundError(f"no region yet at {path}: " + in_words(
                    python="a writer of Store() creates the default one, or Store.create(path, size_bytes=...)",
                    cli=f"`ckptfs mkfs{'' if default else ' ' + path}` makes one"
                        + (" (so does a training job's first save)" if default else "")))
            unmounted = mounttable.unmounted_fstab_point(path)
            if unmounted is not None:
                raise NotFoundError(
                    f"no region at {path}, and nothing is mounted at {unmounted}, a mount point in "
                    f"{mounttable.FSTAB}: is the filesystem meant to hold the region not mounted? Mount it; to start "
                    "a new region there, "
                    + in_words(python=f"Store.create({path!r})", cli=f"`ckptfs mkfs {path}`"))
            try:
                Region.format(path).close()
                self.created = True
            except RegionFormatError:
                pass  # another process created it first
        self.path = path
        try:
            self._region = Region(path, writable=writable)
        except OSError as e:
            # no write access, or a filesystem that is (or went) read-only: still readable
            if not writable or e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            self._region = Region(path, writable=False)
            self._region.read_only_reason = OSError(e.errno, e.strerror)  # not e: its traceback holds self

    @classmethod
    def create(cls, path: str, size_bytes: int | None = None, *, exist_ok: bool = False,
               force: bool = False) -> "Store":
        """Format a region at ``path`` and open it: a new sparse file of ``size_bytes`` (default
        64 GiB), or a whole block / devdax device (``size_bytes`` left out).

        With ``exist_ok`` an existing region is opened instead. Otherwise whatever is already
        there (a region, a non-empty file, a device holding data) raises RegionFormatError and is
        left untouched, unless ``force``."""
        if exist_ok and not force and os.path.exists(path) and not os.path.isdir(path):
            with contextlib.suppress(RegionFormatError):
                return cls(path)
        Region.format(path, size_bytes, force=force).close()
        return cls(path)

    @property
    def region(self) -> Region:
        """The open region; CkptfsError once the Store is closed (anything of it used after
        ``close``: not a bare error of a released mapping)."""
        if self._region.closed:
            raise CkptfsError(f"this Store of {self.path} is closed: open it again (ckptfs.Store({self.path!r}))")
        return self._region

    def close(self) -> None:
        """Close the region, once the writers open on it (``writer``, and those DCP's storage
        keeps across steps) have committed their saves in flight and stopped: nothing of the
        store outlives it. The versions open from it are let go. Nothing to do twice."""
        region = self._region
        if region.closed:
            return
        writers = sys.modules.get("ckptfs.writer.calls")  # not imported (a listing, the CLI): none open
        if writers is not None:
            writers.close_writers(lambda writer: writer.region is region, "as its store closed")
        region.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ writing
    def writer(self, model: str, *, group=None, **options) -> Writer:
        """A Writer for ``model`` (see Writer for the tunables). ``group``: the job's process
        group (``torch.distributed.group.WORLD``): every rank opens the writer and saves its own
        state dict (shards, DTensors) of each step, which becomes the job's global latest once
        every rank's part is durable (ckptfs.dist.writer.DistWriter: ``max_inflight``,
        ``timeout_s``, ``keep_every``). InvalidNameError for a name of the form ``.MODEL.rank<R>``,
        which names the parts of multi-rank saves."""
        from ckptfs.dist.names import refuse_part_name

        refuse_part_name(model)
        if group is not None:
            from ckptfs.dist.writer import DIST_OPTIONS, DistWriter

            other = sorted(set(options) - set(DIST_OPTIONS))
            if other:
                raise TypeError(f"store.writer(..., group=) takes {', '.join(DIST_OPTIONS)}, not {', '.join(other)}: "
                                "a multi-rank writer's parts are sized and chunked by ckptfs")
            return DistWriter(self, model, group=group, **options)
        from ckptfs.writer.writer import Writer

        self._close_idle_dcp_writers(model)  # they would refuse it
        writer = Writer(self.region, model, **options)
        self._release_parts_after_commits(writer, model)
        return writer

    def _release_parts_after_commits(self, writer: Writer, model: str) -> None:
        """Where ``model`` has parts of multi-rank saves: after each commit of ``writer``, its own
        writer of one process, give back the parts that no global version left names
        (``ckptfs.dist.parts.release_unnamed``); until the writer is closed."""
        from ckptfs.dist.names import part_models

        if not part_models(self, model):
            return

        def committed(event) -> None:
            if writer.closed:
                unsubscribe()
            elif event.model == model:
                from ckptfs.dist.parts import release_unnamed

                release_unnamed(self, model)
        unsubscribe = self.region.commits.subscribe(committed)

    def _close_idle_dcp_writers(self, model: str) -> None:
        """Close the writers this process keeps for DCP saves of ``model`` and its parts, where
        idle (ckptfs.dist.storage.close_idle_writers): before a writer of the model or its removal."""
        storage = sys.modules.get("ckptfs.dist.storage")  # never imported: no such writers (nor torch)
        if storage is not None:
            storage.close_idle_writers(self, model)

    # ------------------------------------------------------------------ listing
    def models(self) -> list[str]:
        return sorted(e.name for e in self.region.entries())

    def versions(self, model: str, *, missing_ok: bool = False, hidden: bool = False) -> list[VersionInfo]:
        """Committed versions of ``model``, ascending by step (a step saved twice: the newer).
        ``hidden``: the versions a later save of their step hides too, in (step, counter) order:
        an earlier save of a step (a failed attempt's part, a run rolled back) stays in its slot,
        kept or not, until the ring reuses it. Of a model saved by many ranks, a step other than
        the latest whose parts went back to their rings once a newer step committed stays listed
        here until its own slot is reused, though no load can read it (PartGoneError);
        ``ckptfs.dist.parts.loadable`` leaves those out, as ``ckptfs ls`` and the mount do.
        NotFoundError if there is no such model, unless ``missing_ok`` (then [])."""
        entry = self._entry(model, missing_ok)
        if entry is None:
            return []
        committed = self.region.committed(entry)  # in counter order
        latest = self.region.latest(entry, committed)  # from the same read of the headers
        if latest is not None and not any(v.is_save(latest) for v in committed):
            committed = self.region.committed(entry)  # published since: the listing holds its latest
        if hidden:
            return sorted(self._info(v, latest) for v in committed)
        by_step: dict[int, SlotVersion] = {}
        for v in committed:
            by_step[v.header.step] = v  # the newest of each step wins
        return [self._info(v, latest) for _, v in sorted(by_step.items())]

    def latest(self, model: str, *, missing_ok: bool = False) -> VersionInfo | None:
        """The newest committed version of ``model`` (the one ``load`` returns by default), or
        None before its first commit. It is always the version with the highest counter among
        ``versions``: a commit interrupted between its header and its publish counts as latest
        (reading never writes; the model's next writer publishes it). NotFoundError if there is
        no such model, unless ``missing_ok`` (then None)."""
        entry = self._entry(model, missing_ok)
        if entry is None:
            return None
        latest = self.region.latest(entry)
        return None if latest is None else self._info(latest, latest)

    def _entry(self, model: str, missing_ok: bool):
        """The model's table entry; None if there is none and ``missing_ok`` (a damaged entry
        that may have been the model still raises)."""
        try:
            return self.region.get(model)
        except NotFoundError:
            if missing_ok:
                return None
            raise

    @staticmethod
    def _info(v: SlotVersion, latest: SlotVersion | None) -> VersionInfo:
        return version_info(v, v.is_save(latest))

    def damaged_indexes(self, infos: list[VersionInfo]) -> set[int]:
        """The counters of those of ``infos`` (listed versions of one model) whose index no
        longer matches its checksum (a read of each index and one of the slot headers for all:
        once per version, ``ls`` of a model with 800 kept versions took 21 s; ``ls`` marks them
        damaged, ``verify`` checks the tensors too). Not one whose slot was reused since."""
        if not infos:
            return set()
        try:
            committed = self.region.committed(self.region.get(infos[0].model))
        except NotFoundError:
            return set()
        by_counter = {v.header.counter: v for v in committed}
        damaged = set()
        for info in infos:
            v = by_counter.get(info.counter)
            if v is None or not self.region.pin(v):  # its slot reused meanwhile: no damage of its
                continue
            try:
                if not self.region.index_ok(v):
                    damaged.add(info.counter)
            finally:
                self.region.unpin(v)
        return damaged

    def _find(self, model: str, step: int | None, counter: int | None = None) -> tuple[SlotVersion, bool]:
        """The version of ``step`` (None: latest) and whether it is latest; of a step saved
        twice the newer, or the one whose counter is ``counter`` (with ``step`` None: the save
        ``counter`` whatever its step, a part or version named by its counter alone)."""
        if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
            raise ValueError(f"step must be an int (or None: the latest), got {step!r}")  # "0" was 'no step 0'
        entry = self.region.get(model)
        if step is None and counter is None:
            latest = self.region.latest(entry)
            if latest is None:
                raise no_version_yet(model)
            return latest, True
        committed = self.region.committed(entry)  # one read of the headers for both (hundreds of kept versions)
        latest = self.region.latest(entry, committed)
        matches = [v for v in committed if step in (None, v.header.step) and counter in (None, v.header.counter)]
        if not matches and step is None:
            raise _save_gone(model, counter)
        if not matches and any(m is not None and m.step == step for _, _, m in self.region.unreadable_slots(entry)):
            raise CorruptionError(f"version {step} of {model!r} is damaged: its slot header is unreadable, so its "
                                  "bytes cannot be trusted; load another version and run `ckptfs verify`")
        if not matches:
            raise no_step(model, step)
        v = matches[-1]
        return v, v.is_save(latest)

    # ------------------------------------------------------------------ reading
    def open_version(self, model: str, step: int | None = None, *, checked: set | None = None,
                     manifest: Manifest | None = None, counter: int | None = None,
                     wait_s: float = PIN_WAIT_S, whole: bool = True) -> Version:
        """Pin and open a version (``step`` None: the latest). Close it to release the pin.
        ``whole``: a multi-rank version is opened as its whole tensors (``dist.whole.WholeVersion``:
        its ranks' parts pinned with it, ``load()`` the whole state); False: the global version's
        own record (what the parts and the mount read it through).
        ``counter``: of a step saved twice, that save's version (else the newer); alone, the
        save with that counter (NotFoundError once its slot was reused).
        ``checked``: tensors (and blocks) already found intact by an earlier open of the same version (see
        ckptfs.reader.VersionData). ``manifest``: that earlier open's index (the mount keeps one
        per listed version), used when the pinned slot still holds the version it came from (the
        same save: counter and time) instead of reading and decoding the index again: tens of ms per open
        of a file at 40,000 tensors.
        ``wait_s``: how long a version held by a save is waited for (its commit's barrier: listed
        from the moment its header is written); then HeldError, or NotFoundError for a step
        older than the latest (its slot is being reused, most likely). The mount passes 0 and
        waits on its own event loop."""
        self.region.backend.check_present(for_write=False)
        deadline = time.monotonic() + wait_s
        while True:
            v, is_latest = self._find(model, step, counter)
            if self.region.pin(v):
                try:
                    same = (manifest is not None and manifest.counter == v.header.counter
                            and manifest.time_ns == v.header.time_ns  # not a removed model's save
                            and manifest.step == v.header.step and manifest.model == model)
                    index = manifest if same else self.region.read_manifest(v)
                except BaseException:
                    self.region.unpin(v)
                    raise
                version = Version(self, v, index, is_latest, checked)
                if not whole:
                    return version
                from ckptfs.dist.whole import as_whole

                return as_whole(self, version)[0]
            # Held exclusively: by the save committing it (its header's barrier: listed from the
            # moment its header is written; an older step committed after a newer one too), which
            # is waited for; or by a claim that reuses its slot, which marks it WRITING soon
            # (then _find no longer finds it)
            if time.monotonic() < deadline:
                time.sleep(0.001)
                continue
            if step is None and counter is None:
                raise HeldError(f"could not pin the latest version of {model!r}: it kept changing; try again")
            latest = self.region.latest(v.entry)
            if is_latest or latest is None or v.header.counter > latest.header.counter:
                raise HeldError(f"step {v.header.step} of {model!r} is held by a save's commit or a removal (longer "
                                f"than {wait_s:g} s); try again")
            raise no_step(model, step) if step is not None else _save_gone(model, counter)

    def load(self, model: str, step: int | None = None, map_location="cpu", verify: bool = True, into=None,
             keys=None, group=None, peers=(), timeout_s: float = 300.0):
        """The saved object of a version (``step`` None: latest), tensors on ``map_location``.

        ``into``: the state to resume, of the saved object's structure (e.g. ``{"model":
        model.state_dict(), "optim": opt.state_dict()}``, whose tensors are the live ones): its
        tensors are overwritten in place, on their own devices, and returned in the saved
        object; no second copy of the state is allocated. Its tensors are matched to the saved
        ones by key path, in any order of keys. ValueError naming the first tensor that differs
        (path, dtype, shape) before anything is written.

        ``keys``: top-level keys of the saved dict to load (``keys=["model"]``: the weights of a
        training checkpoint, for evaluation or fine-tuning with a fresh optimizer; a str for
        one); the result, and ``into`` when given, hold only those entries, and only their
        tensors are read and checked. ValueError naming the keys the version has where one is
        absent. In a load through DCP (a multi-rank version with ``into``), ``into`` holds
        exactly those keys.

        The version stays pinned while it is read; every tensor is checked against its CRC
        unless ``verify`` is False (CorruptionError on a mismatch). With ``step`` None, a latest
        version whose bytes are damaged is skipped for the newest older one that loads intact,
        with a warning; CorruptionError only when none does.

        ``group``: the job's process group: a load of many ranks (every rank calls it, with its
        own state dict of any sharding and world size as ``into``, loaded in place through DCP's
        resharding) of the newest step every node records; ``peers``: other nodes' stores whose
        parts this rank may read (ckptfs.dist.writer.load); ``timeout_s``: how long the ranks
        wait for one another (a rank that never comes to the load is named after it).
        """
        if group is not None:
            from ckptfs.dist.writer import load

            return load(self, model, into, group=group, step=step, peers=peers, timeout_s=timeout_s, keys=keys)
        try:
            return self._load_opened(self.open_version(model, step, whole=False), map_location, verify, into, keys)
        except (CorruptionError, PartGoneError) as damaged:  # damaged, or a part of it is
            if step is not None or not verify:
                _say_into_was_written(damaged, into)
            entry = self.region.get(model)
            latest = self.region.latest(entry)
            for v in reversed(self.region.committed(entry)):
                if latest is None or v.header.counter >= latest.header.counter:
                    continue  # only versions older than the damaged latest
                try:
                    version = self.open_version(model, v.header.step, whole=False)
                    if version.info.counter != v.header.counter:
                        version.close()
                        continue
                    obj = self._load_opened(version, map_location, verify, into, keys)
                except (CorruptionError, NotFoundError, ValueError):  # damaged too, or not of into='s structure
                    continue
                log.warning("%s; loaded step %d of %r instead, the newest intact version",
                            damaged, v.header.step, model)
                return obj
            _say_into_was_written(damaged, into)

    def _load_opened(self, version: Version, map_location, verify: bool, into, keys):
        """The saved object of ``version`` (opened, closed here): ``Version.load``; of a
        multi-rank DCP version, its whole state (ckptfs.dist.whole), or with ``into`` DCP's
        load into it."""
        from ckptfs.dist.names import is_global_version
        from ckptfs.dist.whole import as_whole

        if into is not None and is_global_version(version.manifest):
            # a state of any layout, matched by key and resharded by DCP: this process alone
            from ckptfs.dist.writer import load_in_this_process

            model, step = version.info.model, version.info.step
            version.close()
            return load_in_this_process(self, model, step, into, keys)
        v, _ = as_whole(self, version)
        with v:
            return v.load(map_location, verify, into, keys)

    def verify(self, model: str | None = None, step: int | None = None,
               progress: Callable[[int], None] | None = None) -> list[VerifyProblem]:
        """Check every tensor of the selected versions against its CRC; [] means all good
        (ckptfs.verify.verify: what else is checked, and how multi-rank versions are)."""
        from ckptfs.verify import verify

        return verify(self, model, step, progress)

    # ------------------------------------------------------------------ removal
    def remove(self, model: str, step: int, *, allow_latest: bool = False, give_back: bool = True) -> None:
        """Remove a version; BusyError if it is pinned or being written, or latest unless
        ``allow_latest``: then the model rolls back, its latest becoming the newest version of
        an older step (a job resumed from it saves the steps after it again; a multi-rank
        checkpoint's global version is removed on each node's region). Of a step saved more
        than once, every save of it: the earlier ones, which the newer hid, would show again
        (BusyError for one a reader holds). A multi-rank version's parts in this region go back
        to their rings; a rollback first keeps those of the version that becomes latest
        (CkptfsError, nothing listed removed, where one is gone: see docs/DISTRIBUTED.md).
        ``give_back``: ``give_back_emptied`` after it; False leaves that to the caller (a
        removal of many versions: once, after the last)."""
        from ckptfs.dist import parts

        self.region.check_writable("changed")
        v, is_latest = self._find(model, step)
        earlier = list(reversed(hidden_by(self.region.committed(v.entry), step, v.header.counter)))
        # the parts of a multi-rank version (read before it goes), given back once it is gone
        named = parts.named_by(self, model, [(x.header.step, x.header.counter) for x in [v, *earlier]])
        # the earlier saves first: hidden by the newest, they are listed nowhere, so a refusal
        # (one a reader holds) leaves the step as it was; the newest first had gone, then the
        # refusal, and the step showed an earlier save (an abandoned run's) in its place
        for older in earlier:
            try:
                self.region.remove_version(older, allow_latest=allow_latest)
            except NotFoundError:
                pass  # its slot was reused meanwhile
        if is_latest and allow_latest and named:
            self._keep_parts_of_next_latest(model, v)
        self.region.remove_version(v, allow_latest=allow_latest)
        parts.give_back_parts(self, named)
        if give_back:
            self.give_back_emptied(model)

    def give_back_emptied(self, model: str) -> None:
        """Give the slots of ``model`` that removals emptied and its ring does not need back to
        the region's free space, unless a writer of it is open (its commits give them back);
        ``remove`` does it (the removed versions of a finished run held their space until `rm
        --all`, and a full region's advice to remove versions freed nothing). Never raises: the
        removals stand; a failure is logged, and the model's next writer gives them back."""
        from ckptfs.region.locks import model_lock_offset
        from ckptfs.region.ring import Ring

        try:
            entry = self.region.get(model)
            if self.region.pins.is_locked_by_others(model_lock_offset(entry.index)):
                return  # a writer is open: its commits give them back
            ring = Ring(self.region, entry, timeout_s=0.0)
        except (BusyError, NotFoundError):
            return  # a writer opened meanwhile, or the model went
        except (CkptfsError, OSError) as e:  # a filesystem gone read-only, say: the removal's error stands
            log.warning("ckptfs: the slots removed from %r were not given back to the region: %s", model, e)
            return
        try:
            ring.extents.give_back_emptied()
        except (CkptfsError, OSError) as e:
            log.warning("ckptfs: the slots removed from %r were not given back to the region: %s", model, e)
        finally:
            ring.close()

    def _keep_parts_of_next_latest(self, model: str, latest: SlotVersion) -> None:
        """Before a multi-rank model's latest is removed: keep the parts of the version that
        becomes latest, as the parts of a latest are (released once a newer step commits). Given
        back to their rings when a newer step superseded it, they are reused by the saves of a
        job resumed from it once the region is full, and while those fail, no version loads.
        CkptfsError, nothing removed, where one of them is gone."""
        from ckptfs.dist import parts

        target = latest_after_removal(self.region, latest)
        if target is None:
            return
        t = target.header.step
        try:
            parts.keep_parts(self, model, t, target.header.counter)
        except PartGoneError as e:
            raise CkptfsError(
                f"step {latest.header.step} of {model!r} is latest, and step {t}, which would become latest, cannot "
                f"be loaded (its part of rank {e.rank} is gone); remove step {t} too: " + in_words(
                    python=f"store.remove({model!r}, {t}) first", cli=f"`ckptfs rm --allow-latest {model} {t} "
                    f"{latest.header.step}`")) from None

    def keep(self, model: str, step: int, *, counter: int | None = None) -> bool:
        """Keep a version (a milestone): the ring never reuses its slot until ``unkeep`` or
        ``remove``; the model takes another slot from free space in its place (RegionFullError,
        nothing kept, where it would be left no slot to save into). A multi-rank (DCP)
        version's parts in this region are kept with it (CkptfsError, nothing kept, where one is
        gone already); after its ``unkeep`` they go back at the model's next commit. ``counter``:
        as ``unkeep``'s. Returns whether it was not kept before."""
        from ckptfs.dist.parts import keep_parts

        self.region.check_writable("changed")
        v, _ = self._find(model, step, counter)
        if not self.region.index_ok(v):
            raise CorruptionError(f"step {step} of {model!r} is damaged (its index fails its checksum), no milestone "
                                  "to keep: keep another version; " + in_words(python="Store.verify",
                                                                               cli="`ckptfs verify`") + " lists the damage")
        if not v.header.kept and not room_after_keeping(self.region, v):
            raise RegionFullError(
                f"keeping step {step} of {model!r} would leave it no slot to save into (its others hold its latest "
                f"or kept versions) and {self.region.path} has no room for another; unkeep or remove another "
                "version of it first, or remove other models: " + in_words(
                    python="Store.unkeep / Store.remove / Store.remove_model",
                    cli="`ckptfs unkeep` / `ckptfs rm`"))
        parts_kept = keep_parts(self, model, step, counter)  # nothing for a model without part models
        newly = self._set_kept(model, step, True, counter)
        try:
            # again, flag set: a commit's reclaim that read the milestones before it may have
            # given the parts back since (parts.keep_milestones_again covers the other order)
            keep_parts(self, model, step, counter)
        except BaseException:
            if newly:
                self._set_kept(model, step, False, counter)
            for name, part_step, part_counter in parts_kept:  # as the first look found them
                self.unkeep(name, part_step, counter=part_counter)
            raise
        return newly

    def unkeep(self, model: str, step: int, *, counter: int | None = None) -> bool:
        """Give a kept version back to the ring (it is reused once it is older than the versions
        the ring keeps). ``counter``: of a step saved twice, that save's version (one that
        ``versions(hidden=True)`` lists); else the newer. Returns whether it was kept."""
        return self._set_kept(model, step, False, counter)

    def _set_kept(self, model: str, step: int, kept: bool, counter: int | None = None) -> bool:
        """Set the version's kept flag; whether that changed it."""
        self.region.check_writable("changed")
        for _ in range(PIN_RETRIES):
            v, _ = self._find(model, step, counter)
            if mark_kept(self.region, v, kept):
                return v.header.kept != kept
        raise no_step(model, step)

    def remove_model(self, model: str) -> None:
        """Remove a model and every version; BusyError while a writer or reader uses it. A
        multi-rank (DCP) model's part models (``.MODEL.rank<R>``, its ranks' parts) go with it:
        BusyError, once the model itself is gone, naming those a reader still holds. The writers
        this process keeps for DCP saves of them are closed first, unless a save is in flight."""
        from ckptfs.dist.names import part_models

        self.region.check_writable("changed")
        self._close_idle_dcp_writers(model)
        self.region.remove_model(model)

        busy = []
        for name in part_models(self, model):
            try:
                self.region.remove_model(name)
            except BusyError:
                busy.append(name)
            except NotFoundError:
                pass  # removed meanwhile
        if busy:
            raise BusyError(f"removed {model!r}, but not its ranks' parts {', '.join(busy)}, which are in use; "
                            + in_words(python=f"Store.remove_model({busy[0]!r}) each",
                                       cli=f"`ckptfs rm --all {busy[0]}` each") + " once they are free")

    # ------------------------------------------------------------------ status
    def status(self) -> dict:
        """Region geometry and usage, and per model its versions, the slots in use and who holds
        them (``ckptfs.status.region_status``)."""
        from ckptfs.status import region_status

        return region_status(self)

    def space(self, models: list[dict] | None = None) -> dict:
        """{"region_bytes", "used_bytes" (the models' slots), "free_bytes" (what slots can
        still take)}: from the model table alone (``models``: status's, already listed), with no
        look at processes or headers (the mount's statfs)."""
        used = (sum(m["used_bytes"] for m in models) if models is not None
                else sum(e.nbytes for e in self.region.entries()))
        return {"region_bytes": self.region.superblock.region_bytes, "used_bytes": used,
                "free_bytes": self.region.data_area_bytes() - used}


def _say_into_was_written(damaged: Exception, into) -> NoReturn:
    """Raise ``damaged``, a load's damage, saying where ``into`` was given that it holds some of
    the damaged version's bytes now (they were read into it as they came in)."""
    if into is None:
        raise damaged
    said = type(damaged)(f"{damaged}; into= holds some of its bytes now: load an intact version into it "
                         "(`ckptfs ls` lists them)")
    said.__dict__.update(damaged.__dict__)  # a PartGoneError's rank
    raise said from damaged
