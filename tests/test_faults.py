"""Tier 4: media faults -- flipped bits and zeroed blocks at rest (ckptfs.testing.faults).

Each damage is put into a copy of one known region (models ``m`` at steps 10..40 and ``other`` at
1, 2); the region is then opened with the real code. Nothing may ever load to wrong bytes; verify
names what is damaged (the tensor, for tensor bytes); nothing else is hidden; ``load(model)``
falls back to the newest intact version, with a warning.
"""
import logging
import torch
import os
import random

import pytest

import ckptfs
from ckptfs.errors import CorruptionError, RegionFormatError
from ckptfs.testing import faults as F
from ckptfs.testing.crashcheck import same
from ckptfs.testing.recording import copy_sparse

pytestmark = [pytest.mark.crash]

CAMPAIGN = int(os.environ.get("CKPTFS_FAULTS", "150"))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("faults") / "pristine.region")
    F.make_fault_region(path)
    return path


@pytest.fixture
def victim(pristine, tmp_path):
    path = str(tmp_path / "damaged.region")
    copy_sparse(pristine, path)
    return path


def _site(path, kind, model="m", step=None, tensor=None):
    for s in F.fault_sites(path):
        if s.kind == kind and (s.model in (model, None)) and (step is None or s.step == step) \
                and (tensor is None or s.tensor == tensor):
            return s
    raise LookupError(kind)


def _flip(path, offset, bit=0):
    assert F.inject(path, F.Fault(F.Site("x", offset, 1), "bit", offset, 1, bit))


def _zero(path, offset, length):
    F.inject(path, F.Fault(F.Site("x", offset, length), "zero", offset, length))


def test_flipped_bit_in_tensor_of_an_older_version(victim):
    site = _site(victim, "tensor", step=20, tensor="model.w")
    _flip(victim, site.offset + 1234, 3)
    with ckptfs.Store(victim) as s:
        problems = s.verify()
        assert [(p.model, p.step, p.tensor) for p in problems] == [("m", 20, "model.w")]
        with pytest.raises(CorruptionError, match="model.w"):
            s.load("m", 20)
        for step in (10, 30, 40):  # the others are untouched
            assert same(F.fault_state("m", step), s.load("m", step)) is None
        assert same(F.fault_state("m", 40), s.load("m")) is None


def test_zeroed_block_in_latest_falls_back_with_a_warning(victim, caplog):
    site = _site(victim, "tensor", step=40, tensor="model.w")
    _zero(victim, site.offset // 512 * 512 + 512, 512)
    with ckptfs.Store(victim) as s:
        assert [(p.step, p.tensor) for p in s.verify("m")] == [(40, "model.w")]
        with pytest.raises(CorruptionError, match="model.w"):
            s.load("m", 40)
        with caplog.at_level(logging.WARNING, logger="ckptfs"):
            state = s.load("m")
        assert same(F.fault_state("m", 30), state) is None
        assert "step 30" in caplog.text and "model.w" in caplog.text
        # and the model goes on: the next save is latest again
        with s.writer("m", max_inflight=1) as w:
            w.save(F.fault_state("m", 50), 50).result()
        assert same(F.fault_state("m", 50), s.load("m")) is None


def test_zeroed_block_spanning_tensors_names_each(victim):
    b = _site(victim, "tensor", step=30, tensor="model.b")
    ids = _site(victim, "tensor", step=30, tensor="model.ids")
    assert ids.offset - (b.offset + b.length) < 512
    _zero(victim, b.offset + b.length - 8, ids.offset - (b.offset + b.length) + 16)
    with ckptfs.Store(victim) as s:
        assert sorted(p.tensor for p in s.verify("m", 30)) == ["model.b", "model.ids"]


def test_damaged_index_of_latest(victim, caplog):
    site = _site(victim, "index", step=40)
    _flip(victim, site.offset + site.length // 2, 5)
    with ckptfs.Store(victim) as s:
        with caplog.at_level(logging.WARNING, logger="ckptfs"):
            assert s.latest("m").step == 30
            assert s.latest("m").step == 30 and s.load("m", 30) is not None
        # said once, not at every look at the latest (a command printed it up to 7 times)
        assert caplog.text.count("fails its checksum") == 1, caplog.text
        problems = s.verify()
        assert any(p.model == "m" and p.step == 40 and "index" in p.message for p in problems)
        assert any(p.model == "m" and "latest" in p.message for p in problems)
        assert not [p for p in problems if p.model == "other" or p.step in (10, 20, 30)]
        with pytest.raises(CorruptionError):
            s.load("m", 40)
        assert same(F.fault_state("m", 30), s.load("m")) is None
        assert same(F.fault_state("other", 2), s.load("other")) is None


@pytest.mark.parametrize("copy", ["header", "header-mirror"])
@pytest.mark.parametrize("byte", [0, 12, 20, 66, 88])  # magic, state, counter, manifest crc, own crc
def test_one_damaged_copy_of_a_slot_header_is_reported_and_repaired(victim, copy, byte, caplog):
    site = _site(victim, copy, step=20)
    _flip(victim, site.offset + byte, 1)
    with ckptfs.Store(victim) as s:
        assert [v.step for v in s.versions("m")] == [10, 20, 30, 40]  # the other copy holds it
        assert same(F.fault_state("m", 20), s.load("m", 20)) is None
        problems = s.verify("m")
        assert [p.step for p in problems] == [20] and "one copy of the header" in problems[0].message
        with caplog.at_level(logging.WARNING, logger="ckptfs"):
            s.writer("m").close()  # the model's next writer rewrites the damaged copy
        assert "rewritten from the intact copy" in caplog.text
        assert s.verify() == []


def test_both_copies_of_a_slot_header_damaged_lose_that_version_with_a_report(victim):
    for copy in ("header", "header-mirror"):
        _flip(victim, _site(victim, copy, step=20).offset + 20, 1)
    with ckptfs.Store(victim) as s:
        assert 20 not in [v.step for v in s.versions("m")]
        problems = s.verify("m")
        assert [p.step for p in problems] == [20] and "unreadable" in problems[0].message
        with pytest.raises(CorruptionError, match="header is unreadable"):
            s.load("m", 20)
        assert same(F.fault_state("m", 40), s.load("m")) is None
    # the command line says the same (export said "'m' has no step 20")
    from click.testing import CliRunner

    from ckptfs.cli import cli
    for args in (["export", "--step", "20", "m", "-", "--file", "metadata.json"], ["info", "--step", "20", "m"]):
        out = CliRunner().invoke(cli, [args[0], "--region", victim, *args[1:]], prog_name="ckptfs")
        assert out.exit_code != 0 and "version 20 of 'm' is damaged" in str(out.exception), (args, out.output)


def test_zeroed_header_pages_of_latest(victim, caplog):
    site = _site(victim, "header", step=40)
    _zero(victim, site.offset, 4096)  # one copy: nothing lost
    with ckptfs.Store(victim) as s:
        assert same(F.fault_state("m", 40), s.load("m")) is None
    _zero(victim, site.offset + 4096, 4096)  # and the other: step 40 is gone, load falls back
    with ckptfs.Store(victim) as s:
        with caplog.at_level(logging.WARNING, logger="ckptfs"):
            assert same(F.fault_state("m", 30), s.load("m")) is None
        assert "does not hold it" in caplog.text
        assert any("latest pointer" in p.message for p in s.verify("m"))


@pytest.mark.parametrize("copy", ["entry", "entry-mirror"])
@pytest.mark.parametrize("where", ["name", "magic", "extents"])
def test_one_damaged_copy_of_a_model_table_entry_is_reported_and_repaired(victim, copy, where, caplog):
    site = _site(victim, copy, model="other")
    _flip(victim, site.offset + {"name": 36, "magic": 2, "extents": 300}[where], 2)
    with ckptfs.Store(victim) as s:
        assert s.models() == ["m", "other"]
        problems = s.verify()
        assert [p.model for p in problems] == ["other"] and "copy" in problems[0].message
        assert same(F.fault_state("other", 2), s.load("other")) is None
        with caplog.at_level(logging.WARNING, logger="ckptfs"):
            s.writer("other").close()
        assert "repaired from the intact copy" in caplog.text
        assert s.verify() == []


@pytest.mark.parametrize("where", ["name", "magic", "extents"])
def test_both_copies_of_a_model_table_entry_damaged(victim, where):
    for copy in ("entry", "entry-mirror"):
        _flip(victim, _site(victim, copy, model="other").offset + {"name": 36, "magic": 2, "extents": 300}[where], 2)
    with ckptfs.Store(victim) as s:
        assert s.models() == ["m"]
        problems = s.verify()
        assert len(problems) == 1 and "entry" in problems[0].message
        if where != "name":
            assert problems[0].model == "other"  # the name is salvaged for the message
        with pytest.raises(CorruptionError, match="model table entry"):
            s.load("other")
        with pytest.raises(CorruptionError, match="model table entry"):
            s.versions("other", missing_ok=True)  # not "no such model": it may be this one
        assert same(F.fault_state("m", 40), s.load("m")) is None


def test_flipped_latest_pointer(victim, caplog):
    site = _site(victim, "latest-word")
    _flip(victim, site.offset + 2, 0)  # the counter part
    with ckptfs.Store(victim) as s:
        with caplog.at_level(logging.WARNING, logger="ckptfs"):
            assert same(F.fault_state("m", 40), s.load("m")) is None
        assert "latest pointer" in caplog.text
        assert any("latest pointer" in p.message for p in s.verify("m"))


def test_counter_past_any_pointer_refuses_saves(victim):
    site = _site(victim, "counter-word")
    _flip(victim, site.offset + 7, 4)  # bit 60
    with ckptfs.Store(victim) as s:
        assert any("counter" in p.message for p in s.verify("m"))
        with s.writer("m", max_inflight=1) as w:
            with pytest.raises(CorruptionError, match="counter"):
                w.save(F.fault_state("m", 50), 50)
        assert same(F.fault_state("m", 40), s.load("m")) is None  # nothing was written


@pytest.mark.parametrize("how", ["bit", "zero"])
def test_damaged_superblock_opens_from_backup(victim, how, caplog):
    if how == "bit":
        _flip(victim, 17, 6)  # region_bytes
    else:
        _zero(victim, 0, 4096)
    with caplog.at_level(logging.WARNING, logger="ckptfs"):
        s = ckptfs.Store(victim)
    with s:
        assert "backup" in caplog.text
        assert [p.model for p in s.verify()] == ["<region>"]
        for model, steps in F.MODELS.items():
            for step in steps:
                assert same(F.fault_state(model, step), s.load(model, step)) is None


def test_both_superblocks_damaged_is_a_clear_error(victim):
    size = os.path.getsize(victim)
    _zero(victim, 0, 4096)
    _flip(victim, size - 4096 + 40, 1)
    with pytest.raises(RegionFormatError, match="not a ckptfs region"):
        ckptfs.Store(victim)


def test_damaged_backup_superblock_is_reported(victim):
    _flip(victim, os.path.getsize(victim) - 4096 + 20, 0)
    with ckptfs.Store(victim) as s:
        assert [p.message for p in s.verify()] == [
            "the backup superblock in the region's last 4 KiB is missing or damaged (the region still works; "
            "re-create it to restore the copy)"]


@pytest.mark.slow
def test_random_fault_campaign():
    report = F.run_campaign(CAMPAIGN, seed=2024)
    assert report.failures == [], "\n".join(report.failures[:10])
    assert report.injected >= CAMPAIGN * 0.8
    assert report.detected >= report.injected * 0.35 and report.harmless >= report.injected * 0.15
    assert len(report.by_kind) == 15  # every kind of site was hit
    assert report.undetectable == 0 and report.repaired > 0


def test_the_fault_oracle_catches_unchecked_reads(pristine, tmp_path, monkeypatch):
    # A reader that skipped its checksums would return damaged bytes: the oracle must say so.
    from ckptfs.reader import VersionData
    real_restore = VersionData.restore
    monkeypatch.setattr(VersionData, "restore", lambda self, loc="cpu", verify=True, into=None, keys=None:
                        real_restore(self, loc, False, into, keys))
    site = _site(pristine, "tensor", step=20, tensor="model.w")
    victim = str(tmp_path / "v.region")
    copy_sparse(pristine, victim)
    fault = F.pick_fault(site, random.Random(1), "bit")
    assert F.inject(victim, fault)
    out = F.check_fault(victim, fault)
    assert any("WRONG BYTES" in f for f in out.failures), out.failures


@pytest.mark.fuse
def test_mount_refuses_damaged_bytes_with_eio(pristine, tmp_path):
    # reads through the mount must not hand out damaged tensor bytes either (EIO, not wrong data)
    import errno
    from conftest_mount import fuse_available, mounted

    if not fuse_available():
        pytest.skip("needs /dev/fuse and fusermount3")
    victim = str(tmp_path / "damaged.region")
    copy_sparse(pristine, victim)
    site = _site(victim, "tensor", step=20, tensor="model.w")
    _flip(victim, site.offset + 100, 2)
    with mounted(victim, str(tmp_path / "mnt")) as m:
        for name in ("checkpoint.pt", "state.safetensors", "model.safetensors"):
            with open(m / f"m/step-00000020/{name}", "rb") as f:
                with pytest.raises(OSError) as err:
                    f.read()
            assert err.value.errno == errno.EIO, name
        # the daemon's log names the damage, once (a reader sees only EIO)
        said = [line for line in m.log().splitlines() if "WARNING" in line and "model.w" in line]
        assert len(said) == 1, m.log()
        # the other versions read back exactly
        got = torch.load(m / "m/step-00000010/checkpoint.pt", weights_only=True)
        assert same(F.fault_state("m", 10), got) is None


def test_a_version_whose_index_is_damaged_is_marked_in_ls_and_not_kept(victim):
    """`ckptfs ls MODEL` marks a version whose index fails its checksum "damaged" (it was listed
    like any other), and keep refuses it as a milestone (it said "kept")."""
    from click.testing import CliRunner

    from ckptfs.cli import cli

    site = _site(victim, "index", step=20)
    _flip(victim, site.offset + site.length // 2, 5)
    with ckptfs.Store(victim) as s:
        versions = s.versions("m")
        assert s.damaged_indexes(versions) == {versions[1].counter}
        with pytest.raises(CorruptionError, match=r"step 20 of 'm' is damaged .*keep another version"):
            s.keep("m", 20)
        assert not [v for v in s.versions("m") if v.kept]
    out = CliRunner().invoke(cli, ["ls", "--region", victim, "m"], prog_name="ckptfs").output
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines()[1:]}
    assert rows["20"] == "damaged" and rows["40"] == "latest" and rows["10"] != "damaged", out
