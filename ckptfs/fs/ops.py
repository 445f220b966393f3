"""pyfuse3 operations: a thin layer over :class:`ckptfs.fs.tree.Tree`.

Each handler decodes its arguments, calls the tree, and encodes the answer; every exception
becomes an errno in one place (:func:`ckptfs.fs.errors.fuse_errors`). Nothing here blocks the trio
loop except reads of the mapped region and short metadata reads of the Store.

Caching contract with the kernel:

* files of a version are immutable, so their entries and attributes are cached for
  ``IMMUTABLE_TTL``; directories and ``latest`` for ``LISTING_TTL``, so that a new version, a new
  ``latest`` target, a version that went away and a step saved again show within about a second
  (a path to a file is walked through its version directory, whose entry is revalidated that
  often, and whose inode is new for a step saved again: see ckptfs.fs.tree, Inodes);
* files are opened with ``keep_cache`` and without ``direct_io``: the kernel page cache serves
  repeated reads, and ``mmap`` of a mounted file works.
"""
from __future__ import annotations

import errno
import itertools
import logging
import os
import time
from typing import Callable, TypeVar

import pyfuse3
import trio

from ckptfs.errors import BusyError, HeldError
from ckptfs.fs.errors import fuse_errors, read_only
from ckptfs.fs.names import version_dirname
from ckptfs.fs.nodes import Attr, Node, OpenFile
from ckptfs.fs.tree import ROOT_INODE, Tree
from ckptfs.manifest import FILE_NAME_MAX_BYTES

log = logging.getLogger("ckptfs.fs")

assert ROOT_INODE == pyfuse3.ROOT_INODE

LISTING_TTL = 0.5  # seconds: directories and latest
IMMUTABLE_TTL = 5.0  # seconds: files of a version
HELD_WAIT_S = 1.0  # seconds a request waits for a version its save holds (Store.open_version's wait)
T = TypeVar("T")
# A process that holds a file of the version ``latest`` last gave it at most LATEST_HELD_S ago, opened
# in the last LATEST_OPENED_S, is given that version again: one torch.load(mmap=True) of
# latest/checkpoint.pt walks the path twice (the zip reader's open, then UntypedStorage.from_file),
# and a save committed between the two mixed the older version's index with the newer's tensors,
# in silence (11 of 292 loads at a save every 0.2 s). A file opened long ago (a server that keeps
# the weights it loaded mapped) does not hold latest back: its next load's first open would get
# the older version, and its second, once LATEST_HELD_S had passed, the newer.
LATEST_HELD_S = 5.0
LATEST_OPENED_S = 1.0
RELEASE_GRACE = 0.5  # seconds rmdir waits for this mount's own pending releases
BLOCK_SIZE = 1 << 20  # st_blksize, by which `cp` sizes its reads: each FUSE read also revalidates attributes


class CkptfsOperations(pyfuse3.Operations):
    """The FUSE request handlers of a ckptfs mount."""

    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, store, tree: Tree | None = None, *, views=None):
        super().__init__()
        self.store = store
        self.tree = tree or Tree(store, views=views)
        self._files: dict[int, OpenFile] = {}
        # fh -> (inode, entries, the pid that opened it)
        self._dirs: dict[int, tuple[int, list[tuple[bytes, pyfuse3.EntryAttributes]], int]] = {}
        self._fh = itertools.count(1)
        # fh of a version's file -> (process, model, step, when opened, inode)
        self._opened_by: dict[int, tuple[int, str, int, float, int]] = {}
        self._latest_given: dict[tuple[int, str], tuple[int, float]] = {}  # (process, model) -> (step, when)
        self._lookups: dict[int, int] = {}  # inode -> lookups the kernel holds (_known, forget)
        self._in_listings: dict[int, int] = {}  # inode -> open directory listings that hold it
        self.initialized = False  # set once the kernel's INIT request has been answered

    def init(self):
        self.initialized = True

    # -------------------------------------------------------------- attributes and names

    def _entry(self, node: Node, a: Attr | None = None) -> pyfuse3.EntryAttributes:
        """The kernel's entry of ``node``, of its attributes ``a`` (None: looked up now)."""
        a = self.tree.attr(node) if a is None else a
        e = pyfuse3.EntryAttributes()
        e.st_ino = a.ino
        e.generation = 0
        ttl = IMMUTABLE_TTL if node.in_version else LISTING_TTL
        e.entry_timeout = ttl
        e.attr_timeout = ttl
        e.st_mode = a.mode
        e.st_nlink = a.nlink
        e.st_uid = self.tree.uid
        e.st_gid = self.tree.gid
        e.st_rdev = 0
        e.st_size = a.size
        e.st_blksize = BLOCK_SIZE
        e.st_blocks = (a.size + 511) // 512
        e.st_atime_ns = e.st_mtime_ns = e.st_ctime_ns = a.mtime_ns
        return e

    async def _unheld(self, call: Callable[[], T]) -> T:
        """``call()``, again while it raises HeldError (a version its save's commit holds:
        listed from the moment its header is written), up to HELD_WAIT_S, without blocking the
        loop's other requests: the tree never waits (Store.open_version's ``wait_s``), as a
        wait there stalled every request of the mount, every model's, for the commit's
        barrier."""
        deadline = trio.current_time() + HELD_WAIT_S
        while True:
            try:
                return call()
            except HeldError:
                if trio.current_time() >= deadline:
                    raise
            await trio.sleep(0.002)

    async def lookup(self, parent_inode, name, ctx=None):
        with fuse_errors("lookup"):
            return self._known(await self._unheld(lambda: self._entry(self.tree.lookup(parent_inode, os.fsdecode(name)))))

    async def getattr(self, inode, ctx=None):
        with fuse_errors("getattr"):
            node = self.tree.node(inode)
            try:
                return await self._unheld(lambda: self._entry(node))
            except FileNotFoundError:
                # a file held open whose version the listing no longer shows (its step saved
                # again): its handle still reads the version it pins, and the kernel's check of
                # the attributes before a read (an fstat) failed the reader with ENOENT
                held = next((self._files[fh] for fh, opened in self._opened_by.items()
                             if opened[4] == inode and fh in self._files), None)
                if held is None:
                    raise
                return self._entry(node, self.tree.held_attr(node, held))

    async def readlink(self, inode, ctx):
        with fuse_errors("readlink"):
            node = self.tree.node(inode)
            step = self.tree.latest_step(node)
            key, now = (_requester(ctx), node.model), time.monotonic()
            given = self._latest_given.get(key)
            if (given is not None and now - given[1] < LATEST_HELD_S and given[0] != step
                    and any(opened[:3] == (*key, given[0]) and now - opened[3] < LATEST_OPENED_S
                            for opened in self._opened_by.values())):
                step = given[0]  # see LATEST_HELD_S; pinned by that file, so still there
            else:  # given fresh: the window starts again (a later load of the same step is held too)
                if len(self._latest_given) > 4096:
                    self._latest_given = {k: g for k, g in self._latest_given.items() if now - g[1] < LATEST_HELD_S}
                self._latest_given[key] = (step, now)
            return os.fsencode(version_dirname(step))

    def _known(self, entry: pyfuse3.EntryAttributes) -> pyfuse3.EntryAttributes:
        """``entry``, counted as one more lookup of its inode by the kernel (a LOOKUP's answer,
        each entry of a READDIRPLUS), until its FORGET."""
        self._lookups[entry.st_ino] = self._lookups.get(entry.st_ino, 0) + 1
        return entry

    async def forget(self, inode_list):
        """Drop the inodes the kernel forgot (all their lookups), so that the table of a mount
        up for weeks beside a job saving every minute holds what the kernel caches, not every
        version ever listed. A count here can only be too high (a reply the kernel dropped):
        an inode is then kept, never dropped while the kernel still holds it."""
        for ino, nlookup in inode_list:
            if not _count_down(self._lookups, ino, nlookup):
                self._drop_unknown(ino)

    def _drop_unknown(self, ino: int) -> None:
        """Drop ``ino`` from the tree unless the kernel or an open listing (whose readdir may
        still hand it out) holds it."""
        if ino not in self._lookups and ino not in self._in_listings:
            self.tree.forget(ino)

    # -------------------------------------------------------------- directories

    async def opendir(self, inode, ctx):
        """Take the entries and their attributes now, of one snapshot (``Tree.listing``), so
        that a listing that changes meanwhile is read consistently."""
        with fuse_errors("opendir"):
            listing = await self._unheld(lambda: self.tree.listing(inode))
            entries = [(os.fsencode(n), self._entry(node, a)) for n, node, a in listing]
            for _, node, _ in listing:
                self._in_listings[node.ino] = self._in_listings.get(node.ino, 0) + 1
            fh = next(self._fh)
            self._dirs[fh] = (inode, entries, _requester(ctx))
            return fh

    async def readdir(self, fh, start_id, token):
        with fuse_errors("readdir"):
            entries = self._dirs[fh][1]
            for i in range(start_id, len(entries)):
                name, entry = entries[i]
                if not pyfuse3.readdir_reply(token, name, entry, i + 1):
                    break
                self._known(entry)  # pyfuse3 answers READDIRPLUS: the kernel counts a lookup

    async def releasedir(self, fh):
        _, entries, _ = self._dirs.pop(fh, (None, (), None))
        for _, entry in entries:  # the entries it never handed out are dropped here
            if not _count_down(self._in_listings, entry.st_ino, 1):
                self._drop_unknown(entry.st_ino)

    # -------------------------------------------------------------- files

    async def open(self, inode, flags, ctx):
        with fuse_errors("open"):
            node = self.tree.node(inode)
            handle = await self._unheld(lambda: self.tree.open(node, flags))
            fh = next(self._fh)
            self._files[fh] = handle
            self._opened_by[fh] = (_requester(ctx), node.model, node.step, time.monotonic(), inode)
            return pyfuse3.FileInfo(fh=fh, keep_cache=True, direct_io=False)

    async def read(self, fh, off, size):
        with fuse_errors("read"):
            return self._files[fh].read(off, size)

    async def release(self, fh):
        with fuse_errors("release"):
            handle = self._files.pop(fh, None)
            self._opened_by.pop(fh, None)
            if handle is not None:
                handle.close()

    async def flush(self, fh):
        pass

    async def fsync(self, fh, datasync):
        pass

    # -------------------------------------------------------------- the one change: rm -r of a version

    async def rmdir(self, parent_inode, name, ctx):
        """Remove a version from the region (``store.remove``: a metadata update, done inline).

        The kernel sends RELEASE asynchronously after close(2), so ``cp dir/f x; rm -r dir``
        can find the version still pinned by this mount; while one of our own handles pins it,
        wait up to ``RELEASE_GRACE`` seconds for pending releases before answering EBUSY."""
        with fuse_errors("rmdir"):
            target = self.tree.version_to_remove(parent_inode, os.fsdecode(name),
                                                 walking=self._walking(parent_inode, ctx))
            if target is None:
                return  # a subdirectory inside a version: goes with the version's own rmdir
            model, step = target
            deadline = trio.current_time() + RELEASE_GRACE
            while True:
                try:
                    self.store.remove(model, step)
                    break
                except BusyError:
                    if trio.current_time() > deadline or not self._pinned_here(model, step):
                        raise
                    await trio.sleep(0.02)
            self.tree.removed()

    def _pinned_here(self, model: str, step: int) -> bool:
        return any(h.version.info.model == model and h.version.info.step == step for h in self._files.values())

    async def unlink(self, parent_inode, name, ctx):
        """Accepted as a no-op for files of a non-latest version while the process removing them
        has their directory open, as ``rm -r`` does (see ckptfs.fs.tree): another process's
        listing (an ``ls``, an rsync) made a lone ``rm FILE`` exit 0, the file still there."""
        with fuse_errors("unlink"):
            self.tree.check_unlink(parent_inode, os.fsdecode(name), walking=self._walking(parent_inode, ctx))

    def _walking(self, parent_inode: int, ctx) -> bool:
        """Whether the process asking has directory ``parent_inode`` open, as ``rm -r`` (and
        ``shutil.rmtree``) hold a directory while they remove what is in it."""
        me = _requester(ctx)
        return any(ino == parent_inode and pid == me for ino, _, pid in self._dirs.values())

    # -------------------------------------------------------------- everything else is read-only

    async def _refuse(self, what: str):
        with fuse_errors(what):
            raise read_only(what)

    async def setattr(self, inode, attr, fields, fh, ctx):
        await self._refuse("setattr")

    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        await self._refuse("mknod")

    async def mkdir(self, parent_inode, name, mode, ctx):
        await self._refuse("mkdir")

    async def symlink(self, parent_inode, name, target, ctx):
        await self._refuse("symlink")

    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        await self._refuse("rename")

    async def link(self, inode, new_parent_inode, new_name, ctx):
        await self._refuse("link")

    async def create(self, parent_inode, name, mode, flags, ctx):
        await self._refuse("create")

    async def write(self, fh, off, buf):
        await self._refuse("write")

    async def setxattr(self, inode, name, value, ctx):
        await self._refuse("setxattr")

    async def removexattr(self, inode, name, ctx):
        await self._refuse("removexattr")

    async def getxattr(self, inode, name, ctx):
        raise pyfuse3.FUSEError(errno.ENODATA)

    async def listxattr(self, inode, ctx):
        return []

    async def statfs(self, ctx):
        """Region size and use, in 4 KiB blocks (from ``store.status()``)."""
        with fuse_errors("statfs"):
            st = pyfuse3.StatvfsData()
            st.f_bsize = st.f_frsize = 4096
            total, free = _region_space(self.store)
            st.f_blocks = total // 4096
            st.f_bfree = st.f_bavail = max(free, 0) // 4096
            # no inode limit: none counted, as procfs and sysfs (`df -i` shows "-"); the inodes in
            # use with none free read as a full filesystem to the monitoring of every host
            st.f_files = st.f_ffree = st.f_favail = 0
            st.f_namemax = FILE_NAME_MAX_BYTES
            return st

    # -------------------------------------------------------------- shutdown

    def close_all(self) -> None:
        """Release every pin still held (at unmount)."""
        self.tree.close()
        for handle in self._files.values():
            try:
                handle.close()
            except Exception:  # noqa: BLE001
                log.exception("closing a pinned version")
        self._files.clear()
        self._dirs.clear()


def _count_down(counts: dict[int, int], ino: int, by: int) -> bool:
    """Take ``by`` from ``counts[ino]``; whether any is left (else the key is gone)."""
    left = counts.pop(ino, 0) - by
    if left > 0:
        counts[ino] = left
    return left > 0


def _requester(ctx) -> int:
    """The process behind a request (0 where its context is not known)."""
    return _process_of(ctx.pid) if ctx is not None else 0


def _process_of(pid: int) -> int:
    """The process (thread group) of ``pid``: a request's pid is its thread's id (one thread of
    a process opened a directory, another removes its files)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return pid


def _region_space(store) -> tuple[int, int]:
    """(total, free) bytes of the region (``Store.space``: the model table only, not
    ``status``, which looks at every process for the holders of pins); zeros if it cannot say."""
    try:
        space = store.space()
    except Exception:  # noqa: BLE001 - statfs must answer
        log.exception("store.space()")
        return 0, 0
    return space["region_bytes"], space["free_bytes"]
