"""Tier 1: the mount's name space, inode table and errno translation, without a kernel.

A small in-memory Store stands in for the region, so that listings, removals, slot reuse and the
refresh clock are under the test's control.
"""
import errno
import functools
import os
import stat
from dataclasses import replace

import pyfuse3
import pytest
import trio

from ckptfs import errors as E
from ckptfs.fs.errors import errno_for
from ckptfs.fs.ops import CkptfsOperations
from ckptfs.fs.nodes import Kind
from ckptfs.fs.tree import ROOT_INODE, Tree
from ckptfs.views import Literal, View


from ckptfs.store import VersionInfo as Info  # noqa: E402 - the fake store lists real records


class FakeVersion:
    def __init__(self, store, info):
        self.store, self.info = store, info
        self.manifest = info  # the fake files_for only needs the identity
        self.closed = False

    def read(self, offset, length):
        return self.store.region[offset:offset + length]

    def confirm(self):
        self.store.confirms += 1

    def close(self):
        if not self.closed:
            self.closed = True
            self.store.pins[(self.info.model, self.info.step)] -= 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class FakeStore:
    def __init__(self):
        self.path = "/fake.region"
        self.region = bytes(range(256)) * 16
        self.table: dict[str, dict[int, Info]] = {}
        self.pins: dict[tuple, int] = {}
        self.listings = 0
        self.version_listings: dict[str, int] = {}  # model -> versions() calls
        self.counter = 0
        self.confirms = 0  # reads confirmed after their copy (the bus guard's check)
        self.given_manifests: list = []  # the manifest= of each open_version

    def commit(self, model, step):
        self.counter += 1
        versions = self.table.setdefault(model, {})
        for s, i in versions.items():
            versions[s] = replace(i, latest=False)
        versions[step] = Info(model, step, self.counter, 0, 1_000_000_000 * self.counter, 100, True)

    def models(self):
        self.listings += 1
        return list(self.table)

    def versions(self, model):
        self.version_listings[model] = self.version_listings.get(model, 0) + 1
        if model not in self.table:
            raise E.NotFoundError(model)
        return sorted(self.table[model].values(), key=lambda i: i.step)

    def open_version(self, model, step=None, checked=None, manifest=None, counter=None, wait_s=1.0, whole=True):
        self.given_manifests.append(manifest)
        info = self.table.get(model, {}).get(step)
        if info is None or counter not in (None, info.counter):
            raise E.NotFoundError(f"{model} {step}")
        self.pins[(model, step)] = self.pins.get((model, step), 0) + 1
        return FakeVersion(self, info)

    def remove(self, model, step):
        info = self.table.get(model, {}).get(step)
        if info is None:
            raise E.NotFoundError(f"{model} {step}")
        if info.latest or self.pins.get((model, step)):
            raise E.BusyError("busy")
        del self.table[model][step]

    def space(self):
        return {"region_bytes": 1 << 30, "used_bytes": 1 << 20, "free_bytes": (1 << 30) - (2 << 20)}


def fake_files_for(info):
    """checkpoint.pt: a literal header + 1000 region bytes; sizes depend on the counter."""
    header = f"v{info.counter}".encode()
    return {"checkpoint.pt": View([Literal(header), _extent(0, 1000)]),
            "metadata.json": View([Literal(b"{}" * info.counter)])}


def _extent(offset, length):
    from ckptfs.views import Extent

    return Extent(offset, length)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def env():
    store, clock = FakeStore(), Clock()
    for s in (10, 20, 30):
        store.commit("gpt", s)
    tree = Tree(store, files_for=fake_files_for, whole=lambda store, version, layout: (version, False), clock=clock)
    return store, tree, clock


def path(tree, *names):
    node = tree.node(ROOT_INODE)
    for n in names:
        node = tree.lookup(node.ino, n)
    return node


def err(fn, *args, **kwargs):
    with pytest.raises(OSError) as e:
        fn(*args, **kwargs)
    return e.value.errno


def test_names_kinds_and_attributes(env):
    store, tree, clock = env
    assert [n for n, _ in tree.children(ROOT_INODE)] == ["gpt"]
    model = path(tree, "gpt")
    assert [n for n, _ in tree.children(model.ino)] == ["latest", "step-00000010", "step-00000020", "step-00000030"]
    latest = path(tree, "gpt", "latest")
    assert latest.kind is Kind.LATEST and tree.readlink(latest) == "step-00000030"
    assert stat.S_ISLNK(tree.attr(latest).mode) and tree.attr(latest).size == len("step-00000030")
    f = path(tree, "gpt", "step-00000020", "checkpoint.pt")
    a = tree.attr(f)
    assert stat.S_ISREG(a.mode) and a.size == 2 + 1000 and a.mtime_ns == store.table["gpt"][20].time_ns
    assert stat.S_ISDIR(tree.attr(model).mode)


def test_inodes_stable_across_refreshes_and_new_for_a_recommitted_step(env):
    store, tree, clock = env
    d = path(tree, "gpt", "step-00000020")
    f = path(tree, "gpt", "step-00000020", "checkpoint.pt")
    g = path(tree, "gpt", "step-00000010", "checkpoint.pt")
    assert len({d.ino, f.ino, g.ino, ROOT_INODE}) == 4
    clock.now += 10
    store.commit("gpt", 40)
    assert path(tree, "gpt", "step-00000020").ino == d.ino
    assert path(tree, "gpt", "step-00000020", "checkpoint.pt").ino == f.ino
    # step 20 removed and saved again: new directory and file inodes (new bytes); the kernel's
    # cached names of the old files, under the old directory, lead nowhere
    store.table["gpt"].pop(20)
    store.commit("gpt", 20)
    clock.now += 10
    d2 = path(tree, "gpt", "step-00000020")
    f2 = path(tree, "gpt", "step-00000020", "checkpoint.pt")
    assert d2.ino != d.ino and f2.ino != f.ino and tree.attr(f2).size == 2 + 1000
    assert err(tree.attr, f) == errno.ENOENT  # the old file is gone, not silently the new one
    assert err(tree.attr, d) == errno.ENOENT and err(tree.lookup, d.ino, "checkpoint.pt") == errno.ENOENT


def test_listing_is_refreshed_at_most_every_half_second(env):
    store, tree, clock = env
    path(tree, "gpt")
    n = store.listings
    for _ in range(20):
        path(tree, "gpt", "latest")
    assert store.listings == n
    store.commit("gpt", 40)
    assert err(path, tree, "gpt", "step-00000040") == errno.ENOENT  # not yet seen
    clock.now += 0.5
    assert path(tree, "gpt", "step-00000040").kind is Kind.VERSION
    assert store.listings == n + 1
    assert tree.readlink(path(tree, "gpt", "latest")) == "step-00000040"


def test_latest_and_the_version_it_names_come_from_a_fresh_listing(env):
    """A job saving every 50 ms reuses a slot soon after its version stops being latest:
    ``latest`` is read from a listing at most LATEST_FRESH_S old, and the version it names is
    found even where the half-second snapshot does not hold it yet."""
    from ckptfs.fs.tree import LATEST_FRESH_S

    store, tree, clock = env
    store.commit("other", 1)
    latest = path(tree, "gpt", "latest")
    n, listed = store.listings, dict(store.version_listings)
    for step in (40, 50):
        store.commit("gpt", step)
        clock.now += 2 * LATEST_FRESH_S
        assert tree.readlink(latest) == f"step-{step:08d}"
        assert path(tree, "gpt", f"step-{step:08d}", "checkpoint.pt").kind is Kind.FILE
    # a listing of the model per readlink (the lookups used it), not of the region
    assert store.version_listings["gpt"] == listed["gpt"] + 2 and store.listings == n
    assert store.version_listings["other"] == listed["other"]
    store.commit("gpt", 60)
    clock.now += 2 * LATEST_FRESH_S
    assert path(tree, "gpt", "step-00000060").kind is Kind.VERSION  # not named by a readlink yet
    assert err(path, tree, "gpt", "step-00000070") == errno.ENOENT
    assert store.version_listings["gpt"] == listed["gpt"] + 3 and store.listings == n


def test_vanished_versions_and_models_are_enoent_and_uncached(env):
    store, tree, clock = env
    f = path(tree, "gpt", "step-00000010", "checkpoint.pt")
    key = ("gpt", 10, store.table["gpt"][10].save_id)
    assert key in tree._files
    del store.table["gpt"][10]
    clock.now += 1
    assert err(path, tree, "gpt", "step-00000010") == errno.ENOENT
    assert err(tree.attr, f) == errno.ENOENT
    assert err(tree.open, f, os.O_RDONLY) == errno.ENOENT
    assert key not in tree._files
    del store.table["gpt"]
    clock.now += 1
    assert tree.children(ROOT_INODE) == []
    assert err(path, tree, "gpt") == errno.ENOENT


def test_a_model_whose_versions_cannot_be_read_is_there_and_answers_eio(env, caplog):
    """The device failing under a mount (EIO on every read of a model's headers): the model
    vanished from the mount (``ls`` empty, ENOENT inside), so ``rsync --delete`` from it, or a
    job's "resume if the checkpoint exists", acted on a false "absent". Its directory stays, and
    everything inside answers EIO, said once in the log; it lists again once the reads work."""
    store, tree, clock = env
    store.commit("other", 1)
    real = store.versions

    def failing(model):
        if model == "gpt":
            raise E.RegionIOError("read of /fake.region failed: Input/output error", errno.EIO, "pread")
        return real(model)
    store.versions = failing
    for _ in range(3):
        clock.now += 1
        assert [name for name, _ in tree.children(ROOT_INODE)] == ["gpt", "other"]
    gpt = path(tree, "gpt")
    assert stat.S_ISDIR(tree.attr(gpt).mode)
    def answer(fn, *args):  # the errno the mount answers (ckptfs.fs.errors)
        with pytest.raises(Exception) as e:
            fn(*args)
        return errno_for(e.value)
    assert answer(tree.children, gpt.ino) == errno.EIO
    assert answer(path, tree, "gpt", "latest") == errno.EIO
    assert answer(path, tree, "gpt", "step-00000010", "checkpoint.pt") == errno.EIO
    assert [name for name, _ in tree.children(path(tree, "other").ino)] == ["latest", "step-00000001"]
    assert caplog.text.count("model 'gpt' cannot be listed: read of /fake.region failed") == 1
    store.versions = real
    clock.now += 1
    assert [name for name, _ in tree.children(gpt.ino)][0] == "latest"


def test_open_pins_until_close_and_reads_the_view(env):
    store, tree, clock = env
    f = path(tree, "gpt", "step-00000020", "checkpoint.pt")
    h = tree.open(f, os.O_RDONLY)
    assert store.pins[("gpt", 20)] == 1
    assert h.read(0, 2) == b"v2" and h.read(2, 4) == store.region[:4] and h.read(1000, 50) == store.region[998:1000]
    assert h.read(h.size, 10) == b""
    assert store.confirms == 4  # every reply confirmed, once its bytes were copied
    h.close()
    assert store.pins[("gpt", 20)] == 0
    # the index decoded for the listing is handed to every later open of the version's files
    # (Store.open_version reuses it while the slot holds that save): no decode per open
    store.given_manifests.clear()
    tree.open(f, os.O_RDONLY).close()
    assert [m.counter for m in store.given_manifests] == [store.table["gpt"][20].counter]


def test_open_of_a_replaced_version_releases_its_pin(env):
    store, tree, clock = env
    f = path(tree, "gpt", "step-00000020", "checkpoint.pt")
    store.table["gpt"][20] = replace(store.table["gpt"][20], counter=99)  # slot reused, same step
    assert err(tree.open, f, os.O_RDONLY) == errno.ENOENT
    assert store.pins[("gpt", 20)] == 0


def test_changes_allowed_and_refused(env):
    store, tree, clock = env
    model = path(tree, "gpt")
    v10 = path(tree, "gpt", "step-00000010")
    v30 = path(tree, "gpt", "step-00000030")
    f = path(tree, "gpt", "step-00000010", "checkpoint.pt")
    for flags in (os.O_WRONLY, os.O_RDWR, os.O_TRUNC, os.O_WRONLY | os.O_APPEND):
        assert err(tree.open, f, flags) == errno.EROFS
    tree.open(f, os.O_RDONLY | os.O_APPEND).close()  # a read (it was EROFS; a local file reads)
    assert err(tree.open, v10, os.O_RDONLY) == errno.EISDIR
    tree.check_unlink(v10.ino, "checkpoint.pt", walking=True)  # accepted: first half of `rm -r`
    assert err(tree.check_unlink, v10.ino, "checkpoint.pt", walking=False) == errno.EPERM  # a file alone
    assert err(tree.check_unlink, v30.ino, "checkpoint.pt", walking=True) == errno.EBUSY  # latest
    assert err(tree.check_unlink, model.ino, "latest", walking=True) == errno.EROFS
    assert err(tree.check_unlink, model.ino, "step-00000010", walking=True) == errno.EISDIR
    assert err(tree.check_unlink, v10.ino, "nope", walking=True) == errno.ENOENT
    for walking in (True, False):  # a version is removed the same way however it is asked
        remove = functools.partial(tree.version_to_remove, walking=walking)
        assert remove(model.ino, "step-00000010") == ("gpt", 10)
        assert err(remove, model.ino, "latest") == errno.ENOTDIR
        assert err(remove, v10.ino, "checkpoint.pt") == errno.ENOTDIR
        assert err(remove, ROOT_INODE, "gpt") == errno.EROFS
        assert err(remove, model.ino, "step-00000099") == errno.ENOENT
    assert err(tree.lookup, f.ino, "x") == errno.ENOTDIR
    assert err(tree.readlink, f) == errno.EINVAL


def test_directory_links_count_subdirectories_and_long_names_are_enametoolong():
    """A version directory's nlink is 1, "not counted" (2 told find and fts it had no
    subdirectory, and hf/ is one; a count would read every version's index to list a model),
    a subdirectory's 2 + its subdirectories, as on a local filesystem; a name past NAME_MAX is
    ENAMETOOLONG, as a local filesystem answers, not ENOENT."""
    store = FakeStore()
    store.commit("gpt", 10)

    def files_for(info):
        leaf = View([Literal(b"x")])
        return {"checkpoint.pt": leaf, "hf/config.json": leaf, "hf/sub/a": leaf, "hf/sub2/b": leaf,
                "other/c": leaf}

    tree = Tree(store, files_for=files_for, whole=lambda store, version, layout: (version, False), clock=Clock())
    assert tree.attr(path(tree, "gpt", "step-00000010")).nlink == 1
    assert tree.attr(path(tree, "gpt", "step-00000010", "hf")).nlink == 2 + 2  # sub/, sub2/
    assert tree.attr(path(tree, "gpt", "step-00000010", "hf", "sub")).nlink == 2
    assert tree.attr(path(tree, "gpt", "step-00000010", "other")).nlink == 2
    assert [a.nlink for n, _, a in tree.listing(path(tree, "gpt").ino) if n != "latest"] == [1]
    assert [n for n, _, a in tree.listing(path(tree, "gpt", "step-00000010").ino) if a.nlink > 1] == ["hf", "other"]
    v = path(tree, "gpt", "step-00000010")
    assert err(tree.lookup, v.ino, "x" * 256) == errno.ENAMETOOLONG
    assert err(tree.lookup, v.ino, "é" * 128) == errno.ENAMETOOLONG  # bytes, not characters
    assert err(tree.lookup, v.ino, "x" * 255) == errno.ENOENT


@pytest.mark.parametrize("exc, code", [
    (E.NotFoundError("x"), errno.ENOENT),
    (E.BusyError("x"), errno.EBUSY),
    (E.CorruptionError("x"), errno.EIO),
    (E.RegionFormatError("x"), errno.EIO),
    (E.InvalidNameError("x"), errno.ENOENT),
    (E.CkptfsError("x"), errno.EIO),
    (pyfuse3.FUSEError(errno.EXDEV), errno.EXDEV),
    (OSError(errno.EROFS, "ro"), errno.EROFS),
    (FileNotFoundError(errno.ENOENT, "x"), errno.ENOENT),
    (OSError("no errno"), errno.EIO),
    (ValueError("bug"), errno.EIO),
])
def test_errno_for(exc, code):
    assert errno_for(exc) == code


def _ops(env):
    store, tree, clock = env
    return store, tree, CkptfsOperations(store, tree)


def test_ops_translate_errors_and_survive_bugs(env):
    store, tree, ops = _ops(env)
    f = path(tree, "gpt", "step-00000010", "checkpoint.pt")

    async def scenario():
        with pytest.raises(pyfuse3.FUSEError) as e:
            await ops.lookup(ROOT_INODE, b"nope", None)
        assert e.value.errno == errno.ENOENT
        with pytest.raises(pyfuse3.FUSEError) as e:
            await ops.mkdir(ROOT_INODE, b"x", 0o755, None)
        assert e.value.errno == errno.EROFS
        info = await ops.open(f.ino, os.O_RDONLY, None)
        assert info.keep_cache and not info.direct_io
        assert bytes(await ops.read(info.fh, 0, 2)) == b"v1"
        ops._files[info.fh].view = None  # a bug below the handler: EIO, not a dead mount
        with pytest.raises(pyfuse3.FUSEError) as e:
            await ops.read(info.fh, 0, 2)
        assert e.value.errno == errno.EIO
        await ops.release(info.fh)
        assert store.pins[("gpt", 10)] == 0
        with pytest.raises(pyfuse3.FUSEError) as e:
            await ops.rmdir(path(tree, "gpt").ino, b"step-00000030", None)
        assert e.value.errno == errno.EBUSY
        await ops.rmdir(path(tree, "gpt").ino, b"step-00000010", None)
        assert 10 not in store.table["gpt"]
        assert [n for n, _ in tree.children(path(tree, "gpt").ino)] == ["latest", "step-00000020", "step-00000030"]
        st = await ops.statfs(None)
        assert st.f_blocks == (1 << 30) // 4096 and st.f_bfree == ((1 << 30) - (2 << 20)) // 4096

    trio.run(scenario)


def test_a_model_listing_is_one_fresh_snapshot_holding_the_version_latest_names(env, monkeypatch):
    """A job whose ring turns over faster than the half-second snapshot: ``ls MODEL`` lists the
    versions of one listing of it taken at opendir (at most LATEST_FRESH_S old), ``latest``'s
    among them. It listed the opendir's stale snapshot less what a newer one no longer held at
    readdir: ``latest`` alone, as if the model had no version (4 of 2000 listings at 30 saves/s)."""
    store, tree, ops = _ops(env)
    model = path(tree, "gpt")  # the half-second snapshot: steps 10, 20, 30

    def turn_over(steps):  # the ring reuses every slot
        store.table["gpt"] = {}
        for step in steps:
            store.commit("gpt", step)

    replies = []
    monkeypatch.setattr(pyfuse3, "readdir_reply", lambda token, name, entry, next_id: replies.append(name) or True)

    async def scenario():
        tree._clock.now += 0.1
        turn_over((40, 50, 60))
        fh = await ops.opendir(model.ino, None)
        tree._clock.now += 0.6  # readdir's look at the entries takes a newer snapshot
        turn_over((70, 80, 90))
        await ops.readdir(fh, 0, None)
        await ops.releasedir(fh)

    trio.run(scenario)
    assert replies == [b"latest", b"step-00000040", b"step-00000050", b"step-00000060"]


def test_forgotten_inodes_leave_the_table_and_come_back_with_their_numbers(env, monkeypatch):
    """The kernel's FORGET drops an inode once every lookup of it (LOOKUP answers, READDIRPLUS
    entries) is forgotten: a mount up for weeks beside a job saving every minute kept a node
    for every version ever listed. A name looked up again gets the number it had (a hash of it:
    the same in another mount too); an inode an open listing may still hand out stays."""
    store, tree, ops = _ops(env)
    sent = []
    monkeypatch.setattr(pyfuse3, "readdir_reply",
                        lambda token, name, entry, next_id: not sent and (sent.append(entry.st_ino) or True))

    def known(ino):
        try:
            return tree.node(ino) is not None
        except FileNotFoundError:
            return False

    async def scenario():
        model = await ops.lookup(ROOT_INODE, b"gpt", None)
        assert (await ops.lookup(ROOT_INODE, b"gpt", None)).st_ino == model.st_ino  # 2 lookups
        v10 = await ops.lookup(model.st_ino, b"step-00000010", None)
        fh = await ops.opendir(v10.st_ino, None)
        await ops.readdir(fh, 0, None)  # the kernel's buffer takes 1 entry of the 2 files
        listed = [e.st_ino for _, e in ops._dirs[fh][1]]
        assert sent == listed[:1] and len(listed) == 2
        f = await ops.lookup(v10.st_ino, b"checkpoint.pt", None)
        await ops.forget([(sent[0], 1)])
        assert known(sent[0]) and known(listed[1])  # in the open listing, which may hand them out
        await ops.releasedir(fh)
        assert not known(listed[1])  # never handed out
        assert known(sent[0]) == (sent[0] == f.st_ino)  # the kernel holds it if it is the file looked up
        await ops.forget([(f.st_ino, 1), (v10.st_ino, 1)])
        assert not known(sent[0]) and not known(f.st_ino) and not known(v10.st_ino)
        await ops.forget([(model.st_ino, 1)])
        assert known(model.st_ino)  # one of its two lookups is still held
        await ops.forget([(model.st_ino, 1), (ROOT_INODE, 1)])
        assert not known(model.st_ino) and known(ROOT_INODE)
        assert list(tree._by_ino) == [ROOT_INODE]  # nothing else kept
        again = await ops.lookup(ROOT_INODE, b"gpt", None)
        assert again.st_ino == model.st_ino
        assert (await ops.lookup(again.st_ino, b"step-00000010", None)).st_ino == v10.st_ino

    trio.run(scenario)
    other = Tree(store, files_for=fake_files_for, whole=lambda store, version, layout: (version, False), clock=Clock())
    assert path(other, "gpt", "step-00000010").ino == path(tree, "gpt", "step-00000010").ino  # another mount


def test_a_file_held_open_keeps_its_attributes_when_its_step_is_saved_again(env):
    """A job rolled back saves step 10 again while a reader copies its file: the open file pins
    the old save and reads it, and its getattr (the kernel's check before a read once the
    attributes expired, an fstat) answers from that handle. It said ENOENT, failing the copy."""
    store, tree, ops = _ops(env)
    f = path(tree, "gpt", "step-00000010", "checkpoint.pt")

    async def scenario():
        info = await ops.open(f.ino, os.O_RDONLY, None)
        store.table["gpt"].pop(10)
        store.commit("gpt", 10)  # saved again: a new save of the step
        tree._clock.now += 10
        assert path(tree, "gpt", "step-00000010", "checkpoint.pt").ino != f.ino  # the new save's file
        attr = await ops.getattr(f.ino, None)
        assert attr.st_size == 2 + 1000 and attr.st_ino == f.ino
        assert bytes(await ops.read(info.fh, 0, 2)) == b"v1"  # the old save's bytes
        await ops.release(info.fh)
        with pytest.raises(pyfuse3.FUSEError) as e:
            await ops.getattr(f.ino, None)
        assert e.value.errno == errno.ENOENT  # closed: gone, as before

    trio.run(scenario)


def test_rmdir_waits_for_a_pending_release_of_its_own(env):
    """close(2) sends RELEASE asynchronously: an rmdir right after must not fail with EBUSY."""
    store, tree, ops = _ops(env)
    f = path(tree, "gpt", "step-00000010", "checkpoint.pt")

    async def scenario():
        info = await ops.open(f.ino, os.O_RDONLY, None)
        async with trio.open_nursery() as n:
            n.start_soon(ops.rmdir, path(tree, "gpt").ino, b"step-00000010", None)
            await trio.sleep(0.1)
            await ops.release(info.fh)
        assert 10 not in store.table["gpt"]

    trio.run(scenario)


def test_a_version_is_checksummed_once_per_mount_not_once_per_open(tmp_path, monkeypatch):
    import torch

    import ckptfs
    import ckptfs.reader as reader_mod
    import ckptfs.region.backend as backend_mod

    with ckptfs.Store.create(str(tmp_path / "r.region"), size_bytes=64 << 20) as store:
        with store.writer("m") as w:
            w.save({"a": torch.arange(1000.0), "b": torch.ones(3000)}, step=1).result()
        calls = []
        real_crc32 = reader_mod.crc32
        for module in (reader_mod, backend_mod):  # the check of a tensor read at random, and of one streamed
            monkeypatch.setattr(module, "crc32", lambda data, value=0: calls.append(len(data)) or real_crc32(data, value))
        tree = Tree(store)
        version_dir = tree.lookup(tree.lookup(ROOT_INODE, "m").ino, "step-00000001")
        node = tree.lookup(version_dir.ino, "state.safetensors")
        contents = []
        for _ in range(3):
            f = tree.open(node, os.O_RDONLY)
            contents.append(f.read(0, f.size))
            f.close()
        assert contents[0] == contents[1] == contents[2]
        assert sorted(calls) == [4000, 12000]  # each tensor once, by the first open


def test_a_model_made_again_is_never_served_from_the_removed_ones_files(tmp_path):
    """A model removed and made again counts its saves from 1 again: its step 2 has the counter
    the removed model's step 2 had. The mount must serve the new version's bytes (checked
    against their CRCs), not the removed one's cached index over the new data, nor skip the
    checks that version passed, even where it never listed the model while it was gone."""
    import torch
    from safetensors.torch import load as load_safetensors

    import ckptfs

    def save_steps(store, value, numel):
        with store.writer("m", max_inflight=1) as w:
            for step in range(3):
                w.save({"w": torch.full((numel,), value)}, step=step).result()

    def read(tree, name):
        model = tree.lookup(ROOT_INODE, "m")
        node = tree.lookup(tree.lookup(model.ino, "step-00000002").ino, name)
        f = tree.open(node, os.O_RDONLY)
        try:
            return node, f.read(0, f.size)
        finally:
            f.close()

    with ckptfs.Store.create(str(tmp_path / "r.region"), size_bytes=64 << 20) as store:
        save_steps(store, 1.0, 1000)
        clock = Clock()
        tree = Tree(store, clock=clock)
        old_node, old = read(tree, "state.safetensors")
        assert load_safetensors(old)["w"].tolist() == [1.0] * 1000
        store.remove_model("m")
        save_steps(store, 2.0, 3000)
        clock.now += 10
        new_node, new = read(tree, "state.safetensors")
        assert load_safetensors(new)["w"].tolist() == [2.0] * 3000
        assert new_node.ino != old_node.ino and err(tree.attr, old_node) == errno.ENOENT
        assert new == read(Tree(store), "state.safetensors")[1]


def test_each_damage_is_logged_once_and_none_past_the_cap(monkeypatch):
    from ckptfs.fs import errors as fe

    monkeypatch.setattr(fe, "_said", set())
    monkeypatch.setattr(fe, "SAID_MAX", 3)
    assert [fe._first_time(m) for m in ("a", "a", "b", "c", "d", "d", "a")] == [True, False, True, True, False,
                                                                             False, False]

