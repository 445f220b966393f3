"""Tier 2: the filesystem through a real kernel mount (root or /dev/fuse access needed).

One module-wide mount of a region holding ``toy`` at steps 100, 200, 300 (``toy_state``); tests
that change things write other models into the same region, from this process, and watch the
mount pick them up.
"""
import errno
import mmap
import os
import shutil
import signal
import stat
import subprocess
import threading
import sys
import time
import zipfile

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import ckptfs
from ckptfs.cli import main as cli_main
from ckptfs.fs.names import version_dirname as vdir
from ckptfs.views import files_for
from conftest import assert_same
from conftest_mount import CLI, TOY_MODEL, TOY_STEPS, make_toy_region, mounted, requires_fuse, toy_state

pytestmark = [pytest.mark.fuse, requires_fuse]

APPEAR_S = 2.0  # a change shows within 1 s (0.5 s refresh + 0.5 s TTL); slack for a loaded machine


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    d = tmp_path_factory.mktemp("toy")
    region = str(d / "toy.region")
    make_toy_region(region)
    with mounted(region, str(d / "mnt"), "-o", "rw") as m:  # rw: the tests of rm -r
        yield m


@pytest.fixture(scope="module")
def store(toy):
    """The mounted region, opened by the test process (another process than the daemon)."""
    with ckptfs.Store(toy.region) as s:
        yield s


def wait_for(predicate, timeout: float = APPEAR_S * 2, what: str = "condition") -> float:
    """Poll ``predicate`` until true; return the seconds it took (fail after ``timeout``)."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"{what} not reached after {timeout} s")
        time.sleep(0.02)
    return time.monotonic() - t0


def listing(path: str) -> list[str]:
    """Sorted names in ``path``; [] while it does not exist (yet)."""
    try:
        return sorted(os.listdir(path))
    except FileNotFoundError:
        return []


def oserror(fn, *args):
    with pytest.raises(OSError) as e:
        fn(*args)
    return e.value.errno


def save_versions(store, model, steps, **writer_options):
    with store.writer(model, **writer_options) as w:
        for s in steps:
            w.save({"x": torch.full((1000,), float(s)), "step": s}, s).result()


# ------------------------------------------------------------------------------ the tree


def test_tree_names_sizes_times_and_links(toy, store):
    assert TOY_MODEL in os.listdir(toy.path)
    model_dir = toy / TOY_MODEL
    assert os.listdir(model_dir) == ["latest"] + [vdir(s) for s in TOY_STEPS]
    assert os.readlink(os.path.join(model_dir, "latest")) == vdir(TOY_STEPS[-1])
    assert stat.S_ISLNK(os.lstat(os.path.join(model_dir, "latest")).st_mode)
    for step in TOY_STEPS:
        d = os.path.join(model_dir, vdir(step))
        assert stat.S_ISDIR(os.stat(d).st_mode)
        with store.open_version(TOY_MODEL, step) as v:
            views = files_for(v.manifest)
            time_ns = v.info.time_ns
        assert os.listdir(d) == list(views)
        assert {"checkpoint.pt", "state.safetensors", "model.safetensors", "optim.safetensors",
                "metadata.json"} <= set(views)
        for name, view in views.items():
            st = os.stat(os.path.join(d, name))
            assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o444
            assert st.st_size == view.size, name  # exact, not an estimate
            assert st.st_mtime_ns == time_ns  # the version's commit time, stable
            with open(os.path.join(d, name), "rb") as f:
                assert len(f.read()) == view.size


def test_mount_options_and_readahead(toy):
    from ckptfs.fs.daemon import READAHEAD_KB
    from ckptfs.mounttable import mountinfo

    dev, fstype, source = mountinfo(toy.path)
    assert (fstype, source) == ("fuse.ckptfs", toy.region)
    if os.geteuid() == 0:
        with open(f"/sys/class/bdi/{dev}/read_ahead_kb") as f:
            assert int(f.read()) == READAHEAD_KB


def test_a_region_whose_path_has_a_comma_is_known_as_mounted(tmp_path):
    """libfuse splits its options at commas, so a mount's source (fsname=) shows each ',' of the
    region's path as '_'. The table of mounts compared the path as it is: a format with force=True
    went ahead under the mount, and `status` missed the readers behind it."""
    from ckptfs.mounttable import mount_points, mountinfo

    region = str(tmp_path / "run,1 a.region")
    make_toy_region(region, steps=(1,))
    with mounted(region, str(tmp_path / "mnt")) as m:
        assert mountinfo(m.path)[1:] == ("fuse.ckptfs", region.replace(",", "_"))
        assert mount_points(region) == [m.path]
        with pytest.raises(ckptfs.errors.BusyError, match=f"is mounted at {m.path}: unmount it first"):
            ckptfs.Store.create(region, size_bytes=64 << 20, force=True)
        other = str(tmp_path / "run_1 a.region.other")
        r = subprocess.run(CLI + ["umount", "--region", other, m.path], capture_output=True, text=True)
        assert r.returncode != 0 and f"shows region {region.replace(',', '_')}, not {other}" in r.stderr
        r = subprocess.run(CLI + ["umount", "--region", region, m.path], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert mountinfo(m.path) is None
    with ckptfs.Store(region) as store:  # nothing formatted
        assert store.latest(TOY_MODEL).step == 1


def test_inodes_are_stable_and_distinct(toy):
    base = toy / TOY_MODEL
    paths = [os.path.join(base, vdir(s), n) for s in TOY_STEPS for n in ("checkpoint.pt", "metadata.json")]
    paths += [base, os.path.join(base, vdir(100))]
    first = [os.stat(p).st_ino for p in paths]
    assert len(set(first)) == len(first)
    time.sleep(0.7)  # past a refresh of the listing and the attribute TTL of directories
    assert [os.stat(p).st_ino for p in paths] == first
    latest = os.path.join(base, "latest", "checkpoint.pt")
    assert os.stat(latest).st_ino == os.stat(os.path.join(base, vdir(TOY_STEPS[-1]), "checkpoint.pt")).st_ino


def test_inodes_keep_their_numbers_after_the_kernel_forgets_them_and_in_another_mount(toy, tmp_path):
    """The daemon drops the inodes the kernel forgets (its table held every name ever looked up
    for the life of the mount); a name looked up again has its old number, and another mount of
    the region gives the same numbers (a backup tool reads again a file whose inode changed)."""
    def numbers(root):
        out = {}
        for d, dirs, files in os.walk(root):
            for n in dirs + files:
                out[os.path.relpath(os.path.join(d, n), root)] = os.lstat(os.path.join(d, n)).st_ino
        return out

    if os.geteuid() != 0:
        pytest.skip("dropping the kernel's caches (its FORGETs) needs root")
    first = numbers(toy.path)
    assert len(first) > 3 * len(TOY_STEPS) and len(set(first.values())) == len(first)
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:  # the kernel forgets the names not in use
        f.write("2")
    assert numbers(toy.path) == first
    got = torch.load(os.path.join(toy / TOY_MODEL, vdir(TOY_STEPS[0]), "checkpoint.pt"), weights_only=True)
    assert_same(got, toy_state(TOY_STEPS[0]))
    with mounted(toy.region, str(tmp_path / "again")) as again:
        assert numbers(again.path) == first


# ------------------------------------------------------------------------------ standard tools on the files


@pytest.mark.parametrize("mmap_mode", [False, True], ids=["read", "mmap"])
def test_torch_load_equals_saved(toy, mmap_mode):
    for step in TOY_STEPS:
        path = os.path.join(toy / TOY_MODEL, vdir(step), "checkpoint.pt")
        obj = torch.load(path, weights_only=True, mmap=mmap_mode)
        assert_same(obj, toy_state(step))
    obj = torch.load(os.path.join(toy / TOY_MODEL, "latest", "checkpoint.pt"), weights_only=True, mmap=mmap_mode)
    assert_same(obj, toy_state(TOY_STEPS[-1]))


def test_safetensors_files_hold_the_tensors(toy):
    d = os.path.join(toy / TOY_MODEL, vdir(200))
    state = toy_state(200)
    with safe_open(os.path.join(d, "state.safetensors"), "pt") as f:
        assert f.metadata()["step"] == "200" and f.metadata()["model"] == TOY_MODEL
        assert_same(f.get_tensor("model.big"), state["model"]["big"])
        assert_same(f.get_tensor("optim.state.0.exp_avg"), state["optim"]["state"][0]["exp_avg"])
        assert len(list(f.keys())) == 6
    model = load_file(os.path.join(d, "model.safetensors"))
    assert set(model) == set(state["model"])
    for k, t in state["model"].items():
        assert_same(model[k], t)


def test_zip_tools_accept_checkpoint_pt(toy):
    path = os.path.join(toy / TOY_MODEL, "latest", "checkpoint.pt")
    r = subprocess.run([sys.executable, "-m", "zipfile", "-t", path], capture_output=True, text=True)
    assert r.returncode == 0 and "Done testing" in r.stdout, r.stdout + r.stderr
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None
    if shutil.which("unzip"):
        assert subprocess.run(["unzip", "-tq", path], capture_output=True).returncode == 0


def test_cp_is_byte_identical_to_export(toy, tmp_path):
    d = os.path.join(toy / TOY_MODEL, vdir(300))
    for name in os.listdir(d):
        copied, exported = tmp_path / f"cp-{name}", tmp_path / f"export-{name}"
        subprocess.run(["cp", os.path.join(d, name), str(copied)], check=True)
        with pytest.raises(SystemExit) as e:
            cli_main(["export", "--region", toy.region, "--step", "300", "--file", name, TOY_MODEL, str(exported)])
        assert e.value.code == 0
        assert copied.read_bytes() == exported.read_bytes(), name


def test_mmap_and_reads_at_odd_offsets_agree(toy):
    path = os.path.join(toy / TOY_MODEL, vdir(100), "state.safetensors")
    with open(path, "rb") as f:
        whole = f.read()
        with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
            assert m[:] == whole
        for off, n in [(0, 1), (7, 4096), (131071, 3), (len(whole) - 5, 100), (len(whole), 10)]:
            assert os.pread(f.fileno(), n, off) == whole[off:off + n]


# ------------------------------------------------------------------------------ a changing region


def test_new_versions_and_latest_show_within_a_second(toy, store):
    model_dir = toy / "live"
    save_versions(store, "live", [1])
    took = wait_for(lambda: os.path.exists(os.path.join(model_dir, vdir(1))), what="live/step-00000001")
    assert took < APPEAR_S
    assert os.readlink(os.path.join(model_dir, "latest")) == vdir(1)
    save_versions(store, "live", [2])
    took = wait_for(lambda: os.readlink(os.path.join(model_dir, "latest")) == vdir(2), what="latest -> step 2")
    assert took < APPEAR_S
    assert torch.load(os.path.join(model_dir, "latest", "checkpoint.pt"), weights_only=True)["step"] == 2


def test_a_process_holding_a_file_of_latest_is_given_that_version_again(toy, store):
    """One torch.load(mmap=True) of latest/checkpoint.pt walks the path twice (the zip reader's
    open, then UntypedStorage.from_file): a save committed between the two mixed the older
    version's index with the newer's tensors. A process holding a file of the version latest
    gave it, opened in the last second, is given it again; any other process, the newest, and so
    is this one once its file is older (a server keeping the weights it loaded long ago mapped)."""
    model_dir = toy / "holding"
    link = os.path.join(model_dir, "latest")
    save_versions(store, "holding", [1])
    wait_for(lambda: os.path.exists(os.path.join(model_dir, vdir(1))), what="holding/step-00000001")
    elsewhere = [sys.executable, "-c", f"import os; print(os.readlink({link!r}))"]
    with store.writer("holding") as w, open(os.path.join(link, "checkpoint.pt"), "rb"):
        w.save({"x": torch.full((1000,), 2.0), "step": 2}, 2).result()
        assert os.readlink(link) == vdir(1)
        obj = torch.load(os.path.join(link, "checkpoint.pt"), weights_only=True, mmap=True)
        assert obj["step"] == 1 and torch.equal(obj["x"], torch.full((1000,), 1.0))
        assert subprocess.run(elsewhere, capture_output=True, text=True).stdout.strip() == vdir(2)
        time.sleep(1.1)  # ops.LATEST_OPENED_S: the files held are no longer fresh
        assert os.readlink(link) == vdir(2)
        del obj


def test_version_whose_slot_is_reused_disappears(toy, store):
    model_dir = toy / "ring"
    save_versions(store, "ring", [1, 2], max_inflight=1, slots=2)
    wait_for(lambda: listing(model_dir) == ["latest", vdir(1), vdir(2)], what="ring steps 1, 2")
    ino = os.stat(os.path.join(model_dir, vdir(2), "checkpoint.pt")).st_ino
    save_versions(store, "ring", [3], max_inflight=1, slots=2)  # two slots: step 1's is reused
    took = wait_for(lambda: listing(model_dir) == ["latest", vdir(2), vdir(3)], what="step 1 gone")
    assert took < APPEAR_S
    # A direct stat may be answered from the kernel's entry cache for one more TTL (0.5 s).
    took = wait_for(lambda: not os.path.exists(os.path.join(model_dir, vdir(1))), what="stat ENOENT")
    assert took < APPEAR_S
    assert oserror(os.stat, os.path.join(model_dir, vdir(1), "checkpoint.pt")) == errno.ENOENT
    assert os.stat(os.path.join(model_dir, vdir(2), "checkpoint.pt")).st_ino == ino


def test_an_open_of_a_latest_being_committed_waits_without_stalling_the_mount(toy, store):
    """A latest still held by its save's commit (its barrier on a slow disk) is waited for by
    an open of its file, up to a second, on the mount's event loop: the mount's other requests
    are answered meanwhile (the wait blocked the loop, so every reader of the mount stalled)."""
    from test_concurrency import _held

    save_versions(store, "held", [1, 2])
    path = os.path.join(toy / "held", vdir(2), "checkpoint.pt")
    wait_for(lambda: os.path.exists(path), what="held/step-00000002")
    claims = _held(store, store.region.latest(store.region.get("held")))
    opened = []
    opener = threading.Thread(target=lambda: opened.append(torch.load(path, weights_only=True)["step"]))
    try:
        opener.start()
        time.sleep(0.1)
        t0 = time.monotonic()
        for step in (1, 2):  # another open, the listing, a read of another version: answered
            with open(os.path.join(toy / TOY_MODEL, vdir(TOY_STEPS[0]), "metadata.json"), "rb") as f:
                assert f.read()
            assert vdir(1) in os.listdir(toy / "held")
        assert time.monotonic() - t0 < 0.3 and opener.is_alive() and not opened
    finally:
        time.sleep(0.2)
        claims.close()
    opener.join(5)
    assert opened == [2]


def test_a_step_saved_again_shows_its_new_files_within_a_second(toy, store):
    """A job rolled back saves a step the mount shows already: a path to one of its files leads
    to the new save's file within a second. The version directory kept its inode, so the
    kernel's cached names of the old files (5 s) led to the old, gone, inodes: ENOENT for 5 s."""
    model_dir = toy / "again"
    save_versions(store, "again", [1, 2])
    path = os.path.join(model_dir, vdir(2), "checkpoint.pt")
    wait_for(lambda: os.path.exists(path), what="again/step-00000002")
    old = os.stat(path).st_ino
    assert torch.load(path, weights_only=True)["x"][0] == 2
    with store.writer("again") as w:
        w.save({"x": torch.full((1000,), 22.0), "step": 2}, 2).result()

    def new_bytes() -> bool:
        try:
            return torch.load(path, weights_only=True)["x"][0] == 22
        except FileNotFoundError:  # the old directory's cached entry, for up to LISTING_TTL
            return False
    assert wait_for(new_bytes, what="the new step 2") < APPEAR_S
    assert os.stat(path).st_ino != old
    assert listing(model_dir) == ["latest", vdir(1), vdir(2)]


@pytest.mark.parametrize("spelling", [["--allow-other", "-o", "rw"], ["-o", "allow_other,rw"]])
def test_other_users_may_read_an_allow_other_mount_but_not_remove(tmp_path, spelling):
    """allow_other given as an -o option (fstab's spelling, the mount helper's) went to libfuse
    without default_permissions, and any local user could rm -r the owner's versions."""
    import tempfile

    top = tempfile.mkdtemp(prefix="ckptfs-allow-other-")  # not under pytest's 0700 tmp: others must reach it
    try:
        os.chmod(top, 0o755)
        region = str(tmp_path / "r.region")
        make_toy_region(region)
        with mounted(region, os.path.join(top, "mnt"), *spelling) as m:
            nobody = 65534
            step = os.path.join(m.path, TOY_MODEL, vdir(TOY_STEPS[0]))
            r = subprocess.run(["cat", os.path.join(step, "metadata.json")], user=nobody, capture_output=True)
            assert r.returncode == 0 and r.stdout.startswith(b"{"), r.stderr
            r = subprocess.run(["rm", "-r", step], user=nobody, capture_output=True, text=True)
            assert r.returncode != 0 and "Permission denied" in r.stderr, r.stderr
            assert os.path.isdir(step)
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_rm_r_removes_a_version_but_not_latest_or_pinned(toy, store):
    model_dir = toy / "rmme"
    save_versions(store, "rmme", [1, 2, 3])
    wait_for(lambda: os.path.exists(os.path.join(model_dir, vdir(3))), what="rmme step 3")
    r = subprocess.run(["rm", "-r", os.path.join(model_dir, vdir(1))], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert vdir(1) not in os.listdir(model_dir)
    assert [v.step for v in store.versions("rmme")] == [2, 3]

    r = subprocess.run(["rm", "-r", os.path.join(model_dir, vdir(3))], capture_output=True, text=True)
    assert r.returncode != 0 and "Device or resource busy" in r.stderr
    assert [v.step for v in store.versions("rmme")] == [2, 3]

    with open(os.path.join(model_dir, vdir(2), "metadata.json"), "rb"):
        assert oserror(os.rmdir, os.path.join(model_dir, vdir(2))) == errno.EBUSY
        # the mount's daemon holds the pin for its reader, under its own name
        (pinned,) = [p for m in store.status()["models"] if m["name"] == "rmme" for p in m["pinned"]]
        assert pinned["step"] == 2 and [cmd for _, cmd in pinned["holders"]] == ["ckptfs-mount"]
    assert [v.step for v in store.versions("rmme")] == [2, 3]
    # Right after close(2): the kernel's RELEASE may still be in flight; rmdir waits for it.
    os.rmdir(os.path.join(model_dir, vdir(2)))
    assert [v.step for v in store.versions("rmme")] == [3]

    # a subdirectory of a version alone (hf/ of a version saved with a config.json) is not
    # removed, and is not said to be: rmdir and rm -r of it succeeded and removed nothing
    with store.writer("rmme") as w:
        for step in (4, 5):
            w.save({"model": {"w": torch.ones(3)}}, step, extra={"config.json": {"model_type": "gpt2"}}).result()
    hf = os.path.join(model_dir, vdir(4), "hf")
    wait_for(lambda: os.path.isdir(hf), what="step 4's hf/")
    assert oserror(os.rmdir, hf) == errno.EPERM
    r = subprocess.run(["rm", "-r", hf], capture_output=True, text=True)
    assert r.returncode != 0 and "Operation not permitted" in r.stderr
    assert "config.json" in os.listdir(hf) and [v.step for v in store.versions("rmme")] == [3, 4, 5]
    r = subprocess.run(["rm", "-r", os.path.join(model_dir, vdir(4))], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr  # the whole version, its hf/ included
    assert [v.step for v in store.versions("rmme")] == [3, 5]


def test_status_names_the_processes_reading_behind_the_mount(toy, store, tmp_path):
    """The mount's daemon holds the pins of every file open in it: status names, behind it, the
    process holding a file open by step and the one whose torch.load(mmap=True) result maps a
    file opened through latest (its file long closed)."""
    save_versions(store, "readers", [1, 2])
    wait_for(lambda: os.path.exists(os.path.join(toy / "readers", vdir(2))), what="readers step 2")
    code = ("import sys, time, torch\n"
            "if sys.argv[1] == 'open':\n    f = open(sys.argv[2], 'rb'); f.read(1)\n"
            "else:\n    x = torch.load(sys.argv[2], mmap=True, weights_only=True)\n"
            "print('ready', flush=True); sys.stdin.read()\n")
    readers = [subprocess.Popen([sys.executable, "-c", code, how, toy / path], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
               for how, path in (("open", f"readers/{vdir(1)}/metadata.json"), ("mmap", "readers/latest/checkpoint.pt"))]
    try:
        for p in readers:
            assert p.stdout.readline() == "ready\n"
        pinned = {p["step"]: p for m in store.status()["models"] if m["name"] == "readers" for p in m["pinned"]}
        assert [pid for pid, _ in pinned[1]["readers"]] == [readers[0].pid]
        assert [pid for pid, _ in pinned[2]["readers"]] == [readers[1].pid]
        out = subprocess.run([sys.executable, "-m", "ckptfs.cli", "status", "--region", store.path],
                             capture_output=True, text=True, check=True).stdout
        assert f"(ckptfs-mount) for {readers[0].pid} (python" in out, out
    finally:
        for p in readers:
            p.communicate("", timeout=30)


def test_a_version_held_by_its_commit_stalls_no_other_request(toy, store):
    """A lookup of a version whose slot a commit holds (its barrier on a slow disk) waited on
    the mount's one event loop, and every other request of the mount, every model's, waited
    with it (p99 of unrelated reads 27 -> 305 ms with a 300 ms flush)."""
    import fcntl

    from ckptfs.region.locks import _FLOCK, slot_lock_offset

    save_versions(store, "held", [1, 2])
    wait_for(lambda: os.path.exists(os.path.join(toy / "held", vdir(2))), what="held step 2")
    v, _ = store._find("held", 1)
    fd = os.open(store.path, os.O_RDWR)
    try:  # as a claim or a commit's barrier holds it: exclusively, from another description
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET,
                                                       slot_lock_offset(v.entry.index, v.slot), 1, 0))
        waiting = threading.Thread(target=lambda: oserror(os.stat, os.path.join(toy / "held", vdir(1), "metadata.json")))
        waiting.start()
        time.sleep(0.1)
        other = os.path.join(toy / TOY_MODEL, vdir(TOY_STEPS[0]), "metadata.json")
        slowest = 0.0
        while waiting.is_alive():
            started = time.monotonic()
            with open(other, "rb") as f:  # an open always reaches the daemon
                f.read(1)
            slowest = max(slowest, time.monotonic() - started)
            time.sleep(0.01)
        assert slowest < 0.5, slowest
    finally:
        os.close(fd)
        waiting.join()


def test_df_shows_the_regions_space_and_no_inode_limit(toy, store):
    st = os.statvfs(toy.path)
    assert st.f_blocks * st.f_frsize == store.region.superblock.region_bytes // 4096 * 4096
    assert (st.f_files, st.f_ffree) == (0, 0)  # inodes used with none free alarmed every host's monitoring
    out = subprocess.run(["df", "-i", toy.path], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[1].split()[4] == "-", out


def test_rm_rf_of_a_model_leaves_its_milestones_and_latest(toy, store):
    """`rm -rf` of a model's directory through a -o rw mount took every kept milestone with it."""
    save_versions(store, "milestones", [1, 2, 3, 4, 5], keep_every=2, slots=8)
    wait_for(lambda: os.path.exists(os.path.join(toy / "milestones", vdir(5))), what="milestones step 5")
    r = subprocess.run(["rm", "-rf", toy / "milestones"], capture_output=True, text=True)
    assert r.returncode != 0 and "Operation not permitted" in r.stderr, r.stderr
    assert [(v.step, v.kept) for v in store.versions("milestones")] == [(2, True), (4, True), (5, False)]
    store.unkeep("milestones", 2)
    wait_for(lambda: subprocess.run(["rm", "-r", os.path.join(toy / "milestones", vdir(2))]).returncode == 0,
             what="step 2 removable once unkept")
    assert [v.step for v in store.versions("milestones")] == [4, 5]
    # kept a moment before its rm -r (the mount's listing, up to 0.5 s old, said not kept): kept
    save_versions(store, "milestones", [6], slots=8)
    wait_for(lambda: os.path.exists(os.path.join(toy / "milestones", vdir(6))), what="milestones step 6")
    store.keep("milestones", 5)
    r = subprocess.run(["rm", "-r", os.path.join(toy / "milestones", vdir(5))], capture_output=True, text=True)
    assert r.returncode != 0 and "Operation not permitted" in r.stderr, r.stderr
    assert [(v.step, v.kept) for v in store.versions("milestones")] == [(4, True), (5, True), (6, False)]


def test_errno_of_everything_else(toy):
    m = toy / TOY_MODEL
    latest_dir = os.path.join(m, vdir(TOY_STEPS[-1]))
    old_dir = os.path.join(m, vdir(TOY_STEPS[0]))
    f = os.path.join(old_dir, "checkpoint.pt")

    for flags in (os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_TRUNC, os.O_WRONLY | os.O_APPEND):
        assert oserror(os.open, f, flags) == errno.EROFS
    assert oserror(os.open, os.path.join(old_dir, "new"), os.O_WRONLY | os.O_CREAT) == errno.EROFS
    assert oserror(os.mkdir, os.path.join(m, "new")) == errno.EROFS
    assert oserror(os.mkdir, os.path.join(toy.path, "newmodel")) == errno.EROFS
    assert oserror(os.rename, f, os.path.join(old_dir, "x.pt")) == errno.EROFS
    assert oserror(os.symlink, "x", os.path.join(m, "link")) == errno.EROFS
    assert oserror(os.link, f, os.path.join(old_dir, "hard")) == errno.EROFS
    assert oserror(os.chmod, f, 0o644) == errno.EROFS
    assert oserror(os.utime, f) == errno.EROFS
    assert oserror(os.truncate, f, 0) == errno.EROFS
    assert oserror(os.setxattr, f, "user.x", b"1") == errno.EROFS
    assert oserror(os.unlink, os.path.join(m, "latest")) == errno.EROFS
    assert oserror(os.rmdir, m) == errno.EROFS  # a whole model: `ckptfs rm MODEL --all`

    for missing in ("nomodel", f"{TOY_MODEL}/step-00000999", f"{TOY_MODEL}/step-100",
                    f"{TOY_MODEL}/{vdir(100)}/nofile.pt", f"{TOY_MODEL}/{vdir(100)}/CHECKPOINT.PT"):
        assert oserror(os.stat, os.path.join(toy.path, missing)) == errno.ENOENT
    assert oserror(os.rmdir, os.path.join(m, vdir(999))) == errno.ENOENT
    assert oserror(open, os.path.join(old_dir, "nofile"), "rb") == errno.ENOENT

    assert oserror(os.stat, f + "/x") == errno.ENOTDIR
    assert oserror(os.listdir, f) == errno.ENOTDIR
    assert oserror(os.rmdir, f) == errno.ENOTDIR
    assert oserror(os.rmdir, os.path.join(m, "latest")) == errno.ENOTDIR

    assert oserror(os.unlink, old_dir) == errno.EISDIR
    assert oserror(os.open, old_dir, os.O_WRONLY) == errno.EISDIR
    fd = os.open(old_dir, os.O_RDONLY)
    try:
        assert oserror(os.read, fd, 10) == errno.EISDIR
    finally:
        os.close(fd)

    assert oserror(os.unlink, os.path.join(latest_dir, "checkpoint.pt")) == errno.EBUSY
    # A file alone cannot go: a version is removed whole (`rm file` must not say it removed it)
    assert oserror(os.unlink, f) == errno.EPERM
    r = subprocess.run(["rm", f], capture_output=True, text=True)
    assert r.returncode != 0 and "Operation not permitted" in r.stderr and os.path.exists(f)
    # ... but inside a version whose directory is open, as `rm -r` holds it, it is accepted
    # (and changes nothing until the version's rmdir)
    fd = os.open(old_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.listdir(fd)
        os.unlink(f)
    finally:
        os.close(fd)
    assert os.path.exists(f)
    # ... by the process that has it open only: with an `ls` or an rsync walking the version
    # elsewhere, `rm file` said nothing and exited 0, the file still there
    walker = subprocess.Popen([sys.executable, "-c", "import os, sys; fd = os.open(sys.argv[1], os.O_RDONLY | "
                               "os.O_DIRECTORY); os.listdir(fd); print('ready', flush=True); sys.stdin.read()",
                               old_dir], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert walker.stdout.readline() == "ready\n"
        r = subprocess.run(["rm", f], capture_output=True, text=True)
        assert r.returncode != 0 and "Operation not permitted" in r.stderr and os.path.exists(f)
    finally:
        walker.communicate("", timeout=30)
    # ... and from any thread of the process that has it open (a request names its thread)
    fd = os.open(old_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.listdir(fd)
        failed = []

        def unlink() -> None:
            try:
                os.unlink(f)
            except OSError as e:
                failed.append(e)

        other = threading.Thread(target=unlink)
        other.start()
        other.join()
        assert failed == [], failed
    finally:
        os.close(fd)
    assert os.listdir(m) == ["latest"] + [vdir(s) for s in TOY_STEPS]


def test_a_mount_is_read_only_unless_mounted_rw(tmp_path):
    from ckptfs.fs.daemon import mount_entry

    region = str(tmp_path / "toy.region")
    make_toy_region(region)
    with mounted(region, str(tmp_path / "mnt")) as m:
        options = next(line.split()[3] for line in open("/proc/mounts") if line.split()[1] == m.path)
        assert options.split(",")[0] == "ro" and mount_entry(m.path)[0] == "fuse.ckptfs"
        old = os.path.join(m.path, TOY_MODEL, vdir(TOY_STEPS[0]))
        for cmd in (["rm", os.path.join(old, "checkpoint.pt")], ["rm", "-r", old]):
            r = subprocess.run(cmd, capture_output=True, text=True)
            assert r.returncode != 0 and "Read-only file system" in r.stderr, r.stderr
        assert os.path.exists(os.path.join(old, "checkpoint.pt"))
    with ckptfs.Store(region) as s:
        assert [v.step for v in s.versions(TOY_MODEL)] == list(TOY_STEPS)


# ------------------------------------------------------------------------------ copies during training

WRITER_SCRIPT = r"""
import sys, time, torch, ckptfs
region, seconds = sys.argv[1], float(sys.argv[2])
store = ckptfs.Store(region)
n = 0
with store.writer("train", max_inflight=1, slots=2) as w:  # the next save reuses latest's predecessor
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        n += 1
        w.save({"w": torch.full((1 << 20,), float(n)), "v": torch.arange(1 << 18, dtype=torch.float64) + n,
                "step": n}, n)
        time.sleep(0.1)  # the rest of the iteration; versions live about as long as a slow copy
print(n)
"""


def consistent(obj) -> bool:
    """Every tensor of a ``train`` checkpoint is what the writer saved at obj['step']."""
    n = obj["step"]
    return bool((obj["w"] == float(n)).all()) and torch.equal(obj["v"], torch.arange(1 << 18, dtype=torch.float64) + n)


def slow_copy(src: str, dst) -> bool:
    """Copy in 64 KiB reads with a pause between them and no readahead (each read reaches the
    daemon when it is made), so that one copy spans several saves. False if ``src`` could not
    be opened (the version it named is gone); any error after the open fails the test."""
    try:
        f = open(src, "rb", buffering=0)
    except FileNotFoundError:
        return False
    with f, open(dst, "wb") as out:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        while chunk := f.read(64 << 10):
            out.write(chunk)
            time.sleep(0.003)
    return True


@pytest.mark.slow
def test_copies_taken_while_training_are_exact(toy, tmp_path):
    """A writer checkpoints every iteration into a ring of two slots; every copy of
    latest/checkpoint.pt and of latest/state.safetensors made meanwhile is one whole checkpoint:
    the open pins the version, so the writer waits instead of reusing its slot. (Without the pin
    the next save but one overwrites the slot being copied, and this test fails.)"""
    writer = subprocess.Popen([sys.executable, "-c", WRITER_SCRIPT, toy.region, "5"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    latest = os.path.join(toy / "train", "latest")
    copies, steps_seen = 0, set()
    try:
        wait_for(lambda: os.path.exists(os.path.join(latest, "checkpoint.pt")), timeout=60, what="first checkpoint")
        while writer.poll() is None:
            if slow_copy(os.path.join(latest, "checkpoint.pt"), tmp_path / "copy.pt"):
                obj = torch.load(tmp_path / "copy.pt", weights_only=True)
                assert consistent(obj), f"torn copy of checkpoint.pt, step {obj['step']}"
                copies += 1
                steps_seen.add(obj["step"])
            if slow_copy(os.path.join(latest, "state.safetensors"), tmp_path / "copy.safetensors"):
                st = load_file(str(tmp_path / "copy.safetensors"))
                step = float(st["w"][0])
                assert bool((st["w"] == step).all()) and torch.equal(
                    st["v"], torch.arange(1 << 18, dtype=torch.float64) + step), "torn copy of state.safetensors"
                copies += 1
                steps_seen.add(int(step))
    finally:
        out, err = writer.communicate(timeout=120)
    assert writer.returncode == 0, err
    saved = int(out.strip())
    assert copies >= 4 and len(steps_seen) >= 2, (copies, steps_seen, saved)
    assert saved > len(steps_seen) + 3  # the writer kept going while we copied


# ------------------------------------------------------------------------------ the daemon's life


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_signal_unmounts_cleanly(toy, tmp_path, signame):
    from ckptfs.fs.daemon import mount_entry
    from conftest_mount import start_mount, stop_mount

    m = start_mount(toy.region, str(tmp_path / "mnt"))
    try:
        f = open(os.path.join(m.path, TOY_MODEL, "latest", "metadata.json"), "rb")  # a pin held
        t0 = time.monotonic()
        m.proc.send_signal(getattr(signal, signame))
        assert m.proc.wait(30) == 0, m.log()
        assert time.monotonic() - t0 < 10
        assert mount_entry(m.path) is None  # detached even though a file was still open
        with pytest.raises(OSError):  # that file's connection is gone (ENOTCONN on flush)
            f.close()
    finally:
        stop_mount(m)


@pytest.mark.parametrize("after_s", [0.0, 0.01, 0.05])
def test_killed_daemon_leaves_no_mount(toy, tmp_path, after_s):
    """A daemon SIGKILLed as soon as its mount is up (while it still checks that its root
    answers), or a moment later, dies and leaves no mount. A thread of the daemon that stat'ed
    its own root made it unkillable when the kill came while the daemon held that request:
    only the daemon could answer it, and its /dev/fuse stayed open until that thread ended (a CI
    run hung there)."""
    from ckptfs.fs.daemon import mount_entry
    from conftest_mount import start_mount, stop_mount

    m = start_mount(toy.region, str(tmp_path / "mnt"))
    try:
        time.sleep(after_s)
        m.proc.kill()
        m.proc.wait(20)
        wait_for(lambda: mount_entry(m.path) is None, timeout=10, what="auto_unmount after SIGKILL")
    finally:
        stop_mount(m)
