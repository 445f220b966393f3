"""The ``ckptfs`` command: every subcommand, its errors (one line, non-zero, no traceback), and
imports of malformed or hostile files, which must leave the region untouched."""
import errno
import functools
import hashlib
import json
import os
import pickle
import struct
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save as st_save, save_file

import ckptfs
from ckptfs.errors import CorruptionError
from ckptfs.cli import main as cli_main
from conftest import assert_same
from conftest_mount import (CLI, TOY_MODEL, TOY_STEPS, force_unmount, make_toy_region, requires_fuse,
                            toy_state)

SUBCOMMANDS = ["mkfs", "mount", "umount", "ls", "info", "verify", "export", "import", "rm", "keep", "unkeep", "status",
               "upgrade"]


def run(capsys, *args):
    """Run the CLI in this process: (exit status, stdout, stderr)."""
    with pytest.raises(SystemExit) as e:
        cli_main([str(a) for a in args])
    out, err = capsys.readouterr()
    return e.value.code, out, err


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptfs: error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture(scope="module")
def toy_region(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("cli") / "toy.region")
    make_toy_region(path)
    return path


@pytest.fixture
def fresh_region(tmp_path):
    path = str(tmp_path / "fresh.region")
    make_toy_region(path)
    return path


def region_state(path: str):
    """What a malformed import must not change: every allocated byte range and its contents,
    the file's size and allocated blocks."""
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        off = 0
        while True:
            try:
                data = os.lseek(fd, off, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:
                    break
                raise
            hole = os.lseek(fd, data, os.SEEK_HOLE)
            h.update(f"{data}-{hole};".encode())
            pos = data
            while pos < hole:
                chunk = os.pread(fd, min(8 << 20, hole - pos), pos)
                h.update(chunk)
                pos += len(chunk)
            off = hole
    finally:
        os.close(fd)
    return h.hexdigest(), st.st_size, st.st_blocks


# ------------------------------------------------------------------------------ help and errors


@pytest.mark.parametrize("cmd", [[]] + [[c] for c in SUBCOMMANDS])
def test_help_everywhere(capsys, cmd):
    code, out, err = run(capsys, *cmd, "--help")
    assert code == 0 and "Usage:" in out
    if cmd:
        assert "--region" in out


@pytest.mark.slow
def test_errors_are_one_line_from_the_real_entry_point(tmp_path):
    r = subprocess.run(CLI + ["ls", "--region", str(tmp_path / "missing.region")], capture_output=True, text=True)
    assert r.returncode == 1
    line = one_error_line(r.stderr)
    assert "no region yet at" in line and "ckptfs mkfs" in line
    r = subprocess.run(CLI + ["frobnicate"], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0, "a usage error is one line"


def test_a_region_larger_than_the_address_space_limit_says_so(tmp_path):
    """A region is mapped whole: under `ulimit -v` smaller than it, every command said only
    "Cannot allocate memory"."""
    import resource

    path = tmp_path / "big.region"
    assert subprocess.run(CLI + ["mkfs", str(path), "--size", "16G"], capture_output=True).returncode == 0
    limit = functools.partial(resource.setrlimit, resource.RLIMIT_AS, (8 << 30, 8 << 30))
    r = subprocess.run(CLI + ["ls", "--region", str(path)], capture_output=True, text=True, preexec_fn=limit)
    assert r.returncode == 1 and one_error_line(r.stderr) == (
        f"ckptfs: error: cannot map {path} (16.0 GiB) into this process: its address space is limited (`ulimit "
        "-v`); ckptfs maps a region whole, which takes address space, not memory: raise the limit (`ulimit -v "
        "unlimited`)"), r.stderr


def test_unknown_model_and_step(capsys, toy_region):
    code, _, err = run(capsys, "info", "--region", toy_region, "nomodel")
    assert code == 1 and "nomodel" in one_error_line(err)
    code, _, err = run(capsys, "info", "--region", toy_region, "--step", "12345", TOY_MODEL)
    assert code == 1 and "12345" in one_error_line(err)
    code, _, err = run(capsys, "ls", "--region", toy_region, "bad/name")
    assert code == 1
    one_error_line(err)


# ------------------------------------------------------------------------------ commands


def test_mkfs(capsys, tmp_path):
    path = tmp_path / "new.region"
    code, out, _ = run(capsys, "mkfs", "--region", path, "--size", "128M")
    assert code == 0 and os.path.getsize(path) == 128 << 20
    code, _, err = run(capsys, "mkfs", path)
    assert code == 1 and "already" in one_error_line(err)
    assert run(capsys, "mkfs", path, "--exist-ok")[0] == 0
    code, _, err = run(capsys, "mkfs", tmp_path / "small.region", "--size", "1M")
    assert code == 1 and "too small" in one_error_line(err)
    code, _, err = run(capsys, "mkfs", tmp_path / "x.region", "--size", "lots")
    assert code == 2 and "Traceback" not in err
    # a character device or a pipe: said as such (/dev/null was "not a ckptfs region (it is
    # empty) ... `ckptfs mkfs NEW_PATH` makes one", to someone running mkfs)
    code, _, err = run(capsys, "mkfs", "/dev/null")
    assert code == 1 and one_error_line(err) == (
        "ckptfs: error: /dev/null is neither a file, a block device nor a devdax device (/dev/daxX.Y): a region "
        "cannot be made there; give a file path or such a device")


def test_a_path_that_is_not_a_region_is_said_so_without_sending_to_mkfs(capsys, tmp_path):
    """A read-only command given a file that is not a region (or a directory) said "format it with
    `ckptfs mkfs <that file>`", which leads to mkfs --force over it; a directory gave a bare
    "Is a directory"."""
    small = tmp_path / "notes.txt"
    small.write_text("hello")
    empty = tmp_path / "empty.region"
    empty.write_bytes(b"")
    for path, why in ((small, "5 bytes, too small to be one"), (empty, "it is empty"), (tmp_path, "a directory")):
        code, _, err = run(capsys, "ls", "--region", path)
        line = one_error_line(err)
        assert code == 1 and f"{path} is not a ckptfs region ({why}): give the path of a region" in line, line
        assert f"mkfs {path}" not in line


def test_a_region_larger_than_its_filesystem_allows_is_refused_in_one_line_and_leaves_nothing(capsys, tmp_path):
    """--size 100P said only "error: File too large" (a bare OSError from Store.create), and left
    the half-made file behind under a hidden name."""
    code, _, err = run(capsys, "mkfs", tmp_path / "r.region", "--size", "100P")
    assert code == 1 and "the filesystem allows no file this large; or give a smaller --size" in one_error_line(err)
    with pytest.raises(ckptfs.errors.RegionFormatError, match="pass a smaller size_bytes"):
        ckptfs.Store.create(str(tmp_path / "s.region"), size_bytes=100 << 50)
    assert os.listdir(tmp_path) == []


def test_mkfs_refuses_to_overwrite_unless_forced(capsys, tmp_path):
    precious = tmp_path / "model.pt"
    precious.write_bytes(b"weights" * 1000)
    code, _, err = run(capsys, "mkfs", precious, "--size", "64M")
    assert code == 1 and "not a ckptfs region" in one_error_line(err) and "--force" in err
    assert precious.read_bytes() == b"weights" * 1000
    code, _, err = run(capsys, "mkfs", precious, "--force", "--exist-ok")
    assert code == 2 and "contradict" in err
    assert run(capsys, "mkfs", precious, "--size", "64M", "--force")[0] == 0
    assert os.path.getsize(precious) == 64 << 20
    with ckptfs.Store(str(precious)) as store:
        assert store.models() == []


def test_ls_and_info(capsys, toy_region):
    code, out, _ = run(capsys, "ls", "--region", toy_region, "--json")
    assert code == 0
    assert json.loads(out) == [{"model": TOY_MODEL, "versions": 3, "latest_step": 300,
                                "latest_bytes": json.loads(out)[0]["latest_bytes"]}]
    code, out, _ = run(capsys, "ls", "--region", toy_region, TOY_MODEL, "--json")
    rows = json.loads(out)
    assert [r["step"] for r in rows] == list(TOY_STEPS) and [r["latest"] for r in rows] == [False, False, True]
    code, out, _ = run(capsys, "ls", "--region", toy_region, TOY_MODEL)
    assert code == 0 and "latest" in out and "300" in out

    code, out, _ = run(capsys, "info", "--region", toy_region, TOY_MODEL, "--step", "200", "--json")
    doc = json.loads(out)
    assert doc["step"] == 200 and not doc["latest"]
    by_name = {t["name"]: t for t in doc["tensors"]}
    assert by_name["model.big"]["shape"] == [256, 1024] and by_name["model.bias"]["dtype"] == "bfloat16"
    assert set(doc["files"]) >= {"checkpoint.pt", "state.safetensors", "model.safetensors", "metadata.json"}
    code, out, _ = run(capsys, "info", "--region", toy_region, TOY_MODEL)
    assert code == 0 and "step     300 (latest)" in out and "model.big" in out and "256x1024" in out


def test_status(capsys, toy_region):
    code, out, _ = run(capsys, "status", "--region", toy_region, "--json")
    st = json.loads(out)
    assert code == 0 and st["region_bytes"] == 256 << 20 and st["models"][0]["name"] == TOY_MODEL
    code, out, _ = run(capsys, "status", "--region", toy_region)
    assert code == 0 and "256.0 MiB" in out and TOY_MODEL in out and "no saves in flight" in out


def flip_a_tensor_byte(region: str, model: str, step: int, tensor: str) -> None:
    """Damage one byte inside ``tensor`` of a version, behind ckptfs's back."""
    with ckptfs.Store(region) as s:
        version = next(v for v in s.region.committed(s.region.get(model)) if v.header.step == step)
        rec = next(t for t in s.region.read_manifest(version).tensors if t.name == tensor)
        where = version.data_base + rec.offset + 1000
    fd = os.open(region, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, where)[0] ^ 0x40]), where)
        os.fsync(fd)
    finally:
        os.close(fd)


def test_verify_passes_then_catches_a_flipped_byte(capsys, fresh_region):
    code, out, _ = run(capsys, "verify", "--region", fresh_region)
    assert code == 0 and out.startswith("ok")
    flip_a_tensor_byte(fresh_region, TOY_MODEL, 200, "model.big")
    code, out, err = run(capsys, "verify", "--region", fresh_region, TOY_MODEL, "--step", "200")
    assert code == 1 and "model.big" in err and "checksum mismatch" in err
    assert run(capsys, "verify", "--region", fresh_region, TOY_MODEL, "--step", "300")[0] == 0
    assert run(capsys, "verify", "--region", fresh_region)[0] == 1


@pytest.mark.parametrize("output", ["x.pt", "x.safetensors", "model.safetensors"])
def test_export_of_a_damaged_version_fails_like_load_and_leaves_no_file(capsys, fresh_region, tmp_path, output):
    flip_a_tensor_byte(fresh_region, TOY_MODEL, 200, "model.big")
    with ckptfs.Store(fresh_region) as s, pytest.raises(CorruptionError) as loaded:
        s.load(TOY_MODEL, 200)
    args = ["--key", "model"] if output == "model.safetensors" else []
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    code, out, err = run(capsys, "export", "--region", fresh_region, "--step", "200", *args, TOY_MODEL,
                         out_dir / output)
    assert code != 0 and "model.big" in one_error_line(err) and str(loaded.value) in err
    assert os.listdir(out_dir) == [], "a damaged export left a file behind"
    # the intact neighbour still exports
    assert run(capsys, "export", "--region", fresh_region, "--step", "300", *args, TOY_MODEL, out_dir / output)[0] == 0


def test_export(capsys, toy_region, tmp_path):
    out_pt = tmp_path / "x.pt"
    code, out, _ = run(capsys, "export", "--region", toy_region, TOY_MODEL, out_pt)
    assert code == 0
    assert_same(torch.load(out_pt, weights_only=True), toy_state(300))
    code, _, _ = run(capsys, "export", "--region", toy_region, "--step", "100", TOY_MODEL, tmp_path / "s.safetensors")
    assert code == 0
    st = load_file(tmp_path / "s.safetensors")
    assert_same(st["model.big"], toy_state(100)["model"]["big"])
    code, _, _ = run(capsys, "export", "--region", toy_region, "--key", "model", TOY_MODEL, tmp_path / "m.safetensors")
    assert code == 0 and set(load_file(tmp_path / "m.safetensors")) == set(toy_state(300)["model"])
    code, _, _ = run(capsys, "export", "--region", toy_region, TOY_MODEL, tmp_path / "meta.json")
    assert code == 0 and json.loads((tmp_path / "meta.json").read_text())["step"] == 300
    code, _, err = run(capsys, "export", "--region", toy_region, TOY_MODEL, tmp_path / "x.bin")
    assert code == 2 and "--file" in err
    code, _, err = run(capsys, "export", "--region", toy_region, "--file", "nope.pt", TOY_MODEL, tmp_path / "y.pt")
    assert code == 1 and "checkpoint.pt" in one_error_line(err)
    assert not (tmp_path / "y.pt").exists() and not list(tmp_path.glob("*.ckptfs-part"))


@pytest.mark.parametrize("cmd", [["ls"], ["info"], ["verify"]])
@pytest.mark.parametrize("default_exists", [False, True])
def test_a_region_given_where_a_model_goes_is_named_in_the_error(capsys, toy_region, tmp_path, monkeypatch, cmd,
                                                                 default_exists):
    """`ckptfs ls r.region` looks for a model named r.region in the default region (or finds no
    default region): the one error line says which argument is a region and how to pass it."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("CKPTFS_REGION", raising=False)
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    if default_exists:
        assert run(capsys, "mkfs", "--size", "64M")[0] == 0
        capsys.readouterr()
    code, _, err = run(capsys, *cmd, str(toy_region))
    assert code == 1 and one_error_line(err) == (f"ckptfs: error: {toy_region} is a region, not a model: pass it "
                                                 f"as --region {toy_region} (or set CKPTFS_REGION)")
    code, _, err = run(capsys, cmd[0], "nosuchmodel")  # a name that is no file: no such hint
    assert code == 1 and "is a region" not in one_error_line(err)


def test_region_before_the_command_is_the_commands_region(capsys, toy_region, tmp_path, monkeypatch):
    """`ckptfs --region R ls`, as other CLIs take a global option: it stands for the command's own
    --region, which wins when both are given; it wins over CKPTFS_REGION."""
    other = str(tmp_path / "none.region")
    monkeypatch.setenv("CKPTFS_REGION", other)
    expected = run(capsys, "ls", "--region", toy_region)
    assert expected[0] == 0 and TOY_MODEL in expected[1]
    assert run(capsys, "--region", toy_region, "ls") == expected
    assert run(capsys, "--region", other, "ls", "--region", toy_region) == expected
    code, _, err = run(capsys, "--region", other, "ls")
    assert code == 1 and f"no region yet at {other}" in one_error_line(err)
    code, out, _ = run(capsys, "--region", toy_region, "info", TOY_MODEL)
    assert code == 0 and TOY_MODEL in out


@pytest.mark.parametrize("cmd", [["ls"], ["status"], ["verify"], ["info", "m"], ["export", "m", "out.pt"],
                                 ["rm", "m", "1"]])
def test_read_only_commands_never_create_the_default_region(capsys, tmp_path, monkeypatch, cmd):
    """Only writers, mkfs and mount create the default region; the others say there is none."""
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("CKPTFS_REGION", raising=False)
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, *cmd)
    line = one_error_line(err)
    assert code == 1 and "no region yet" in line and "ckptfs mkfs" in line and "Store" not in line
    assert not home.exists() or not any(home.rglob("*.region"))


def test_a_command_that_creates_the_default_region_says_so(capsys, tmp_path, monkeypatch):
    """import creates the default region at its first use, as a writer does: it says where and
    how large, once (a 64 GiB sparse file was made without a word, on a filesystem of 80 MiB)."""
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("CKPTFS_REGION", raising=False)
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    save_file({"w": torch.ones(3)}, tmp_path / "w.safetensors")
    code, _, err = run(capsys, "import", "m", str(tmp_path / "w.safetensors"))
    region = home / ".local" / "share" / "ckptfs" / "default.region"
    assert code == 0 and region.exists()
    assert err == f"ckptfs: created the region {region} (64.0 GiB, a sparse file: blocks are taken as saves write; " \
                  "`ckptfs mkfs --size` makes one of another size)\n"
    assert run(capsys, "import", "m2", str(tmp_path / "w.safetensors"))[2] == ""  # once


def test_usage_errors_are_one_line_in_cli_words(capsys, toy_region, tmp_path):
    code, _, err = run(capsys, "rm", "--region", toy_region, TOY_MODEL, "first")
    assert code == 2 and err.count("\n") == 1 and err.startswith("ckptfs rm: usage: ")
    assert "'first' is not a step" in err and "ckptfs rm --help" in err
    # past the last step: said of the option (it was the writer's "step must be an int ...")
    code, _, err = run(capsys, "import", "--region", toy_region, "--step", str(1 << 62), "m", tmp_path / "x.pt")
    assert code == 2 and err.startswith("ckptfs import: usage: ") and "is past the last step (2**62 - 1)" in err
    code, _, err = run(capsys, "mkfs", tmp_path / "small.region", "--size", "1M")
    assert "--size" in one_error_line(err) and "size_bytes" not in err
    code, _, err = run(capsys, "mkfs", toy_region)
    assert "--force" in one_error_line(err) and "force=True" not in err and "Store(" not in err


def test_steps_as_the_mount_names_them(capsys, toy_region):
    code, out, _ = run(capsys, "info", "--region", toy_region, TOY_MODEL, "--step", "step-00000200", "--json")
    assert code == 0 and json.loads(out)["step"] == 200
    code, _, err = run(capsys, "info", "--region", toy_region, TOY_MODEL, "--step", "step-12345")
    assert code == 1 and "has no step 12345" in one_error_line(err) and f"ckptfs ls {TOY_MODEL}" in err


def _in_a_fresh_interpreter(commands: list[list[str]], then: str = "", report: str = "") -> str:
    """Run CLI ``commands`` (each must succeed), then the code ``then``, then print ``report``
    (an expression) in a new Python; returns what it printed."""
    code = (
        "import sys\n"
        "from ckptfs.cli import main\n"
        f"for argv in {commands!r}:\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as e:\n"
        "        assert not e.code, (argv, e.code)\n"
        f"{then}"
        f"print('report:', {report})\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_commands_on_single_process_versions_do_not_import_torch(toy_region, tmp_path):
    """info, verify, export (of each kind of file) and a mount's tree of a single-process
    version leave torch unimported, DCP with it (a second of every command and of a mount's
    start-up otherwise, and most of the daemon's memory); a multi-rank version imports DCP
    where met."""
    out = _in_a_fresh_interpreter(
        [["info", "--region", toy_region, "toy"], ["verify", "--region", toy_region],
         ["export", "--region", toy_region, "toy", str(tmp_path / "x.safetensors")],
         ["export", "--region", toy_region, "toy", str(tmp_path / "all") + "/"]],
        then=("import ckptfs\n"
              "from ckptfs.fs.tree import Tree\n"
              f"with ckptfs.Store({toy_region!r}) as store:\n"
              "    tree = Tree(store)\n"
              "    model = tree.lookup(1, 'toy').ino\n"
              "    step = max(name for name, _ in tree.children(model) if name.startswith('step-'))\n"
              "    print(sorted(name for name, _ in tree.children(tree.lookup(model, step).ino)))\n"),
        report="sorted(m for m in ('torch', 'torch.distributed.checkpoint') if m in sys.modules)")
    assert "checkpoint.pt" in out and out.rstrip().endswith("report: []"), out
    assert "checkpoint.pt" in os.listdir(tmp_path / "all")


def test_listing_a_region_imports_neither_torch_nor_pyfuse3(toy_region):
    """ls, status, keep and unkeep, and --help, read the region without torch (most of a
    second of each) or pyfuse3; their output is the same as ever."""
    region = ["--region", toy_region]
    out = _in_a_fresh_interpreter(
        [["ls", *region], ["ls", *region, "toy"], ["status", *region], ["keep", *region, "toy", "200"],
         ["keep", *region, "toy", "200"], ["unkeep", *region, "toy", "200"], ["unkeep", *region, "toy", "200"],
         ["--help"]],
        report="sorted(m for m in ('torch', 'pyfuse3', 'trio') if m in sys.modules)")
    assert "kept toy step 200" in out and "unkept toy step 200" in out and "MODEL" in out
    # a keep or unkeep that changes nothing says so (an unkeep of a version never kept said "unkept")
    assert "toy step 200 was kept already" in out and "toy step 200 was not kept" in out
    assert out.rstrip().endswith("report: []"), out


def test_export_of_a_whole_version_to_a_directory_or_stdout(capfd, toy_region, tmp_path):
    out_dir = tmp_path / "v200"
    with pytest.raises(SystemExit) as e:
        cli_main(["export", "--region", toy_region, "--step", "step-00000200", TOY_MODEL, f"{out_dir}/"])
    assert e.value.code == 0
    assert sorted(os.listdir(out_dir)) == sorted(["checkpoint.pt", "state.safetensors", "model.safetensors",
                                                  "metadata.json"] + [n for n in os.listdir(out_dir)
                                                                      if n.endswith(".safetensors")
                                                                      and n not in ("state.safetensors",
                                                                                    "model.safetensors")])
    assert_same(torch.load(out_dir / "checkpoint.pt", weights_only=True), toy_state(200))
    capfd.readouterr()
    # existing files are not replaced without --force
    with pytest.raises(SystemExit) as e:
        cli_main(["export", "--region", toy_region, TOY_MODEL, str(out_dir)])
    assert e.value.code == 1 and "--force" in one_error_line(capfd.readouterr().err)
    assert_same(torch.load(out_dir / "checkpoint.pt", weights_only=True), toy_state(200))
    with pytest.raises(SystemExit) as e:
        cli_main(["export", "--region", toy_region, "--force", TOY_MODEL, str(out_dir)])
    assert e.value.code == 0
    assert_same(torch.load(out_dir / "checkpoint.pt", weights_only=True), toy_state(300))
    capfd.readouterr()
    # standard output, never a file named "-"
    monkey_cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(SystemExit) as e:
            cli_main(["export", "--region", toy_region, "--file", "metadata.json", TOY_MODEL, "-"])
    finally:
        os.chdir(monkey_cwd)
    out = capfd.readouterr().out
    assert e.value.code == 0 and json.loads(out)["step"] == 300 and not (tmp_path / "-").exists()


def test_export_of_a_damaged_version_to_a_directory_leaves_nothing(capsys, fresh_region, tmp_path):
    flip_a_tensor_byte(fresh_region, TOY_MODEL, 200, "model.big")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    code, _, err = run(capsys, "export", "--region", fresh_region, "--step", "200", TOY_MODEL, out_dir)
    assert code == 1 and "model.big" in one_error_line(err)
    assert os.listdir(out_dir) == []
    # a directory the export was to make (OUTPUT/ not there yet) is not left behind either
    code, _, err = run(capsys, "export", "--region", fresh_region, "--step", "200", TOY_MODEL, f"{out_dir}/new/")
    assert code == 1 and "model.big" in one_error_line(err)
    assert os.listdir(out_dir) == []


def test_a_failed_export_with_force_leaves_the_files_it_would_replace(capsys, fresh_region, tmp_path, monkeypatch):
    """--force over an earlier export: a failure on a later file unlinked the files already
    replaced, so the directory held neither export. Now every file is written beside its place
    and renamed only once all are whole."""
    import ckptfs.cli.transfer as transfer

    out_dir = tmp_path / "out"
    assert run(capsys, "export", "--region", fresh_region, "--step", "100", TOY_MODEL, f"{out_dir}/")[0] == 0
    before = {name: (out_dir / name).read_bytes() for name in os.listdir(out_dir)}
    real, calls = transfer._export_file, []

    def fail_on_the_third(view, data, dest):
        calls.append(dest)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(view, data, dest)

    monkeypatch.setattr(transfer, "_export_file", fail_on_the_third)
    code, _, err = run(capsys, "export", "--region", fresh_region, "--step", "200", "--force", TOY_MODEL,
                       f"{out_dir}/")
    assert code == 1 and "No space left on device" in one_error_line(err)
    assert {name: (out_dir / name).read_bytes() for name in os.listdir(out_dir)} == before  # step 100's, whole


def test_export_key_names_the_file_as_the_mount_does(capsys, tmp_path):
    """--key a/b exported nothing ("has no a/b.safetensors; it has ... a_b.safetensors"), and
    --key state exported state.safetensors, the whole object's file, as if it were the key's."""
    from safetensors.torch import load_file

    region = str(tmp_path / "k.region")
    with ckptfs.Store.create(region, size_bytes=64 << 20) as s, s.writer("m") as w:
        w.save({"state": {"w": torch.ones(2)}, "a/b": {"x": torch.zeros(3)}, "other": {"v": torch.ones(1)}}, 1).result()
    assert run(capsys, "export", "--region", region, "--key", "a/b", "m", tmp_path / "ab.safetensors")[0] == 0
    assert list(load_file(tmp_path / "ab.safetensors")) == ["x"]
    code, _, err = run(capsys, "export", "--region", region, "--key", "state", "m", tmp_path / "s.safetensors")
    assert code == 2 and "--key 'state' has no file of its own (state.safetensors holds every tensor" in err
    assert not os.path.exists(tmp_path / "s.safetensors")


def test_import_of_an_exported_state_safetensors_keeps_the_nesting(capsys, fresh_region, tmp_path):
    """state.safetensors carries the object's skeleton: the import gives back the same object
    (nesting, int keys, plain values, tied tensors), not dotted top-level keys."""
    tied = torch.randn(8, 4)
    obj = {"model": {"emb": tied, "head": tied, "layers": [{"b": torch.ones(3)}]},
           "optim": {"state": {0: {"step": torch.tensor(2.0)}}, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]},
           "epoch": 4}
    with ckptfs.Store(fresh_region) as s, s.writer("nest") as w:
        w.save(obj, step=5)
    exported = tmp_path / "state.safetensors"
    assert run(capsys, "export", "--region", fresh_region, "nest", exported)[0] == 0
    assert run(capsys, "import", "--region", fresh_region, "nest2", exported)[0] == 0
    with ckptfs.Store(fresh_region) as s:
        back = s.load("nest2")
    assert_same(back, obj)
    assert back["model"]["emb"] is back["model"]["head"]
    # a file changed after its export (a tensor added) imports flat, by name, nothing lost
    tensors = load_file(exported)
    tensors["extra"] = torch.zeros(2)
    from safetensors import safe_open
    with safe_open(exported, "pt") as f:
        meta = f.metadata()
    save_file(tensors, tmp_path / "changed.safetensors", metadata=meta)
    assert run(capsys, "import", "--region", fresh_region, "nest3", tmp_path / "changed.safetensors")[0] == 0
    with ckptfs.Store(fresh_region) as s:
        assert set(s.load("nest3")) == set(tensors)
    # a damaged skeleton is refused, with nothing written
    meta["ckptfs.skeleton"] = '{"dict":[[{"str":"w"},{"tensor":"nope"}]]}'
    save_file(load_file(exported), tmp_path / "bad.safetensors", metadata=meta)
    code, _, err = run(capsys, "import", "--region", fresh_region, "nest4", tmp_path / "bad.safetensors")
    assert code == 1 and "ckptfs.skeleton" in one_error_line(err) and "nothing was imported" in err
    with ckptfs.Store(fresh_region) as s:
        assert "nest4" not in s.models()


def full_training_checkpoint(seed: int) -> dict:
    """What a hand-written training loop saves beside the model and the optimizer: the scheduler,
    the AMP scaler, every RNG's state (numpy's an array), numpy metrics, torch's small objects."""
    import random

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=50)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        sched.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(),
            "scaler": torch.amp.GradScaler("cpu").state_dict(), "epoch": seed,
            "rng": {"torch": torch.get_rng_state(), "numpy": np.random.RandomState(seed).get_state(),
                    "python": random.Random(seed).getstate()},
            "best": {"loss": np.float32(0.5 / (seed + 1)), "at": np.int64(seed), "improved": np.bool_(seed % 2)},
            "amp": {"dtype": torch.bfloat16, "device": torch.device("cpu"), "shape": torch.Size([4, 8])}}


def test_a_full_training_checkpoint_saves_loads_exports_and_imports(capsys, fresh_region, tmp_path):
    """numpy's RNG state and metrics, torch's Size, dtype and device in a training checkpoint:
    Store.load, torch.load of checkpoint.pt (as of torch.save's file), metadata.json, and the
    import of the exported state.safetensors and of a torch.save file all give them back."""
    with ckptfs.Store(fresh_region) as s, s.writer("full") as w:
        for step in (1, 2):  # the second through the cached plan, with new values
            w.save(full_training_checkpoint(step), step=step).result()
        assert_same(s.load("full", 1), full_training_checkpoint(1))
        assert_same(s.load("full"), full_training_checkpoint(2))
    out = tmp_path / "out"
    assert run(capsys, "export", "--region", fresh_region, "full", f"{out}/")[0] == 0
    assert_same(torch.load(out / "checkpoint.pt", weights_only=False), full_training_checkpoint(2))
    torch.save(full_training_checkpoint(2), tmp_path / "torch_save.pt")
    for path in (out / "checkpoint.pt", tmp_path / "torch_save.pt"):  # torch refuses both alike
        with pytest.raises(pickle.UnpicklingError, match="numpy"):
            torch.load(path, weights_only=True)
    meta = json.loads((out / "metadata.json").read_text())["object"]
    assert meta["best"] == {"loss": float(np.float32(0.5 / 3)), "at": 2, "improved": False}
    assert meta["amp"] == {"dtype": "torch.bfloat16", "device": "cpu", "shape": [4, 8]}
    assert meta["rng"]["numpy"][:2] == ["MT19937", "<ndarray <u4 (624,)>"]
    for name, path in (("from_export", out / "state.safetensors"), ("from_torch", tmp_path / "torch_save.pt")):
        assert run(capsys, "import", "--region", fresh_region, name, path)[0] == 0
        with ckptfs.Store(fresh_region) as s:
            assert_same(s.load(name), full_training_checkpoint(2))


def test_import_of_a_torch_file_written_under_numpy_1(capsys, fresh_region, tmp_path):
    """A torch.save file of numpy 1 names numpy.core.multiarray (numpy 2 writes numpy._core):
    its numpy RNG state imports as well; an object array stays refused."""
    import io

    buf = io.BytesIO()
    state = {"rng": np.random.RandomState(1).get_state(), "best": np.float32(2.0), "w": torch.ones(2)}
    torch.save(state, buf, _use_new_zipfile_serialization=False)  # one pickle stream: names editable in place
    raw = buf.getvalue().replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
    assert b"numpy.core.multiarray" in raw
    (tmp_path / "np1.pt").write_bytes(raw)
    assert run(capsys, "import", "--region", fresh_region, "np1", tmp_path / "np1.pt")[0] == 0
    with ckptfs.Store(fresh_region) as s:
        assert_same(s.load("np1"), state)
    torch.save({"o": np.array([1, "a"], dtype=object)}, tmp_path / "object.pt")
    code, _, err = run(capsys, "import", "--region", fresh_region, "obj", tmp_path / "object.pt")
    assert code == 1 and "ObjectDType" in one_error_line(err) and "nothing was imported" in err


def test_rm(capsys, fresh_region):
    assert run(capsys, "rm", "--region", fresh_region, TOY_MODEL, "step-00000100")[0] == 0
    with ckptfs.Store(fresh_region) as s:
        assert [v.step for v in s.versions(TOY_MODEL)] == [200, 300]
    code, _, err = run(capsys, "rm", "--region", fresh_region, TOY_MODEL, "--step", "100")
    assert code == 1 and "has no step 100" in one_error_line(err)
    code, _, err = run(capsys, "rm", "--region", fresh_region, TOY_MODEL, "300")
    assert code == 1 and "latest" in one_error_line(err)
    code, _, err = run(capsys, "rm", "--region", fresh_region, TOY_MODEL)
    assert code == 2 and "--all" in err
    assert run(capsys, "rm", "--region", fresh_region, TOY_MODEL, "--all")[0] == 0
    with ckptfs.Store(fresh_region) as s:
        assert s.models() == []


# ------------------------------------------------------------------------------ import


def test_import_safetensors_and_torch_files(capsys, fresh_region, tmp_path):
    tensors = {"w": torch.randn(3, 4), "ids": torch.arange(5), "h": torch.randn(7).to(torch.bfloat16),
               "flag": torch.tensor([True, False]), "empty": torch.zeros(0, 3)}
    save_file(tensors, tmp_path / "a.safetensors")
    code, out, _ = run(capsys, "import", "--region", fresh_region, "imp", tmp_path / "a.safetensors")
    assert code == 0 and "step 0" in out
    code, out, _ = run(capsys, "import", "--region", fresh_region, "--key", "model", "imp", tmp_path / "a.safetensors")
    assert code == 0 and "step 1" in out
    code, _, err = run(capsys, "import", "--region", fresh_region, "--step", "1", "imp", tmp_path / "a.safetensors")
    assert code == 1 and "already has step 1" in one_error_line(err)
    torch.save(toy_state(7), tmp_path / "t.pt")
    assert run(capsys, "import", "--region", fresh_region, "--step", "7", "imp2", tmp_path / "t.pt")[0] == 0
    with ckptfs.Store(fresh_region) as s:
        got = s.load("imp", 0)
        assert set(got) == set(tensors)
        for k, t in tensors.items():
            assert_same(got[k], t)
        assert set(s.load("imp", 1)) == {"model"}
        assert_same(s.load("imp2", 7), toy_state(7))


def test_export_import_round_trip_of_every_safetensors_dtype(capsys, tmp_path):
    from test_roundtrip import every_dtype_tensors

    region = str(tmp_path / "r.region")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 is experimental
        tensors = every_dtype_tensors()
    with ckptfs.Store.create(region, size_bytes=128 << 20) as s, s.writer("all") as w:
        w.save(tensors, 1).result()
    assert run(capsys, "export", "--region", region, "all", tmp_path / "x.safetensors")[0] == 0
    # complex128 and complex32 have no safetensors dtype: the file leaves them out and says so,
    # and its import is refused rather than a version without them
    code, _, err = run(capsys, "import", "--region", region, "back", tmp_path / "x.safetensors")
    assert code == 1 and "leaves out tensors that safetensors cannot hold ('complex128', 'complex32')" in err
    with ckptfs.Store(region) as s:
        assert s.versions("back", missing_ok=True) == []
    assert run(capsys, "export", "--region", region, "all", tmp_path / "x.pt")[0] == 0
    assert run(capsys, "import", "--region", region, "back", tmp_path / "x.pt")[0] == 0
    with ckptfs.Store(region) as s:
        back = s.load("back")
    assert list(back) == list(tensors) and "float4_e2m1fn_x2" in back and "float8_e8m0fnu" in back
    for k, t in back.items():
        assert_same(t, tensors[k], k)


class Evil:
    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


MARKER = f"/tmp/ckptfs-test-pwned-{os.getpid()}"


def _st(header, data=b"", n=None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if n is None else n) + raw + data


def _valid_st() -> bytes:
    return st_save({"a": torch.arange(8, dtype=torch.float32), "b": torch.ones(4, dtype=torch.int64)})


def _f32(shape, begin, end):
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}


def _torch_bytes(obj) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


MALFORMED = {  # file name: (contents, what the one-line error must say)
    "truncated-data.safetensors": (lambda: _valid_st()[:-10], "truncated"),
    "truncated-header.safetensors": (lambda: _valid_st()[:20], "truncated"),
    "too-short.safetensors": (lambda: b"\x01\x02\x03", "truncated"),
    "header-length-huge.safetensors": (lambda: _st({"a": _f32([1], 0, 4)}, bytes(4), n=1 << 40), "bad header length"),
    "header-length-past-eof.safetensors": (lambda: _st({"a": _f32([1], 0, 4)}, bytes(4), n=200), "runs past the end"),
    "header-length-zero.safetensors": (lambda: _st(b"", b"\0" * 16, n=0), "bad header length"),
    "header-not-json.safetensors": (lambda: _st(b"{not json}"), "not valid JSON"),
    "header-not-object.safetensors": (lambda: _st(b"[1, 2]"), "not a JSON object"),
    "overlapping-offsets.safetensors": (
        lambda: _st({"a": _f32([4], 0, 16), "b": _f32([4], 8, 24)}, bytes(24)), "overlaps"),
    "hole.safetensors": (lambda: _st({"a": _f32([2], 0, 8), "b": _f32([2], 16, 24)}, bytes(24)), "hole"),
    "offsets-past-end.safetensors": (lambda: _st({"a": _f32([4], 0, 16)}, bytes(8)), "truncated"),
    "trailing-bytes.safetensors": (lambda: _st({"a": _f32([2], 0, 8)}, bytes(12)), "after the last tensor"),
    "wrong-dtype.safetensors": (
        lambda: _st({"a": {"dtype": "F33", "shape": [2], "data_offsets": [0, 8]}}, bytes(8)), "dtype 'F33'"),
    "shape-size-mismatch.safetensors": (lambda: _st({"a": _f32([3], 0, 16)}, bytes(16)), "needs 12 bytes"),
    "negative-shape.safetensors": (lambda: _st({"a": _f32([-1], 0, 4)}, bytes(4)), "invalid shape"),
    "duplicate-key.safetensors": (
        lambda: _st(b'{"a":' + json.dumps(_f32([1], 0, 4)).encode() + b',"a":'
                    + json.dumps(_f32([1], 4, 8)).encode() + b"}", bytes(8)), "duplicate key"),
    "extra-field.safetensors": (lambda: _st({"a": dict(_f32([1], 0, 4), extra=1)}, bytes(4)), "exactly dtype"),
    "forbidden-global.pt": (lambda: _torch_bytes({"model": {"w": torch.ones(2)}, "x": Evil()}), "GLOBAL posix.system"),
    "forbidden-global-legacy.pt": (lambda: pickle.dumps(Evil(), protocol=2), "GLOBAL posix.system"),
    "truncated.pt": (lambda: _torch_bytes(toy_state(1))[:5000], "truncated"),
    "garbage.pt": (lambda: bytes(range(256)) * 10, "refused by torch.load"),
    "quantized-dtype.pt": (
        lambda: _torch_bytes({"q": torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)}), "qint8"),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_import_is_refused_and_writes_nothing(capsys, toy_region, tmp_path, name):
    contents, reason = MALFORMED[name]
    bad = tmp_path / name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated
        bad.write_bytes(contents())
    before = region_state(toy_region)
    listing = run(capsys, "ls", "--region", toy_region, "--json")[1]
    for model in ("newmodel", TOY_MODEL):
        code, out, err = run(capsys, "import", "--region", toy_region, model, bad)
        assert code == 1, (out, err)
        line = one_error_line(err)
        assert reason in line and str(bad) in line and "nothing was imported" in line
        assert region_state(toy_region) == before
    assert run(capsys, "ls", "--region", toy_region, "--json")[1] == listing
    assert not os.path.exists(MARKER), "the hostile pickle ran"


# ------------------------------------------------------------------------------ mount / umount from the CLI


@pytest.mark.fuse
@pytest.mark.slow
@requires_fuse
def test_background_mount_umount_and_their_errors(capsys, toy_region, tmp_path):
    """`ckptfs mount` returns once the mount is up, reports every failure itself, and
    `ckptfs umount` falls back to a lazy unmount when the mount is busy."""
    from ckptfs.fs.daemon import mount_entry

    mnt = str(tmp_path / "mnt")
    os.mkdir(mnt)
    code, _, err = run(capsys, "mount", "--region", tmp_path / "nope.region", mnt)
    assert code == 1 and "no region yet at" in one_error_line(err)
    code, _, err = run(capsys, "mount", "--region", toy_region, tmp_path / "missing-dir")
    assert code == 1 and "mkdir" in one_error_line(err)
    code, _, err = run(capsys, "umount", mnt)
    assert code == 1 and "not mounted" in one_error_line(err)
    code, _, err = run(capsys, "mount", "--region", toy_region, "-o", "no_such_fuse_option", mnt)
    assert code == 1 and "cannot mount" in one_error_line(err)  # the daemon's own failure, relayed
    # an option libfuse accepts at mount time but then refuses at the kernel's INIT: the session
    # ends at once, leaving a mount that answers nothing; it was reported "up" (exit 0)
    code, _, err = run(capsys, "mount", "--region", toy_region, "-o", "max_read=1048576", mnt)
    assert code == 1 and "cannot mount" in one_error_line(err) and "maximum read size" in one_error_line(err)
    assert mount_entry(mnt) is None
    try:
        code, _, err = run(capsys, "mount", "--region", toy_region, mnt)
        assert code == 0, err
        assert os.path.ismount(mnt)  # up when the command returns, no waiting
        assert os.listdir(os.path.join(mnt, TOY_MODEL))[0] == "latest"
        code, _, err = run(capsys, "mount", "--region", toy_region, mnt)
        assert code == 1 and "already mounted" in one_error_line(err)
        busy = subprocess.Popen(["sleep", "60"], cwd=os.path.join(mnt, TOY_MODEL))
        try:
            time.sleep(0.2)
            code, _, err = run(capsys, "umount", mnt)
            assert code == 0 and "busy" in err  # lazily detached
            assert mount_entry(mnt) is None
        finally:
            busy.kill()
            busy.wait()
        assert run(capsys, "mount", "--region", toy_region, mnt)[0] == 0
        code, _, err = run(capsys, "umount", mnt)
        assert code == 0 and err == "" and mount_entry(mnt) is None
        # as mount(8) takes them: the region first, then the directory
        code, _, err = run(capsys, "mount", toy_region, mnt)
        assert code == 0, err
        assert os.listdir(os.path.join(mnt, TOY_MODEL))[0] == "latest"
        assert run(capsys, "umount", mnt)[0] == 0
    finally:
        force_unmount(mnt)
    for args, words in ((("mount",), "got no paths; give [REGION] MOUNTPOINT"),
                        (("mount", toy_region, mnt, mnt), "got 3 paths"),
                        (("mount", "--region", tmp_path / "other.region", toy_region, mnt), "two regions given")):
        code, _, err = run(capsys, *args)
        assert code == 2 and err.count("\n") == 1 and err.startswith("ckptfs mount: usage: ") and words in err, err


def mount_flags(path: str) -> list[str]:
    """The options of the mount at ``path`` as /proc/mounts lists them ("ro" or "rw" first)."""
    return next(line.split()[3] for line in open("/proc/mounts") if line.split()[1] == path).split(",")


@pytest.mark.fuse
@pytest.mark.slow
@requires_fuse
def test_mount_helper_for_mount8_and_fstab(toy_region, tmp_path):
    """mount(8) runs `mount.ckptfs REGION DIR -o OPTS`; generic options are dropped."""
    from ckptfs.fs.daemon import mount_entry

    helper = os.path.join(os.path.dirname(__file__), "..", "mount", "mount.ckptfs")
    mnt = str(tmp_path / "mnt")
    os.mkdir(mnt)
    env = dict(os.environ, CKPTFS_BIN=f"{sys.executable} -m ckptfs.cli")
    try:
        r = subprocess.run([helper, toy_region, mnt, "-o", "rw,nosuid,nodev,nofail,_netdev,x-systemd.automount"],
                           env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert mount_entry(mnt) == ("fuse.ckptfs", toy_region)
        # mount(8) passes `rw` to every helper unless told `ro`: the mount stays read-only
        assert mount_flags(mnt)[0] == "ro"
        assert torch.load(os.path.join(mnt, TOY_MODEL, "latest", "checkpoint.pt"), weights_only=True)["step"] == 300
        subprocess.run(["umount", mnt], check=True)
        r = subprocess.run([helper, toy_region, mnt, "-o", "rw,rm_versions"], env=env, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0 and mount_flags(mnt)[0] == "rw", r.stderr  # `rm -r` of a version asked for
        subprocess.run(["umount", mnt], check=True)
        r = subprocess.run([helper, str(tmp_path / "nope.region"), mnt], env=env, capture_output=True, text=True)
        assert r.returncode != 0 and "no region yet at" in r.stderr
        r = subprocess.run([helper, toy_region], env=env, capture_output=True, text=True)
        assert r.returncode == 1 and "usage" in r.stderr
    finally:
        force_unmount(mnt)


@pytest.mark.fuse
@pytest.mark.slow
@requires_fuse
@pytest.mark.skipif(os.geteuid() != 0, reason="installs into /sbin and runs mount(8) as root")
def test_readme_steps_for_mount8(toy_region, tmp_path):
    """The README's steps as written: `ckptfs install-mount-helper`, then `mount -t fuse.ckptfs
    REGION DIR` from an environment with no PATH to this ckptfs (mount(8) runs helpers with its
    own), `umount DIR`."""
    from ckptfs.fs.daemon import mount_entry
    from ckptfs.fs.mounthelper import HELPER_NAMES

    saved = {}
    for name in HELPER_NAMES:
        path = os.path.join("/sbin", name)
        saved[path] = os.readlink(path) if os.path.islink(path) else (
            open(path, "rb").read() if os.path.exists(path) else None)
    mnt = str(tmp_path / "mnt")
    os.mkdir(mnt)
    try:
        r = subprocess.run(CLI + ["install-mount-helper"], capture_output=True, text=True)
        assert r.returncode == 0 and "/sbin/mount.fuse.ckptfs" in r.stdout, r.stderr
        r = subprocess.run(["env", "-i", "mount", "-t", "fuse.ckptfs", toy_region, mnt, "-o", "nofail,allow_other"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert mount_entry(mnt) == ("fuse.ckptfs", toy_region) and mount_flags(mnt)[0] == "ro"
        assert torch.load(os.path.join(mnt, TOY_MODEL, "latest", "checkpoint.pt"), weights_only=True)["step"] == 300
        r = subprocess.run(["mount", "-t", "fuse.ckptfs", toy_region, mnt], capture_output=True, text=True)
        assert r.returncode != 0 and "already mounted" in r.stderr
        subprocess.run(["umount", mnt], check=True)
        assert mount_entry(mnt) is None
    finally:
        force_unmount(mnt)
        for path, old in saved.items():
            if os.path.lexists(path):
                os.unlink(path)
            if isinstance(old, str):
                os.symlink(old, path)
            elif old is not None:
                with open(path, "wb") as f:
                    f.write(old)
                os.chmod(path, 0o755)


def test_import_gives_back_what_export_wrote_ties_directories_and_extra_files(tmp_path):
    """A ckptfs <key>.safetensors stores tied weights once and names the others in its
    __metadata__ (ckptfs.aliases): imported, they come back tied (they were dropped). A
    directory that `ckptfs export` wrote (a version directory) imports its whole object and its
    extra files (it was read as a Hugging Face directory: model.safetensors alone, the optimizer
    state and plain values dropped, with a success message)."""
    region = str(tmp_path / "r.region")
    ckptfs.Store.create(region, 64 << 20).close()
    w = torch.randn(8, 4)
    state = {"model": {"emb.weight": w, "head.weight": w, "b": torch.ones(3)}, "optim": {"m": torch.randn(5)},
             "epoch": 7}
    with ckptfs.Store(region) as store, store.writer("src") as wr:
        wr.save(state, step=5, extra={"config.json": {"n": 1}, "notes.txt": "hi"}).result()
    run = functools.partial(subprocess.run, capture_output=True, text=True, timeout=120)
    for args in (["export", "--region", region, "src", "--key", "model", str(tmp_path / "model.safetensors")],
                 ["import", "--region", region, "--key", "model", "tied", str(tmp_path / "model.safetensors")],
                 ["export", "--region", region, "src", str(tmp_path / "out") + "/"],
                 ["import", "--region", region, "whole", str(tmp_path / "out")]):
        done = run([sys.executable, "-m", "ckptfs.cli", *args])
        assert done.returncode == 0, (args, done.stderr)
    with ckptfs.Store(region) as store:
        tied = store.load("tied")["model"]
        assert set(tied) == {"b", "emb.weight", "head.weight"}
        assert torch.equal(tied["head.weight"], w) and tied["head.weight"].data_ptr() == tied["emb.weight"].data_ptr()
        whole = store.load("whole")
        assert whole["epoch"] == 7 and torch.equal(whole["optim"]["m"], state["optim"]["m"])
        assert torch.equal(whole["model"]["head.weight"], w)
        with store.open_version("whole") as v:
            files = dict(v.manifest.files)
        assert set(files) == {"config.json", "notes.txt"} and files["notes.txt"] == "hi"
        assert json.loads(files["config.json"]) == {"n": 1}
    # a multi-rank (DCP) version's directory: its whole tensors, without its records (with them the
    # copy looked like a multi-rank version whose parts were gone: PartGoneError at its load)
    import torch.distributed.checkpoint as dcp

    with ckptfs.Store(region) as store:
        dcp.save({"model": {"w": torch.arange(16.0)}, "epoch": 3},
                 storage_writer=ckptfs.dcp.StorageWriter(store, "dcpm", step=5))
    for args in (["export", "--region", region, "dcpm", str(tmp_path / "dcp") + "/"],
                 ["import", "--region", region, "dcpcopy", str(tmp_path / "dcp")]):
        done = run([sys.executable, "-m", "ckptfs.cli", *args])
        assert done.returncode == 0, (args, done.stderr)
    with ckptfs.Store(region) as store:
        copy = store.load("dcpcopy")
        assert copy["epoch"] == 3 and torch.equal(copy["model"]["w"], torch.arange(16.0))
        with store.open_version("dcpcopy") as v:
            assert dict(v.manifest.files) == {}


def test_status_shows_many_kept_steps_as_a_count_and_a_range():
    """74 kept steps made status's table hundreds of characters wide: a few are listed, more are
    counted with the first and the last (`ckptfs ls MODEL` marks each)."""
    from ckptfs.cli.region import _kept_column

    assert _kept_column([]) == "-" and _kept_column([2, 3]) == "2 3"
    assert _kept_column(list(range(0, 740, 10))) == "0..730 (74)"


def test_a_version_whose_skeleton_was_left_out_imports_whole_from_its_checkpoint(capsys, tmp_path, monkeypatch):
    # state.safetensors without its skeleton (a header past safetensors' 100 MB; the limit lowered
    # here to stand for it) was imported flat, its plain values and nesting lost, exit 0
    import ckptfs.views.safetensors as view

    region = str(tmp_path / "k.region")
    state = {"model": {"w": torch.arange(4.0)}, "sampler": {"order": list(range(3000))}, "step": 7}
    with ckptfs.Store.create(region, size_bytes=64 << 20) as s, s.writer("m") as w:
        w.save(state, 7).result()
    monkeypatch.setattr(view, "MAX_HEADER_BYTES", 5000)
    assert run(capsys, "export", "--region", region, "m", f"{tmp_path / 'exp'}/")[0] == 0
    assert run(capsys, "import", "--region", region, "back", tmp_path / "exp")[0] == 0
    with ckptfs.Store(region) as s:
        back = s.load("back")
    assert back["sampler"]["order"] == list(range(3000)) and back["step"] == 7
    assert torch.equal(back["model"]["w"], torch.arange(4.0))
    code, _, err = run(capsys, "import", "--region", region, "flat", tmp_path / "exp" / "state.safetensors")
    assert code == 1 and "made without the object's skeleton" in one_error_line(err) and "checkpoint.pt" in err
    os.remove(tmp_path / "exp" / "checkpoint.pt")  # a copy without it was read as a Hugging Face directory
    code, _, err = run(capsys, "import", "--region", region, "hf", tmp_path / "exp")
    assert code == 1 and "has no checkpoint.pt" in one_error_line(err)


def test_a_version_with_tensors_safetensors_cannot_hold_imports_whole_from_its_checkpoint(capsys, tmp_path):
    """A complex128 tensor (no safetensors dtype) is left out of state.safetensors, which then
    carries no skeleton: an exported version imported from it came back flat, without that
    tensor, its plain values or its nesting, exit 0. Now its checkpoint.pt is imported; the
    state.safetensors alone is refused, naming what it leaves out (a tied name too)."""
    from safetensors import safe_open

    region = str(tmp_path / "c.region")
    rot = torch.randn(3, dtype=torch.complex128)
    state = {"model": {"w": torch.arange(4.0), "rot": rot, "rot_tied": rot}, "epoch": 7,
             "opt": {"param_groups": [{"lr": 0.1}]}}
    with ckptfs.Store.create(region, size_bytes=64 << 20) as s, s.writer("m") as w:
        w.save(state, 5).result()
    assert run(capsys, "export", "--region", region, "m", f"{tmp_path / 'exp'}/")[0] == 0
    with safe_open(str(tmp_path / "exp" / "state.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["ckptfs.skipped"]) == ["model.rot", "model.rot_tied"]
    assert run(capsys, "import", "--region", region, "back", tmp_path / "exp")[0] == 0
    with ckptfs.Store(region) as s:
        back = s.load("back")
    assert_same(back, state)
    assert back["model"]["rot"] is back["model"]["rot_tied"]
    code, _, err = run(capsys, "import", "--region", region, "flat", tmp_path / "exp" / "state.safetensors")
    assert code == 1 and "leaves out tensors that safetensors cannot hold ('model.rot', 'model.rot_tied'): " \
        "import the version's checkpoint.pt" in one_error_line(err)


def test_an_export_listing_an_extra_named_as_a_views_file_imports_without_it(capsys, tmp_path, caplog):
    # an older ckptfs let a save name an extra metadata.json (hidden by the view's own); a save now
    # refuses such a name, and its import refused the whole export
    region = str(tmp_path / "o.region")
    with ckptfs.Store.create(region, size_bytes=64 << 20) as s, s.writer("m") as w:
        w.save({"w": torch.arange(3.0)}, 1, extra={"notes.txt": "kept"}).result()
    out = tmp_path / "exp"
    assert run(capsys, "export", "--region", region, "m", f"{out}/")[0] == 0
    meta = json.loads((out / "metadata.json").read_text())
    meta["files"] = meta["files"] + ["metadata.json"]
    (out / "metadata.json").write_text(json.dumps(meta))
    with caplog.at_level("WARNING", logger="ckptfs"):
        assert run(capsys, "import", "--region", region, "back", out)[0] == 0
    assert "metadata.json, named as ckptfs's own files, are left out" in caplog.text
    with ckptfs.Store(region) as s, s.open_version("back") as v:
        assert dict(v.manifest.files) == {"notes.txt": "kept"}


def test_the_clis_lines_never_raise_into_the_library(monkeypatch, capsys):
    """While a command runs, the library's warnings are its lines (cli_lines): a stderr that is
    gone raises nothing into the library's call, as logging's own handlers do (a commit's log
    line raised out of code that must not raise), and the end of the command, or a mount's
    daemon, gives warnings.showwarning back."""
    import logging

    from ckptfs.cli import common

    shown = warnings.showwarning
    ours = os.path.join(os.path.dirname(ckptfs.__file__), "x.py")
    with common.cli_lines():
        assert warnings.showwarning is not shown
        warnings.showwarning("a warning", UserWarning, ours, 1)
        assert capsys.readouterr().err.splitlines()[-1] == "ckptfs: warning: a warning"

        def gone(*args, **kwargs):
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")

        monkeypatch.setattr(common.click, "echo", gone)
        monkeypatch.setattr(logging, "raiseExceptions", False)  # (handleError's report of it, not needed here)
        logging.getLogger("ckptfs").error("stderr closed")
        warnings.showwarning("another", UserWarning, ours, 1)
        common.stop_cli_lines()  # the daemon's own handler takes over
        assert warnings.showwarning is shown and not logging.getLogger("ckptfs").handlers
    assert warnings.showwarning is shown


def test_info_shows_keys_a_terminal_cannot_print_escaped(tmp_path):
    """A key holding a lone surrogate ended `info` with "'utf-8' codec can't encode" after its
    header, and one holding a newline printed a bogus row: both are escaped as Python writes
    them (as `verify` names them)."""
    region = str(tmp_path / "r.region")
    with ckptfs.Store.create(region, size_bytes=64 << 20) as store, store.writer("m") as w:
        w.save({"model": {"ok": torch.ones(1), "bad\ud800": torch.zeros(2), "line\nbreak": torch.ones(3)},
                "key\udc80": {"t": torch.ones(1)}}, step=1).result()  # a file of its own: key\udc80.safetensors
    done = subprocess.run([sys.executable, "-m", "ckptfs.cli", "info", "m", "--region", region],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = [line.split()[0] for line in done.stdout.splitlines() if line.startswith("model.")]
    assert rows == ["model.ok", "model.bad\\ud800", "model.line\\nbreak"]
    assert "key\\udc80.safetensors (" in next(line for line in done.stdout.splitlines() if line.startswith("files "))


def test_ls_of_a_model_reads_its_slot_headers_a_bounded_number_of_times(capsys, store, monkeypatch):
    """`ls MODEL` looked up each row's version again to check its index: every slot header read
    once per row, 21 s for 800 kept versions. The headers are read a few times in all."""
    from ckptfs.region.slots import SlotReader

    with store.writer("m", keep_every=1) as w:
        for step in range(40):
            w.save({"w": torch.full((8,), float(step))}, step=step).result()
    reads = []
    real = SlotReader.read_header
    monkeypatch.setattr(SlotReader, "read_header", lambda self, *a: reads.append(a) or real(self, *a))
    code, out, _ = run(capsys, "ls", "--region", store.path, "m")
    assert code == 0 and len(out.splitlines()) == 41 and "damaged" not in out
    assert len(reads) <= 8 * 40, len(reads)


def test_listings_and_checks_beside_removals_by_another_process(capsys, store, monkeypatch):
    """Another process's `rm --all` between the listing of the models and the look at one made
    `ckptfs ls` and `ckptfs verify` fail ("no model"); `verify --step S` of a step whose every
    save was reused meanwhile said "verified" having checked nothing; and a table entry read
    between the two copies of a change was reported damaged."""
    from ckptfs.region.region import Region
    from ckptfs.region.table import ModelTable

    with store.writer("m") as w:
        w.save({"w": torch.ones(4)}, step=1).result()
    real_models = ckptfs.Store.models
    monkeypatch.setattr(ckptfs.Store, "models", lambda self: real_models(self) + ["gone"])
    assert run(capsys, "ls", "--region", store.path)[0] == 0
    assert run(capsys, "verify", "--region", store.path)[0] == 0
    monkeypatch.setattr(ckptfs.Store, "models", real_models)
    monkeypatch.setattr(Region, "pin", lambda self, version: False)  # reused before the pin
    code, _, err = run(capsys, "verify", "--region", store.path, "m", "--step", "1")
    assert code != 0 and "verified" not in err and "step 1" in one_error_line(err)
    monkeypatch.undo()
    real_read = ModelTable._read_copies
    seen = []

    def mid_change(self, index):  # the first, unlocked read falls between the two copies
        entry, problems = real_read(self, index)
        seen.append(index)
        return (entry, ["copy B is older (generation 1 of 2)"]) if len(seen) == 1 else (entry, problems)
    monkeypatch.setattr(ModelTable, "_read_copies", mid_change)
    assert store.region.entry_problems() == []


def test_rm_all_is_refused_while_a_writer_opened_before_the_model_was_made_holds_its_name(store):
    """A writer opened on a model not made yet makes it at its first save, and holds the model's
    lock byte only a moment later: `rm --all` in between removed the model, and the job's first
    save failed with "no model"."""
    from ckptfs.errors import BusyError

    other = ckptfs.Store(store.path)  # another process's view: locks of its own
    try:
        w = other.writer("new")
        try:
            store.region.create_model("new", 4, 1 << 20)  # what its first save does, before its ring holds the model
            with pytest.raises(BusyError, match="has a writer open"):
                store.remove_model("new")
        finally:
            w.close()
    finally:
        other.close()
