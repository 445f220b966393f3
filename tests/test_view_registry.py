"""Views as a registry: a new format is one module and one registration; its files (and
subdirectories) show in the mount, in ``files_for`` and in ``export``; ``-o views=`` selects."""
import errno
import json
import os
import subprocess
import sys

import pytest
import torch

import ckptfs
from ckptfs.fs.nodes import Kind
from ckptfs.fs.tree import ROOT_INODE, Tree
from ckptfs.views import files_for, register, registered_views
from conftest_mount import mounted, requires_fuse

# The extra view of these tests, as a module would register it. The mount daemon is another
# process: it runs this text before the CLI.
EXTRA_VIEW = '''
import json
from ckptfs.views import Extent, Literal, View, register

def extra_files(manifest):
    first = manifest.tensors[0]
    return {"extra/info.json": View([Literal(json.dumps({"model": manifest.model, "step": manifest.step}).encode())]),
            "extra/deep/first.bin": View([Extent(first.offset, first.nbytes)]),
            "checkpoint.pt": View([Literal(b"a path another view gave first")]),
            "checkpoint.pt/x": View([Literal(b"under a file: left out")])}

unregister_extra = register("extra", extra_files, summary="test view with subdirectories")
'''
DAEMON = [sys.executable, "-c", EXTRA_VIEW + "import sys\nfrom ckptfs.cli import main\nmain(sys.argv[1:])\n"]


@pytest.fixture
def extra_view():
    scope: dict = {}
    exec(EXTRA_VIEW, scope)
    yield
    scope["unregister_extra"]()


@pytest.fixture
def store(tmp_path):
    with ckptfs.Store.create(str(tmp_path / "r.region"), size_bytes=64 << 20) as s:
        with s.writer("m") as w:
            for step in (1, 2):
                w.save({"model": {"w": torch.arange(8.0) + step}}, step=step).result()
        yield s


def test_the_builtin_views_are_registered_in_listing_order():
    assert [v.view_id for v in registered_views()] == ["torch", "safetensors", "metadata", "files", "hf"]


def test_files_for_selects_views_and_the_first_registration_wins(store, extra_view):
    with store.open_version("m", 1) as v:
        everything = files_for(v.manifest)
        assert list(everything) == ["checkpoint.pt", "state.safetensors", "model.safetensors", "metadata.json",
                                    "extra/info.json", "extra/deep/first.bin"]
        assert everything["checkpoint.pt"].size > 100  # the torch view's, not the extra view's
        # without the torch view, the extra view's checkpoint.pt is the one shown
        assert list(files_for(v.manifest, ["metadata", "extra"])) == [
            "metadata.json", "extra/info.json", "extra/deep/first.bin", "checkpoint.pt"]
        assert list(files_for(v.manifest, ["extra"]))[:1] == ["extra/info.json"]
        with pytest.raises(ValueError, match="unknown view.*bogus.*torch, safetensors, metadata, files, hf, extra"):
            files_for(v.manifest, ["bogus"])
    with pytest.raises(ValueError, match="already registered"):
        register("torch", lambda m: {}, summary="again")


def test_unregister_removes_the_view(store):
    scope: dict = {}
    exec(EXTRA_VIEW, scope)
    scope["unregister_extra"]()
    with store.open_version("m", 1) as v:
        assert not any(p.startswith("extra/") for p in files_for(v.manifest))


def test_subdirectories_in_the_tree(store, extra_view):
    tree = Tree(store)
    try:
        version = tree.lookup(tree.lookup(ROOT_INODE, "m").ino, "step-00000001")
        names = [n for n, _ in tree.children(version.ino)]
        assert names == ["checkpoint.pt", "state.safetensors", "model.safetensors", "metadata.json", "extra"]
        extra = tree.lookup(version.ino, "extra")
        assert extra.kind is Kind.SUBDIR and extra.is_dir and tree.attr(extra).mode & 0o040000
        assert [n for n, _ in tree.children(extra.ino)] == ["info.json", "deep"]
        deep = tree.lookup(extra.ino, "deep")
        first = tree.lookup(deep.ino, "first.bin")
        assert tree.lookup(extra.ino, "deep") is deep  # stable inodes
        f = tree.open(first, os.O_RDONLY)
        try:
            assert f.read(0, f.size) == (torch.arange(8.0) + 1).numpy().tobytes()
        finally:
            f.close()
        info = tree.open(tree.lookup(extra.ino, "info.json"), os.O_RDONLY)
        assert json.loads(info.read(0, info.size)) == {"model": "m", "step": 1}
        info.close()
        with pytest.raises(IsADirectoryError):
            tree.open(deep, os.O_RDONLY)
        with pytest.raises(FileNotFoundError):
            tree.lookup(extra.ino, "nothing")
        # rm -r of a non-latest version: files and subdirectories are no-ops, the version goes last
        tree.check_unlink(deep.ino, "first.bin", walking=True)
        assert tree.version_to_remove(extra.ino, "deep", walking=True) is None
        assert tree.version_to_remove(version.ino, "extra", walking=True) is None
        # alone (`rmdir step-N/extra`): refused, not a success that removed nothing
        with pytest.raises(PermissionError, match="a version is removed whole"):
            tree.version_to_remove(version.ino, "extra", walking=False)
        # inside the latest version: EBUSY, so that rm -r stops before the version
        latest = tree.lookup(tree.lookup(ROOT_INODE, "m").ino, "step-00000002")
        with pytest.raises(OSError) as busy:
            tree.version_to_remove(latest.ino, "extra", walking=True)
        assert busy.value.errno == errno.EBUSY
    finally:
        tree.close()


def test_a_mount_selects_views_and_a_commit_refreshes_its_listing(store, extra_view):
    tree = Tree(store, views=["metadata", "extra"], refresh_interval=3600)
    try:
        model = tree.lookup(ROOT_INODE, "m")
        version = tree.lookup(model.ino, "step-00000001")
        assert [n for n, _ in tree.children(version.ino)] == ["metadata.json", "extra", "checkpoint.pt"]
        with store.writer("m") as w:
            w.save({"model": {"w": torch.zeros(8)}}, step=3).result()
        # the listing is an hour old by its interval, but this process's commit made it stale
        assert "step-00000003" in [n for n, _ in tree.children(model.ino)]
    finally:
        tree.close()
    with pytest.raises(ValueError, match="unknown view"):
        Tree(store, views=["nope"])


@pytest.mark.fuse
@requires_fuse
def test_a_registered_view_with_subdirectories_through_a_real_mount(store, tmp_path):
    mnt = str(tmp_path / "mnt")
    with mounted(store.path, mnt, "-o", "rw", cli=DAEMON) as m:
        old = m / "m/step-00000001"
        assert os.listdir(old) == ["checkpoint.pt", "state.safetensors", "model.safetensors", "metadata.json",
                                   "extra"]
        assert os.listdir(os.path.join(old, "extra")) == ["info.json", "deep"]
        path = os.path.join(old, "extra/deep/first.bin")
        assert os.stat(path).st_size == 32
        with open(path, "rb") as f:
            assert f.read() == (torch.arange(8.0) + 1).numpy().tobytes()
        with open(os.path.join(old, "extra/info.json")) as f:
            assert json.load(f) == {"model": "m", "step": 1}
        rm_latest = subprocess.run(["rm", "-r", m / "m/step-00000002"], capture_output=True, text=True)
        assert rm_latest.returncode != 0 and os.path.isdir(m / "m/step-00000002/extra")
        subprocess.run(["rm", "-r", old], check=True)
        assert os.listdir(m / "m") == ["latest", "step-00000002"]
    assert [v.step for v in store.versions("m")] == [2]


@pytest.mark.fuse
@requires_fuse
def test_mount_option_views_selects_files(store, tmp_path):
    mnt = str(tmp_path / "mnt")
    with mounted(store.path, mnt, "-o", "views=torch+extra", cli=DAEMON) as m:
        assert os.listdir(m / "m/latest") == ["checkpoint.pt", "extra"]
        assert torch.load(m / "m/latest/checkpoint.pt", weights_only=True)["model"]["w"][0] == 2.0


def test_mount_option_views_refuses_an_unknown_id(tmp_path, capsys):
    from ckptfs.cli import main

    with pytest.raises(SystemExit) as e:
        main(["mount", "-o", "views=torch:bogus", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "-o views=torch:bogus" in err and "bogus" in err and "torch, safetensors, metadata" in err


def test_mount_help_names_every_view():
    """`ckptfs mount --help` lists each view id a mount accepts (it named three of five)."""
    from click.testing import CliRunner

    from ckptfs.cli import cli
    from ckptfs.views import registered_views

    text = " ".join(CliRunner().invoke(cli, ["mount", "--help"], prog_name="ckptfs").output.split())
    views = text[text.index("Views ("):]
    assert all(f" {spec.view_id} (" in views for spec in registered_views()), views
