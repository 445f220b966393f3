"""The mounted tree: which names exist, their inodes and attributes. No FUSE calls in here.

::

    /                                   ROOT     one directory per model
    /<model>/                           MODEL    committed versions + ``latest``
    /<model>/latest -> step-00001200    LATEST   symlink to the newest committed version
    /<model>/step-00001200/             VERSION  one directory per committed version
    /<model>/step-00001200/<file>       FILE     the views of that version (``ckptfs.views.files_for``)
    /<model>/step-00001200/<dir>/...    SUBDIR   a view's subdirectory (a path with '/' in files_for)

Contracts:

* **Listing.** The list of models and committed versions is a snapshot of the Store taken at most
  every ``refresh_interval`` seconds (0.5 s), when a lookup, a readdir or a getattr needs it, so a
  new version appears within about a second and a version whose slot was reused disappears as
  soon as the snapshot no longer holds it. Only committed versions are shown (``store.versions``).
  ``latest``, a version directory not in the snapshot, and a model directory's entries (``ls
  MODEL``, its attributes taken with it: ``listing``) are read from a listing of their model at
  most ``LATEST_FRESH_S`` (10 ms) old: a path through ``latest`` reaches a version still there
  while the job saves every few tens of ms, and a model's listing holds the version ``latest``
  named when it was taken.
* **Inodes** are numbered by a hash of their name (``_free_ino``): the same in every mount of
  the region and after the kernel forgot one (FORGET drops it from the table, which holds only
  what the kernel knows), never two live names on one number. A model and ``<model>/latest``
  keep their inode; a version directory's and its files' inodes are keyed by the version's save
  too (``(model, step, save_id[, name])``: its counter and time,
  ``VersionInfo.save_id``), so they are stable for a given version, and a step that is committed
  again later (saved again, after a removal, or by a model removed and made again, whose
  counters start again at 1) gets new ones: its bytes differ, the kernel page cache of the old files
  (``keep_cache``) must not be served for them, and the kernel's cached names of the old files
  (``IMMUTABLE_TTL``) must not lead to them. The version directory's entry is revalidated every
  ``LISTING_TTL``; its new inode makes the kernel drop the old one's names.
* **Files** of a version are computed once per version from its manifest (one short pin through
  ``store.open_version``) and cached while the version is listed. They come from the views
  registry (``ckptfs.views.registry``), all views or those the mount selects (``-o views=``); a
  view's path with '/' shows as subdirectories, read-only like the version directory. A version
  is immutable once committed, so sizes and contents never change under a given file inode.
* **Reads** go through :class:`OpenFile`, which holds the version pinned from ``open`` to
  ``release``: the writer never reuses a pinned slot, so a copy taken during training is exact.
* **Changes.** A mount is read-only unless mounted ``-o rw``; then only the removal of a
  non-latest version is allowed: ``rmdir`` of a version directory removes it from the region
  (``store.remove``; EBUSY while it is latest or pinned). So that ``rm -r <model>/step-N`` works,
  ``unlink`` of a file *inside* a version directory is accepted and does nothing while that
  directory is open, as ``rm -r`` holds it (EBUSY if the version is the latest, so ``rm -r``
  stops before its ``rmdir``; EPERM for a file alone: ``rm file`` must not report a removal that
  did not happen); the version and its files disappear with the ``rmdir``. ``rmdir`` of a
  subdirectory inside a version is accepted and does nothing the same way. Everything else is
  EROFS.

Errors are raised as ``OSError`` subclasses carrying their errno, or as ckptfs errors; the FUSE
layer translates them (``ckptfs.fs.errors.errno_for``).
"""
from __future__ import annotations

import errno
import hashlib
import logging
import math
import os
import stat
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ckptfs.dist.parts import loadable
from ckptfs.errors import NotFoundError
from ckptfs.manifest import FILE_NAME_MAX_BYTES
from ckptfs.fs.errors import read_only
from ckptfs.fs.names import LATEST, dirname_step, version_dirname
from ckptfs.fs.nodes import Attr, Kind, Node, OpenFile
from ckptfs.fs.versionfiles import VersionFiles

log = logging.getLogger("ckptfs.fs")

ROOT_INODE = 1  # == pyfuse3.ROOT_INODE
REFRESH_INTERVAL = 0.5  # seconds between two snapshots of the Store's listing
# The listing that ``latest`` is read from, and that a version directory not in the snapshot is
# looked for in, is at most this old: a job saving every 50 ms reuses a slot ~0.15 s after its
# version stopped being latest, and a path through ``latest`` must reach a version still there
# (from a 0.5 s old listing a quarter of the opens of ``latest/...`` failed with ENOENT).
LATEST_FRESH_S = 0.01


@dataclass
class _Model:
    versions: dict[int, Any] = field(default_factory=dict)  # step -> VersionInfo, ascending
    dirnames: dict[str, int] = field(default_factory=dict)  # "step-00001200" -> 1200
    latest: Any = None  # VersionInfo | None
    mtime_ns: int = 0
    # why its versions could not be listed (the device's I/O error, damage): its directory is
    # there, and everything in it answers with that error (EIO), not "absent" (an rsync --delete
    # or a job's "resume if the checkpoint exists" would act on that)
    error: BaseException | None = None


class Tree:
    """The inode table and the name space of one mount, backed by a Store.

    ``files_for(manifest) -> dict[path, View]`` defaults to ``ckptfs.views.files_for`` of the
    ``views`` given (ids; None: every registered view); ``whole(store, version, layout)`` reads a
    pinned version (default ``ckptfs.dist.whole.as_whole``: a multi-rank version as its whole
    tensors); ``clock`` is ``time.monotonic`` (tests pass their own). A commit made in this process (``Region.commits``) makes the next lookup
    take a new listing at once; ``close`` stops that.
    """

    def __init__(self, store, *, views=None, files_for: Callable | None = None,
                 whole: Callable | None = None, refresh_interval: float = REFRESH_INTERVAL,
                 clock: Callable[[], float] = time.monotonic):
        self.store = store
        if whole is None:
            from ckptfs.dist.whole import as_whole as whole
        if files_for is None:
            from ckptfs.views import check_view_ids, files_for as registry_files_for

            selected = None if views is None else check_view_ids(views)
            files_for = lambda manifest: registry_files_for(manifest, selected)  # noqa: E731
        self._files = VersionFiles(store, files_for, whole, lambda: self.refresh(force=True))
        self._refresh_interval = refresh_interval
        self._clock = clock
        self._refreshed_at: float | None = None
        self._models: dict[str, _Model] = {}
        self._names: list[str] = []  # the region's models as of the last listing (part models too)
        self._model_refreshed_at: dict[str, float] = {}  # models listed again since (_refresh_model)
        self._by_key: dict[tuple, Node] = {}
        self._by_ino: dict[int, Node] = {}
        self._key_of: dict[int, tuple] = {}
        self.uid, self.gid = os.getuid(), os.getgid()
        self.mounted_ns = time.time_ns()
        commits = getattr(getattr(store, "region", None), "commits", None)
        self._unsubscribe = commits.subscribe(self._stale) if commits is not None else None
        root = Node(ROOT_INODE, Kind.ROOT)
        self._by_key[("root",)] = root
        self._by_ino[ROOT_INODE] = root

    # ---------------------------------------------------------------- listing snapshot

    def _stale(self, _committed) -> None:
        """A commit in this process: the next lookup takes a new listing (any thread)."""
        self._refreshed_at = None

    def close(self) -> None:
        """Stop hearing of commits."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    def refresh(self, force: bool = False) -> None:
        """Take a new snapshot of the Store's models and committed versions if the last one is
        older than the refresh interval (or ``force``). Drops cached files of versions that are
        gone."""
        now = self._clock()
        if not force and self._refreshed_at is not None and now - self._refreshed_at < self._refresh_interval:
            return
        models: dict[str, _Model] = {}
        names = sorted(self.store.models())
        for name in names:
            try:
                models[name] = self._listed(name, names)
            except NotFoundError as exc:  # removed between models() and versions()
                log.debug("listing %r: %s", name, exc)
            except Exception as exc:  # noqa: BLE001 - answered as the model's errno (see _Model.error)
                models[name] = self._unreadable(name, exc)
        self._models, self._names = models, names
        self._refreshed_at = now
        self._model_refreshed_at.clear()
        self._drop_cached(lambda key: True)

    def _listed(self, name: str, names: list[str]) -> _Model:
        """The model ``name`` as listed now (``names``: the region's models)."""
        m = _Model()
        for info in sorted(loadable(self.store, name, self.store.versions(name), names), key=lambda i: i.step):
            m.versions[info.step] = info
            m.dirnames[version_dirname(info.step)] = info.step
            if info.latest:
                m.latest = info
            m.mtime_ns = max(m.mtime_ns, info.time_ns)
        return m

    def _refresh_model(self, name: str, max_age_s: float) -> None:
        """List the versions of the model ``name`` again if the listing of it is older than
        ``max_age_s``: one model's headers, not the region's (a path through ``latest`` needs
        only its own; the whole region's listing took 31 ms at 40 models). A model gone, or
        new, takes a whole new listing."""
        self.refresh()
        now = self._clock()
        at = self._refreshed_at  # None once a commit here made it stale (another thread)
        listed_at = max(-math.inf if at is None else at, self._model_refreshed_at.get(name, -math.inf))
        if now - listed_at < max_age_s:
            return
        if name not in self._models:
            self.refresh(force=True)
            return
        try:
            self._models[name] = self._listed(name, self._names)
        except NotFoundError as exc:  # removed since the snapshot
            log.debug("listing %r: %s", name, exc)
            self.refresh(force=True)
            return
        except Exception as exc:  # noqa: BLE001 - answered as the model's errno (see _Model.error)
            self._models[name] = self._unreadable(name, exc)
        self._model_refreshed_at[name] = now
        self._drop_cached(lambda key: key[0] == name)

    def _drop_cached(self, which) -> None:
        """Forget the files of the versions (keys for which ``which`` holds) that the listing no
        longer holds."""
        self._files.forget({(n, s, i.save_id) for n, m in self._models.items() for s, i in m.versions.items()}, which)

    def _unreadable(self, name: str, exc: BaseException) -> _Model:
        """The listing of a model whose versions could not be read (said once while it lasts)."""
        before = self._models.get(name)
        if before is None or before.error is None:
            log.warning("model %r cannot be listed: %s", name, exc)
        return _Model(error=exc)

    def _model(self, name: str) -> _Model:
        m = self._models.get(name)
        if m is None:
            raise FileNotFoundError(errno.ENOENT, f"no model {name!r}")
        if m.error is not None:
            raise m.error.with_traceback(None)  # raised at every request: no traceback to grow
        return m

    def _version(self, model: str, step: int):
        info = self._model(model).versions.get(step)
        if info is None:
            raise FileNotFoundError(errno.ENOENT, f"{model} has no committed step {step}")
        return info

    # ---------------------------------------------------------------- inodes

    def _node(self, key: tuple, **fields) -> Node:
        node = self._by_key.get(key)
        if node is None:
            node = Node(self._free_ino(key), **fields)
            self._by_key[key] = node
            self._by_ino[node.ino] = node
            self._key_of[node.ino] = key
        return node

    def _free_ino(self, key: tuple) -> int:
        """The inode number of the name ``key``: a hash of it (its model, step, save and path),
        so that a file has the same number after the kernel forgot it, and in every mount of
        the region (a backup tool such as restic reads again every file whose inode changed),
        while the table holds only the inodes the kernel knows. On a collision with a live
        inode, the next free number: two live names never share one."""
        digest = hashlib.blake2b(repr(key).encode("utf-8", "surrogatepass"), digest_size=8).digest()
        ino = max(int.from_bytes(digest, "little") >> 1, ROOT_INODE + 1)  # < 2**63: st_ino of every tool
        while ino in self._by_ino:
            ino = ino + 1 if ino < (1 << 63) - 1 else ROOT_INODE + 1
        return ino

    def forget(self, ino: int) -> None:
        """Drop the inode ``ino``: the kernel holds it no more (FORGET of its every lookup). A
        later lookup of its name makes it again, with the same number. The root stays."""
        if ino == ROOT_INODE or ino not in self._by_ino:
            return
        del self._by_ino[ino]
        del self._by_key[self._key_of.pop(ino)]

    def node(self, ino: int) -> Node:
        """The node of an inode handed out earlier (ENOENT for one the kernel invented)."""
        try:
            return self._by_ino[ino]
        except KeyError:
            raise FileNotFoundError(errno.ENOENT, f"unknown inode {ino}") from None

    def _model_node(self, model: str) -> Node:
        return self._node(("model", model), kind=Kind.MODEL, model=model)

    def _latest_node(self, model: str) -> Node:
        return self._node(("latest", model), kind=Kind.LATEST, model=model)

    def _version_node(self, model: str, step: int) -> Node:
        """The directory of the version listed at ``step`` now (its save: see Inodes)."""
        save_id = self._version(model, step).save_id
        return self._node(("version", model, step, save_id), kind=Kind.VERSION, model=model, step=step,
                          save_id=save_id)

    def _file_node(self, model: str, step: int, save_id: tuple, name: str) -> Node:
        return self._node(("file", model, step, save_id, name), kind=Kind.FILE, model=model,
                          step=step, save_id=save_id, name=name)

    def _subdir_node(self, model: str, step: int, save_id: tuple, name: str) -> Node:
        return self._node(("subdir", model, step, save_id, name), kind=Kind.SUBDIR, model=model,
                          step=step, save_id=save_id, name=name)

    def _in_version_node(self, model: str, step: int, path: str) -> Node:
        """The file or subdirectory at ``path`` inside a version (ENOENT if there is none)."""
        save_id, views = self._views(model, step)
        if path in views:
            return self._file_node(model, step, save_id, path)
        if any(p.startswith(path + "/") for p in views):
            return self._subdir_node(model, step, save_id, path)
        raise FileNotFoundError(errno.ENOENT, f"{version_dirname(step)} has no {path}")

    def _entries_in(self, model: str, step: int, prefix: str) -> list[tuple[str, Node]]:
        """The names directly inside ``prefix`` ("" or "dir/") of a version, in listing order."""
        save_id, views = self._views(model, step)
        out: dict[str, Node] = {}
        for path in views:
            if not path.startswith(prefix):
                continue
            name, slash, _ = path[len(prefix):].partition("/")
            if name not in out:
                child = prefix + name
                out[name] = (self._subdir_node(model, step, save_id, child) if slash
                             else self._file_node(model, step, save_id, child))
        return list(out.items())

    # ---------------------------------------------------------------- files of a version

    def _views(self, model: str, step: int, version=None) -> tuple[tuple, dict[str, Any]]:
        """(save_id, {file name: View}) of the listed version ``model``/``step``
        (``VersionFiles.views``; ``version``: the caller's pin of it, if it holds one)."""
        info = self._version(model, step)
        return info.save_id, self._files.views((model, step, info.save_id), info, version)

    def _live(self, node: Node) -> None:
        """Raise ENOENT if ``node`` is no longer in the snapshot."""
        if node.kind is Kind.ROOT:
            return
        if node.kind is Kind.MODEL and node.model in self._models:
            return  # there, readable or not (see _Model.error)
        m = self._model(node.model)
        if node.kind is Kind.LATEST and m.latest is None:
            raise FileNotFoundError(errno.ENOENT, f"{node.model} has no committed version")
        if node.kind is Kind.VERSION or node.in_version:
            info = self._version(node.model, node.step)
            if info.save_id != node.save_id:  # the step was committed again since
                raise FileNotFoundError(errno.ENOENT, f"{node.name or version_dirname(node.step)} is gone")
            if node.in_version and self._in_version_node(node.model, node.step, node.name) is not node:
                raise FileNotFoundError(errno.ENOENT, f"{node.name} is gone")

    # ---------------------------------------------------------------- name space

    def lookup(self, parent_ino: int, name: str) -> Node:
        """The node called ``name`` in directory ``parent_ino`` (ENOENT, ENOTDIR, ENAMETOOLONG
        past FILE_NAME_MAX_BYTES, which no name in the mount is)."""
        if len(os.fsencode(name)) > FILE_NAME_MAX_BYTES:
            raise OSError(errno.ENAMETOOLONG, f"{name[:32]}...: name longer than {FILE_NAME_MAX_BYTES} bytes")
        parent = self.node(parent_ino)
        if not parent.is_dir:
            raise NotADirectoryError(errno.ENOTDIR, f"{parent.name or parent.kind.value} is not a directory")
        self.refresh()
        self._live(parent)
        if name == ".":
            return parent
        if parent.kind is Kind.ROOT:
            if name not in self._models:
                raise FileNotFoundError(errno.ENOENT, f"no model {name!r}")
            return self._model_node(name)
        if parent.kind is Kind.MODEL:
            m = self._model(parent.model)
            if name == LATEST and m.latest is not None:
                return self._latest_node(parent.model)
            step = m.dirnames.get(name)
            if step is None and dirname_step(name) is not None:
                # a version newer than the snapshot, reached through a fresh ``latest``
                self._refresh_model(parent.model, LATEST_FRESH_S)
                step = self._model(parent.model).dirnames.get(name)
            if step is None:
                raise FileNotFoundError(errno.ENOENT, f"{parent.model} has no {name}")
            return self._version_node(parent.model, step)
        if not name or "/" in name:
            raise FileNotFoundError(errno.ENOENT, f"no {name!r}")
        path = name if parent.kind is Kind.VERSION else f"{parent.name}/{name}"
        return self._in_version_node(parent.model, parent.step, path)

    def children(self, ino: int) -> list[tuple[str, Node]]:
        """The entries of directory ``ino``, sorted by name (``latest`` first in a model); of a
        model, from a listing of it at most ``LATEST_FRESH_S`` old, as ``latest``'s target is:
        from the half-second snapshot, a ring turning over faster listed versions all gone, and
        not the one ``latest`` named."""
        node = self.node(ino)
        if not node.is_dir:
            raise NotADirectoryError(errno.ENOTDIR, "not a directory")
        if node.kind is Kind.MODEL:
            self._refresh_model(node.model, LATEST_FRESH_S)
        else:
            self.refresh()
        self._live(node)
        if node.kind is Kind.ROOT:
            return [(name, self._model_node(name)) for name in self._models]
        if node.kind is Kind.MODEL:
            m = self._model(node.model)
            out = [(LATEST, self._latest_node(node.model))] if m.latest is not None else []
            return out + [(d, self._version_node(node.model, s)) for d, s in m.dirnames.items()]
        return self._entries_in(node.model, node.step, "" if node.kind is Kind.VERSION else node.name + "/")

    def listing(self, ino: int) -> list[tuple[str, Node, Attr]]:
        """``children`` of directory ``ino`` with their attributes, all of the same snapshot (the
        answer of a ``readdir``, made at its ``opendir``): attributes looked up later, from a
        newer snapshot, left out the entries gone since, and a model's listing could come out
        as ``latest`` alone. An entry the snapshot no longer holds (ENOENT) is left out."""
        out = []
        for name, node in self.children(ino):
            try:
                out.append((name, node, self._attr(node)))
            except FileNotFoundError:
                continue
        return out

    def attr(self, node: Node) -> Attr:
        """``stat`` of a live node (ENOENT if it disappeared)."""
        self.refresh()
        return self._attr(node)

    def _attr(self, node: Node) -> Attr:
        """``attr`` from the snapshot as it is."""
        self._live(node)
        if node.kind is Kind.ROOT:
            mtime = max((m.mtime_ns for m in self._models.values()), default=0) or self.mounted_ns
            return Attr(node.ino, stat.S_IFDIR | 0o755, 2 + len(self._models), 0, mtime)
        if node.kind is Kind.MODEL:
            m = self._models[node.model]  # _live: listed, perhaps unreadable (then empty)
            return Attr(node.ino, stat.S_IFDIR | 0o755, 2 + len(m.versions), 0, m.mtime_ns or self.mounted_ns)
        m = self._model(node.model)
        if node.kind is Kind.LATEST:
            return Attr(node.ino, stat.S_IFLNK | 0o777, 1, len(version_dirname(m.latest.step)), m.latest.time_ns)
        info = self._version(node.model, node.step)
        if node.kind is Kind.VERSION:
            # 1: "not counted", as filesystems that do not count say it (find and fts then look
            # into every entry). 2 said it had no subdirectory (hf/ has one), and a count needs
            # the version's files: a listing of the model read every version's index
            return Attr(node.ino, stat.S_IFDIR | 0o755, 1, 0, info.time_ns)
        if node.kind is Kind.SUBDIR:  # 2 + its subdirectories' "..", as a local filesystem counts
            prefix = node.name + "/"
            subdirs = {p[len(prefix):].partition("/")[0] for p in self._views(node.model, node.step)[1]
                       if p.startswith(prefix) and "/" in p[len(prefix):]}
            return Attr(node.ino, stat.S_IFDIR | 0o755, 2 + len(subdirs), 0, info.time_ns)
        size = self._views(node.model, node.step)[1][node.name].size
        return Attr(node.ino, stat.S_IFREG | 0o444, 1, size, info.time_ns)

    @staticmethod
    def held_attr(node: Node, held: OpenFile) -> Attr:
        """``stat`` of file ``node`` from ``held``, a handle of it that pins its version, where
        the listing no longer shows that version (its step was saved again)."""
        return Attr(node.ino, stat.S_IFREG | 0o444, 1, held.size, held.version.info.time_ns)

    def readlink(self, node: Node) -> str:
        """Target of ``<model>/latest``: ``step-…`` of the newest committed version, from a
        listing at most ``LATEST_FRESH_S`` old."""
        return version_dirname(self.latest_step(node))

    def latest_step(self, node: Node) -> int:
        """The step ``<model>/latest`` names (``readlink``)."""
        if node.kind is not Kind.LATEST:
            raise OSError(errno.EINVAL, "not a symbolic link")
        self._refresh_model(node.model, LATEST_FRESH_S)
        self._live(node)
        return self._model(node.model).latest.step

    def open(self, node: Node, flags: int) -> OpenFile:
        """Open a file for reading and pin its version (EROFS for writing, EISDIR, ENOENT;
        HeldError, without waiting, while its save's commit holds it: Store.open_version)."""
        if node.is_dir:
            raise IsADirectoryError(errno.EISDIR, "is a directory")
        # (O_APPEND alone is no write: a read-only open with it reads, as on a local file)
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC):
            raise read_only("open for writing")
        if node.kind is not Kind.FILE:
            raise OSError(errno.EINVAL, "cannot open a symbolic link")
        self.refresh()
        self._version(node.model, node.step)
        version = self._files.open((node.model, node.step, node.save_id))
        try:
            if version.info.save_id != node.save_id:
                raise FileNotFoundError(errno.ENOENT, f"{node.name}: its version was replaced")
            views = self._views(node.model, node.step, version)[1]
            return OpenFile(version, views[node.name])
        except BaseException:
            version.close()
            raise

    # ---------------------------------------------------------------- the one change allowed

    def version_to_remove(self, parent_ino: int, name: str, *, walking: bool) -> tuple[str, int] | None:
        """``rmdir parent/name``: the (model, step) to pass to ``store.remove``, or None for a
        subdirectory inside a version that is not the latest while its parent is open
        (``walking``, as ``check_unlink``): a no-op, so that ``rm -r`` of the version goes on.

        ENOTDIR for a file or ``latest``, EBUSY for a subdirectory inside the latest version,
        EPERM for one alone (``rmdir step-N/hf`` reported a removal that did not happen), EROFS
        for a model directory, EPERM for a kept version (a milestone: an ``rm -rf`` of the
        model's directory took every one of them), ENOENT if absent."""
        parent = self.node(parent_ino)
        node = self.lookup(parent_ino, name)
        if not node.is_dir:
            raise NotADirectoryError(errno.ENOTDIR, f"{name} is not a directory")
        if node.kind is Kind.SUBDIR:
            self._refuse_in_latest(node)
            if not walking:
                raise self._removed_whole(name, node)
            return None
        if parent.kind is not Kind.MODEL:
            raise read_only(f"rmdir {name} (remove its versions, or use `ckptfs rm`)")
        # kept as the region says now, not as the listing did up to a refresh ago: a `ckptfs keep`
        # right before an `rm -r` of the version would not keep it
        self._refresh_model(node.model, 0.0)
        if self._version(node.model, node.step).kept:
            raise PermissionError(errno.EPERM, f"{name} of {node.model} is kept: `ckptfs unkeep {node.model} "
                                               f"{node.step}` first, or `ckptfs rm {node.model} {node.step}`")
        return node.model, node.step

    def check_unlink(self, parent_ino: int, name: str, *, walking: bool) -> None:
        """``unlink parent/name``: succeeds (and does nothing) only for a file inside a version
        that is not the latest while its directory is open (``walking``), as ``rm -r`` holds it
        before the version's ``rmdir``; a file alone cannot go (EPERM: a version is removed
        whole). EBUSY inside the latest version, EISDIR for a directory, EROFS for ``latest``,
        ENOENT if absent."""
        node = self.lookup(parent_ino, name)
        if node.is_dir:
            raise IsADirectoryError(errno.EISDIR, f"{name} is a directory")
        if node.kind is Kind.LATEST:
            raise read_only("unlink latest")
        self._refuse_in_latest(node)
        if not walking:
            raise self._removed_whole(name, node)

    @staticmethod
    def _removed_whole(name: str, node: Node) -> PermissionError:
        """EPERM for a part of a version removed alone: a version goes whole, or not at all."""
        return PermissionError(errno.EPERM, f"{name}: a version is removed whole (rm -r "
                                            f"{version_dirname(node.step)}, or `ckptfs rm {node.model} {node.step}`)")

    def _refuse_in_latest(self, node: Node) -> None:
        """EBUSY for a name inside the latest version (``rm -r`` must stop before its rmdir)."""
        if self._version(node.model, node.step).latest:
            raise OSError(errno.EBUSY, f"{version_dirname(node.step)} is the latest version of {node.model}")

    def removed(self) -> None:
        """Call after ``store.remove`` succeeded: the next lookup sees the new listing."""
        self.refresh(force=True)
