"""Many ranks, one checkpoint (issue 14, first part): torch.distributed.checkpoint with ckptfs as
its storage, on real gloo process groups (one process per rank) and FSDP2 over a CPU mesh:
saved at one world size and loaded at others, bit-exact against the unsharded state; the global
version committed only once every rank's part is durable; DCP's metadata stored as JSON."""
import itertools
import json
import math
import os
import re
import subprocess
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)

import ckptfs
from ckptfs.errors import MalformedInputError
from ckptfs.testing.ranks import run_ranks, sharded, toy_model, train_steps
from conftest_mount import CLI, mounted, requires_fuse
from test_views import assert_same

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _node_store(regions, rank, world):
    """The store of ``rank``'s node: the ranks split evenly over ``regions`` (simulated nodes)."""
    return ckptfs.Store(regions[rank * len(regions) // world])


def _save_sharded(rank, world, regions, step, out):
    """FSDP2 + AdamW at ``world`` ranks, two training steps, dcp.save through ckptfs; rank 0 also
    writes the unsharded model and optimizer state (the reference) to ``out``."""
    model = sharded(toy_model(), world)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    train_steps(model, opt, 2, seed=7)
    msd, osd = get_state_dict(model, opt)
    with _node_store(regions, rank, world) as store:
        dcp.save({"model": msd, "optim": osd, "epoch": 4},
                 storage_writer=ckptfs.dcp.StorageWriter(store, "fsdp", step=step))
    full = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(full, out)


def _load_sharded(rank, world, regions, out):
    """Load the newest global version at ``world`` ranks (parts from any of ``regions``) and
    compare the unsharded state with the reference."""
    model = sharded(toy_model(), world)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    train_steps(model, opt, 1, seed=99)  # different values and optimizer state to overwrite
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "epoch": 0}
    mine = _node_store(regions, rank, world)
    peers = [ckptfs.Store(r) for r in regions if r != mine.path]
    with pytest.raises(ValueError, match="saved by many ranks: load it at every rank with group="):
        mine.load("fsdp", into=state)  # without group= in a job of many ranks
    dcp.load(state, storage_reader=ckptfs.dcp.StorageReader(mine, "fsdp", peers=peers))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:  # the unsharded state is gathered on rank 0 only
        ref_model, ref_optim = torch.load(out, weights_only=False)
        assert set(got[0]) == set(ref_model) and all(torch.equal(got[0][k], ref_model[k]) for k in ref_model)
        assert _flat(got[1]) == _flat(ref_optim) and len(_flat(ref_optim)) == 12 and state["epoch"] == 4
    for store in (mine, *peers):
        store.close()


def _flat(osd) -> list:
    """An optimizer state dict as comparable plain data (tensors as lists)."""
    out = []
    for key, entry in sorted(osd["state"].items()):
        for name, v in sorted(entry.items()):
            out.append((key, name, v.tolist() if isinstance(v, torch.Tensor) else v))
    return out


@pytest.mark.slow
@requires_fuse
def test_fsdp2_saved_at_4_ranks_loads_at_2_at_1_and_at_4_again(tmp_path):
    region = str(tmp_path / "r.region")
    ckptfs.Store.create(region, size_bytes=256 << 20).close()
    out = str(tmp_path / "full.pt")
    run_ranks(_save_sharded, 4, [region], 100, out)
    with ckptfs.Store(region) as store:
        assert [v.step for v in store.versions("fsdp")] == [100]
        assert sorted(m for m in store.models() if m.startswith(".")) == [f".fsdp.rank{r}" for r in range(4)]
    run_ranks(_load_sharded, 2, [region], out)
    run_ranks(_load_sharded, 4, [region], out)
    # and at world size 1, in this process, into the plain model: the unsharded weights
    model = toy_model()
    sd = {"model": model.state_dict()}
    with ckptfs.Store(region) as store:
        dcp.load(sd, storage_reader=ckptfs.dcp.StorageReader(store, "fsdp"))
    ref_model, ref_optim = torch.load(out, weights_only=False)
    assert all(torch.equal(sd["model"][k], ref_model[k]) for k in ref_model)
    # the mount: the unsharded model and optimizer state, whole, from the 4 ranks' parts
    full = {**{f"model.{k}": v for k, v in ref_model.items()},
            **{f"optim.state.{k}.{n}": v for k, entry in ref_optim["state"].items() for n, v in entry.items()}}
    whole = _check_whole_files(region, tmp_path / "mnt", "fsdp", full, ranks=4,
                               plain={"epoch": 4, "optim.param_groups": ref_optim["param_groups"]})
    # the mounted checkpoint.pt is what DCP's own converter (format_utils.dcp_to_torch_save:
    # an empty-state load planner, no process group) makes of the same checkpoint
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    converted: dict = {}
    with ckptfs.Store(region) as store:
        _load_state_dict(converted, storage_reader=ckptfs.dcp.StorageReader(store, "fsdp"),
                         planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    assert_same(converted, whole)


def _sorted(obj):
    """``obj`` with every dict's keys in sorted order (DCP's metadata orders the keys by FQN)."""
    if isinstance(obj, dict):
        return {k: _sorted(obj[k]) for k in sorted(obj)}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_sorted(v) for v in obj)
    return obj


def _save_replicated(rank, world, region, step):
    """DDP's case: every rank holds the same state; DCP's planner has one rank write it."""
    torch.manual_seed(0)
    state = {"w": torch.randn(256, 256), "b": torch.randn(256), "epoch": 3}
    with ckptfs.Store(region) as store:
        dcp.save(state, storage_writer=ckptfs.dcp.StorageWriter(store, "ddp", step=step))


def test_replicated_state_is_written_once_and_committed_after_every_part(tmp_path):
    region = str(tmp_path / "r.region")
    ckptfs.Store.create(region, size_bytes=256 << 20).close()
    run_ranks(_save_replicated, 2, region, 5)
    with ckptfs.Store(region) as store:
        parts = [v for m in store.models() if m.startswith(".ddp.rank") for v in store.versions(m)]
        assert sum(v.data_bytes for v in parts) < 1.1 * (256 * 256 + 256) * 4  # once, not twice
        (global_version,) = store.versions("ddp")
        assert global_version.latest and global_version.step == 5 and global_version.data_bytes == 0
        with store.open_version("ddp") as v:
            doc = json.loads(dict(v.manifest.files)["dcp-metadata.json"])  # JSON, never a pickle
        assert set(doc["state_dict"]) == {"w", "b", "epoch"}
        back = {"w": torch.zeros(256, 256), "b": torch.zeros(256), "epoch": 0}
        dcp.load(back, storage_reader=ckptfs.dcp.StorageReader(store, "ddp"))
        torch.manual_seed(0)
        assert torch.equal(back["w"], torch.randn(256, 256)) and back["epoch"] == 3


def test_a_step_whose_commit_failed_is_never_visible_and_its_parts_are_reclaimed(store, monkeypatch):
    from ckptfs.dist import storage

    state = {"w": torch.arange(10.0)}
    dcp.save(state, storage_writer=ckptfs.dcp.StorageWriter(store, "m", step=1))

    def lost(*args):  # the node's leader dies before the global commit
        raise RuntimeError("leader lost")

    monkeypatch.setattr(storage, "_record_here", lost)
    with pytest.raises(BaseException, match="leader lost|CheckpointException"):  # DCP wraps it
        dcp.save({"w": torch.arange(10.0) * 2}, storage_writer=ckptfs.dcp.StorageWriter(store, "m", step=2))
    monkeypatch.undo()
    assert [v.step for v in store.versions("m")] == [1]  # step 2 has a durable part, but no global version
    assert [v.step for v in store.versions(".m.rank0") if v.kept] == [1, 2]
    back = {"w": torch.zeros(10)}
    dcp.load(back, storage_reader=ckptfs.dcp.StorageReader(store, "m"))
    assert torch.equal(back["w"], torch.arange(10.0))
    dcp.save({"w": torch.arange(10.0) * 3}, storage_writer=ckptfs.dcp.StorageWriter(store, "m", step=3))
    assert [v.step for v in store.versions(".m.rank0") if v.kept] == [3]  # 1 superseded, 2 never completed
    dcp.load(back, storage_reader=ckptfs.dcp.StorageReader(store, "m"))
    assert torch.equal(back["w"], torch.arange(10.0) * 3)
    # an older step finishing after a newer one never wins
    older = ckptfs.dcp.StorageWriter(store, "m", step=2)  # asked for before step 4 ...
    dcp.save({"w": torch.arange(10.0) * 5}, storage_writer=ckptfs.dcp.StorageWriter(store, "m", step=4))
    dcp.save({"w": torch.arange(10.0) * 4}, storage_writer=older)  # ... finished after it
    assert store.latest("m").step == 4 and 2 not in [v.step for v in store.versions("m")]
    dcp.load(back, storage_reader=ckptfs.dcp.StorageReader(store, "m", step=1))  # a given global step
    assert torch.equal(back["w"], torch.arange(10.0))


def test_an_older_step_asked_for_after_the_newer_is_refused_and_a_late_milestone_too(store, caplog):
    """A process gone back (a load of step 1 after a loss spike at step 3) that saves step 2
    again: refused, with the way out (it was dropped in silence, with a future that
    succeeded, when this process had recorded step 3). A save asked for before a newer one that
    finishes after it is not recorded, said in the log; as a milestone (keep=True) it fails: a
    milestone never vanishes in silence."""
    for step in (1, 2, 3):
        dcp.save({"w": torch.full((4,), float(step))}, storage_writer=ckptfs.dcp.StorageWriter(store, "m", step=step))
    back = {"w": torch.zeros(4)}
    dcp.load(back, storage_reader=ckptfs.dcp.StorageReader(store, "m", step=1))
    with pytest.raises(BaseException, match=r"already at step 3 .*ckptfs rm --allow-latest m"):
        dcp.save({"w": torch.full((4,), 22.0)}, storage_writer=ckptfs.dcp.StorageWriter(store, "m", step=2))
    assert store.latest("m").step == 3
    late = ckptfs.dcp.StorageWriter(store, "m", step=3)
    milestone = ckptfs.dcp.StorageWriter(store, "m", step=4, keep=True)
    dcp.save({"w": torch.full((4,), 5.0)}, storage_writer=ckptfs.dcp.StorageWriter(store, "m", step=5))
    with caplog.at_level("WARNING", logger="ckptfs"):
        dcp.save({"w": torch.full((4,), 3.0)}, storage_writer=late)
    assert "step 3 of 'm' finished after step 5" in caplog.text
    with pytest.raises(BaseException, match=r"keep=True\) finished after step 5.*not recorded"):
        dcp.save({"w": torch.full((4,), 4.0)}, storage_writer=milestone)
    assert store.latest("m").step == 5 and 4 not in [v.step for v in store.versions("m")]


def test_dcp_metadata_codec_roundtrips_and_refuses_what_is_not_its_own(store):
    from ckptfs.dist.codec import (PlacedMetadata, decode_metadata, encode_index, encode_metadata,
                                   with_storage_data)

    state = {"w": torch.randn(3, 4, dtype=torch.bfloat16), "n": {"k": (1, "x")}, "t": torch.tensor(5)}
    dcp.save(state, storage_writer=ckptfs.dcp.StorageWriter(store, "c", step=1))
    meta = ckptfs.dcp.StorageReader(store, "c").read_metadata()
    assert decode_metadata(encode_metadata(meta)) == meta
    text = encode_metadata(meta)
    for bad in (text.replace('"codec":1', '"codec":9'), text[:-5], '{"codec":1}',
                text.replace('"bfloat16"', '"Tensor"')):
        with pytest.raises(MalformedInputError):
            decode_metadata(bad)
    with store.open_version("c") as v:
        raw = dict(v.manifest.files)["dcp-metadata.json"].encode()
    assert b"\x80" not in raw and raw.startswith(b"{")  # a JSON document, not a pickle
    # each commit's places go into the encoded document as it is: the same text as a round trip
    places = [(encode_index(i), {"pos": n}) for n, i in enumerate(meta.storage_data)]
    again = decode_metadata(text)
    again.storage_data = {i: {"pos": n} for n, i in enumerate(meta.storage_data)}
    assert with_storage_data(text, places) == encode_metadata(again)
    # a plan's later commits splice their counters into the document parsed once: the same text
    ranked = [(encode_index(i), {"rank": n % 2, "pos": n}) for n, i in enumerate(meta.storage_data)]
    placed = PlacedMetadata(text, ranked)
    for counters in ({0: 7, 1: 12}, {0: 123456789, 1: 0}):
        expected = [(index, {**place, "counter": counters[place["rank"]]}) for index, place in ranked]
        assert placed.render(counters) == with_storage_data(text, expected)
    with pytest.raises(MalformedInputError):
        with_storage_data(text.replace('"codec":1', '"codec":9'), places)


def test_a_store_closed_and_opened_again_in_one_process_saves_and_loads(store):
    """The writers kept across steps belong to the store that made them: a store opened again
    (a job's next phase, a notebook) writes through its own."""
    path = store.path
    dcp.save({"w": torch.ones(4)}, storage_writer=ckptfs.dcp.StorageWriter(store, "m", step=1))
    store.close()
    with ckptfs.Store(path) as again:
        dcp.save({"w": torch.full((4,), 2.0)}, storage_writer=ckptfs.dcp.StorageWriter(again, "m", step=2))
        back = {"w": torch.zeros(4)}
        dcp.load(back, storage_reader=ckptfs.dcp.StorageReader(again, "m"))
        assert torch.equal(back["w"], torch.full((4,), 2.0))


def test_a_one_process_version_reads_through_dcp_as_dcp_would_have_saved_it(store):
    """DCP metadata made from a one-process version's index: DCP's FQNs, each tensor one whole
    chunk, each other value a byte item holding torch.save of it; dcp.load fills a state dict of
    the same structure. What DCP cannot express is refused with the way."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    w = torch.arange(6.0).reshape(2, 3)
    with store.writer("plain") as writer:
        writer.save({"model": {"w": w, "tied": w}, "opt": {"groups": [{"lr": 0.5, "betas": (0.9, 0.99)}]},
                     "layers": [torch.ones(2), torch.zeros(1)], "step": 4}, step=1).result()
    md = ckptfs.dcp.StorageReader(store, "plain").read_metadata()
    assert set(md.state_dict_metadata) == {"model.w", "model.tied", "opt.groups.0.lr", "opt.groups.0.betas",
                                           "layers.0", "layers.1", "step"}
    tensor = md.state_dict_metadata["model.w"]
    assert isinstance(tensor, TensorStorageMetadata) and tensor.size == torch.Size([2, 3])
    assert [(c.offsets, c.sizes) for c in tensor.chunks] == [(torch.Size([0, 0]), torch.Size([2, 3]))]
    assert isinstance(md.state_dict_metadata["opt.groups.0.betas"], BytesStorageMetadata)
    into = {"model": {"w": torch.zeros(2, 3), "tied": torch.zeros(2, 3)}, "opt": {"groups": [{"lr": 0.0, "betas": ()}]},
            "layers": [torch.zeros(2), torch.ones(1)], "step": 0}
    dcp.load(into, storage_reader=ckptfs.dcp.StorageReader(store, "plain"), no_dist=True)
    assert_same(into, {"model": {"w": w, "tied": w}, "opt": {"groups": [{"lr": 0.5, "betas": (0.9, 0.99)}]},
                       "layers": [torch.ones(2), torch.zeros(1)], "step": 4})
    with store.writer("list") as writer:
        writer.save([torch.ones(1)], step=1).result()
        writer.save({"pair": (torch.ones(1), torch.zeros(1))}, step=2).result()
    with pytest.raises(ckptfs.errors.NotFoundError, match=r"step 2 of 'list' holds tensors inside 'pair' \(a tuple "
                                                          r"of tensors\).*load it with Store\.load"):
        ckptfs.dcp.StorageReader(store, "list").read_metadata()
    with pytest.raises(ckptfs.errors.NotFoundError, match=r"step 1 of 'list' holds a list, not a state dict"):
        ckptfs.dcp.StorageReader(store, "list", step=1).read_metadata()
    with pytest.raises(ckptfs.errors.NotFoundError):
        ckptfs.dcp.StorageReader(store, "nothing").read_metadata()
    assert os.path.basename(ckptfs.dist.part_model("gpt2", 3)) == ".gpt2.rank3"


@pytest.mark.slow
@requires_fuse
def test_two_nodes_each_record_the_global_version_and_load_across_them(tmp_path):
    regions = [str(tmp_path / "node0.region"), str(tmp_path / "node1.region")]
    for r in regions:
        ckptfs.Store.create(r, size_bytes=128 << 20).close()
    out = str(tmp_path / "full.pt")
    run_ranks(_save_sharded, 4, regions, 300, out)
    for node, r in enumerate(regions):
        with ckptfs.Store(r) as store:
            assert [(v.step, v.latest) for v in store.versions("fsdp")] == [(300, True)]  # each node records it
            assert sorted(m for m in store.models() if m.startswith(".")) == [
                f".fsdp.rank{k}" for k in (2 * node, 2 * node + 1)]  # each rank's part on its node
    run_ranks(_load_sharded, 4, regions, out)
    # the mount of one node's region cannot show whole tensors, and says where the parts are
    with mounted(regions[0], str(tmp_path / "mnt")) as m:
        files = sorted(os.listdir(m / "fsdp/latest"))
        parts = json.load(open(m / "fsdp/latest/dcp-parts.json"))
    # no file of whole tensors at all (checkpoint.pt was an empty dict); what says where the parts are
    assert {"checkpoint.pt", "state.safetensors", "model.safetensors", "hf"}.isdisjoint(files)
    assert {"metadata.json", "dcp-parts.json"} <= set(files)
    info = subprocess.run(CLI + ["info", "--region", regions[0], "fsdp"], capture_output=True, text=True)
    assert info.returncode == 0 and "whole    not shown here: the parts of rank(s) 2, 3" in info.stdout, info.stdout
    assert "left out" not in info.stdout and parts["not_shown"] == []  # "epoch" is no pickle: it is elsewhere
    export = subprocess.run(CLI + ["export", "--region", regions[0], "fsdp", str(tmp_path / "x.pt")],
                            capture_output=True, text=True)
    assert export.returncode == 1 and "has no checkpoint.pt here (the parts of rank(s) 2, 3" in export.stderr
    assert not os.path.exists(tmp_path / "x.pt")
    assert [(p["rank"], p["in_this_region"]) for p in parts["ranks"]] == [(0, True), (1, True), (2, False), (3, False)]
    assert "rank(s) 2, 3 are in another node's region" in parts["whole_tensors"]
    # a rank that cannot reach the other node's region says which part it misses
    with ckptfs.Store(regions[0]) as store:
        with pytest.raises(ckptfs.errors.NotFoundError, match=r"rank\(s\) 2, 3 are in another node's region"):
            store.load("fsdp")
        model = toy_model()
        with pytest.raises(BaseException, match="another node's"):  # in DCP's CheckpointException
            dcp.load({"model": model.state_dict()}, storage_reader=ckptfs.dcp.StorageReader(store, "fsdp"))


def _kill_state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(step * 10 + rank)
    return {f"w{rank}": torch.randn(64, 64, generator=g), "step": step}


KILL_POINTS = ["before its part", "while its part is written", "after its part, before the exchange",
               "after the exchange, before the acknowledgement"]


def _save_with_a_kill(rank, world, region, step, kill_at):
    """Both ranks save step ``step``; rank 1 is SIGKILLed at ``kill_at`` (None: nobody dies).
    Rank 0's save must fail (or succeed, when the kill came too late to matter), never hang."""
    import signal
    import threading

    from ckptfs.dist import storage

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    if rank == 1 and kill_at == KILL_POINTS[0]:
        storage.StorageWriter.write_data = die
    elif rank == 1 and kill_at == KILL_POINTS[1]:
        real_write = storage.StorageWriter.write_data

        def write_data(self, plan, planner):  # dies 1 ms into writing its part
            threading.Timer(0.001, die).start()
            return real_write(self, plan, planner)
        storage.StorageWriter.write_data = write_data
    elif rank == 1 and kill_at in KILL_POINTS[2:]:
        real, calls = storage.exchange, []

        def exchange(mine, group, what, *rest):
            calls.append(1)
            if len(calls) == (1 if kill_at == KILL_POINTS[2] else 2):
                die()
            return real(mine, group, what, *rest)
        storage.exchange = exchange
    with ckptfs.Store(region) as store:
        try:
            dcp.save(_kill_state(rank, step), storage_writer=ckptfs.dcp.StorageWriter(store, "k", step=step,
                                                                                       timeout_s=20))
        except BaseException as e:  # noqa: BLE001 - the survivor's save fails: that is the point
            if kill_at is None:
                raise
            print(f"rank {rank}: the save of step {step} failed as it should: {type(e).__name__}")


@pytest.mark.slow
def test_a_rank_killed_during_saves_leaves_the_newest_complete_step(tmp_path):
    """Rounds of two ranks saving, rank 1 SIGKILLed at each point of the protocol in turn; after
    every round the newest global version loads exactly what was saved at its step, and a later
    save succeeds and reclaims the parts of the steps that never completed."""
    region = str(tmp_path / "r.region")
    ckptfs.Store.create(region, size_bytes=128 << 20).close()
    run_ranks(_save_with_a_kill, 2, region, 1, None)
    complete = 1
    for n, kill_at in enumerate(KILL_POINTS * 13):  # 52 rounds
        step = 2 + n
        codes = run_ranks(_save_with_a_kill, 2, region, step, kill_at, may_die=frozenset({1}), timeout_s=120)
        assert codes[1] == -9, f"rank 1 was to be killed {kill_at}"
        with ckptfs.Store(region) as store:
            latest = store.latest("k").step
            assert latest in (complete, step)  # the last complete step, or this one if it completed
            complete = latest
            back = {"w0": torch.zeros(64, 64), "w1": torch.zeros(64, 64), "step": 0}
            dcp.load(back, storage_reader=ckptfs.dcp.StorageReader(store, "k"))
            assert back["step"] == complete
            assert torch.equal(back["w0"], _kill_state(0, complete)["w0"])
            assert torch.equal(back["w1"], _kill_state(1, complete)["w1"])
            assert store.verify() == []
            # failed attempts' parts do not pile up: each rank releases them at its next commit
            assert len([v for v in store.versions(".k.rank0") if v.kept]) <= 3
    run_ranks(_save_with_a_kill, 2, region, 100, None)
    with ckptfs.Store(region) as store:
        assert store.latest("k").step == 100
        kept = [(m, v.step) for m in (".k.rank0", ".k.rank1") for v in store.versions(m) if v.kept]
        assert kept == [(".k.rank0", 100), (".k.rank1", 100)]  # the rest reclaimed


def test_a_step_saved_again_after_a_failed_attempt_gives_back_the_attempts_parts(tmp_path):
    """A job preempted while it saved step 2 (rank 1 killed once its part was durable) resumes
    from step 1 and saves step 2 again, then step 3. The first attempt's parts of step 2 are
    hidden by the second's (a step saved twice lists the newer); they must still be given back,
    not stay kept, unlisted, for good (each a slot of the size of a rank's state)."""
    region = str(tmp_path / "r.region")
    ckptfs.Store.create(region, size_bytes=128 << 20).close()
    run_ranks(_save_with_a_kill, 2, region, 1, None)
    codes = run_ranks(_save_with_a_kill, 2, region, 2, KILL_POINTS[2], may_die=frozenset({1}), timeout_s=120)
    assert codes[1] == -9
    with ckptfs.Store(region) as store:
        assert store.latest("k").step == 1
        attempt = {m: [v.counter for v in store.versions(m) if v.step == 2] for m in (".k.rank0", ".k.rank1")}
        assert all(len(c) == 1 for c in attempt.values()), attempt  # each rank's part of the attempt is durable
    run_ranks(_save_with_a_kill, 2, region, 2, None)
    run_ranks(_save_with_a_kill, 2, region, 3, None)
    with ckptfs.Store(region) as store:
        assert store.latest("k").step == 3
        every = {m: store.versions(m, hidden=True) for m in (".k.rank0", ".k.rank1")}
        for m, versions in every.items():
            # the attempt's part is still there (hidden by the second save of step 2), given back
            assert [v.kept for v in versions if v.counter in attempt[m]] == [False], versions
            assert [v.step for v in versions if v.kept] == [3], versions
            assert [v.step for v in store.versions(m)] == [1, 2, 3]  # listed: the newer of each step
        back = {"w0": torch.zeros(64, 64), "w1": torch.zeros(64, 64), "step": 0}
        dcp.load(back, storage_reader=ckptfs.dcp.StorageReader(store, "k", step=2))
        assert back["step"] == 2 and torch.equal(back["w1"], _kill_state(1, 2)["w1"])


def _save_refused_as_older(rank, world, region, step):
    with ckptfs.Store(region) as store:
        with pytest.raises(BaseException, match=r"already at step \d+.*ckptfs rm --allow-latest k"):
            dcp.save(_kill_state(rank, step), storage_writer=ckptfs.dcp.StorageWriter(store, "k", step=step))


def test_a_job_rolled_back_removes_the_later_steps_and_saves_them_again(tmp_path):
    """A multi-rank job resumed from step 4 of 6 (a loss spike): its save of step 5 is refused
    (the region is at step 6: an older step would never become latest), with the way out;
    once steps 5 and 6 are removed (the latest on request), it saves 5 again and loads it."""
    region = str(tmp_path / "r.region")
    ckptfs.Store.create(region, size_bytes=128 << 20).close()
    for step in (4, 5, 6):
        run_ranks(_save_with_a_kill, 2, region, step, None)
    run_ranks(_save_refused_as_older, 2, region, 5)
    with ckptfs.Store(region) as store:
        for step in (6, 5):
            store.remove("k", step, allow_latest=True)
        assert store.latest("k").step == 4
        for m in (".k.rank0", ".k.rank1"):  # the new latest's parts kept, as a latest's are; the removed 6's not
            kept = [v.step for v in store.versions(m, hidden=True) if v.kept]  # (and the refused attempt's of 5)
            assert 4 in kept and 6 not in kept
    for step in (5, 6, 7):  # the parts of the removed steps go back at the commits of the steps after them
        run_ranks(_save_with_a_kill, 2, region, step, None)
    with ckptfs.Store(region) as store:
        assert [v.step for v in store.versions("k")][-3:] == [5, 6, 7] and store.latest("k").step == 7
        back = {"w0": torch.zeros(64, 64), "w1": torch.zeros(64, 64), "step": 0}
        dcp.load(back, storage_reader=ckptfs.dcp.StorageReader(store, "k", step=5))
        assert back["step"] == 5 and torch.equal(back["w0"], _kill_state(0, 5)["w0"])
        assert store.verify() == []
        for m in (".k.rank0", ".k.rank1"):
            assert [v.step for v in store.versions(m, hidden=True) if v.kept] == [7]


def test_a_job_restarted_again_and_again_at_one_step_does_not_fill_the_region(tmp_path):
    """A rank dies in every save of step 5 and the job is restarted each time: each attempt's
    parts were left kept until a later step committed, which never came; in a 64 MiB region of
    4 MiB parts the seventh attempt found no slot and every save after it, a healthy one too,
    waited 120 s and failed. Each process now gives back the earlier runs' abandoned parts at
    its first part (parts.release_earlier_runs)."""
    region = str(tmp_path / "r.region")
    ckptfs.Store.create(region, size_bytes=128 << 20).close()
    run_ranks(_save_with_a_kill, 2, region, 4, None)
    for _ in range(4):
        codes = run_ranks(_save_with_a_kill, 2, region, 5, KILL_POINTS[2], may_die=frozenset({1}), timeout_s=120)
        assert codes[1] == -9
    with ckptfs.Store(region) as store:
        for name in (".k.rank0", ".k.rank1"):
            kept = [(v.step, v.counter) for v in store.versions(name, hidden=True) if v.kept]
            assert [step for step, _ in kept] in ([4, 5], [4]), kept  # the latest's, and the last attempt's
    run_ranks(_save_with_a_kill, 2, region, 5, None)
    with ckptfs.Store(region) as store:
        assert store.latest("k").step == 5 and store.verify() == []


def _save_step_1_again(rank, world, region):
    state = {f"w{rank}": torch.full((64, 64), 7.0 + rank), "step": 1}
    with ckptfs.Store(region) as store:
        dcp.save(state, storage_writer=ckptfs.dcp.StorageWriter(store, "k", step=1))
        back = {f"w{rank}": torch.zeros(64, 64), "step": 0}
        dcp.load(back, storage_reader=ckptfs.dcp.StorageReader(store, "k"))
        assert torch.equal(back[f"w{rank}"], state[f"w{rank}"])


def _drop_part(store, name: str, counter: int) -> None:
    """The version ``counter`` of part model ``name`` goes, as when its ring reuses the slot."""
    (v,) = [v for v in store.region.committed(store.region.get(name)) if v.header.counter == counter]
    store.region.remove_version(v)


def _save_step_3_twice_while_reclaiming(rank, world, region):
    """ckptfs's writer saves step 3 twice in a row; each commit's reclaim (after the caller was
    told) is slowed, so that the second save's parts are written while the first's reclaim runs."""
    import time

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ckptfs.dist import parts

    real = parts.named_parts

    def slow(*args, **kwargs):  # reclaim reads the milestones first
        time.sleep(0.5)
        return real(*args, **kwargs)
    parts.named_parts = slow
    mesh = init_device_mesh("cpu", (world,))
    with ckptfs.Store(region) as store, store.writer("k", group=dist.group.WORLD) as w:
        for step, value in ((2, 1.0), (3, 3.0), (3, 5.0)):
            w.save({"w": distribute_tensor(torch.arange(4096.0) + value, mesh, [Shard(0)])}, step=step).result()
    dist.barrier()


def _save_remove_and_save_again(rank, world, region):
    """Steps 1 and 2 (2 saved twice, the first time not committed), the model removed, then
    steps 1 and 2 again in the same processes: the new model counts its versions from 1 again."""
    import torch.distributed as dist

    from ckptfs.dist import storage

    def save(store, step):
        dcp.save({"w": torch.full((64, 64), float(step)), "r": torch.tensor([rank])},
                 storage_writer=ckptfs.dcp.StorageWriter(store, "k", step=step))
    with ckptfs.Store(region) as store:
        save(store, 1)
        real = storage._record_here

        def failing(*args, **kwargs):
            raise OSError("injected: the leader's record failed")
        storage._record_here = failing
        with pytest.raises(BaseException, match="injected"):
            save(store, 2)  # the parts written, none committed: their counters run ahead of the model's
        storage._record_here = real
        save(store, 2)
        # the writers each process keeps for its saves keep the model from being removed: let go
        storage.close_idle_writers(store, "k")
        dist.barrier()
        if rank == 0:
            store.remove_model("k")
        dist.barrier()
        save(store, 1)
        save(store, 2)
        dist.barrier()


@pytest.mark.slow
@pytest.mark.parametrize("job", ["saved_again_while_reclaiming", "model_made_again"])
def test_the_latests_parts_stay_kept(tmp_path, job):
    """The parts the latest names stay kept (no ring reuses them) where a commit gives back the
    earlier saves' parts of its step: while the step is saved again (the next save's parts are
    newer than the latest's, not superseded), and after the model was removed and made again
    (its counters start again: what a process remembered of the earlier model's versions named
    other parts)."""
    from ckptfs.dist.parts import named_by

    region = str(tmp_path / "r.region")
    ckptfs.Store.create(region, size_bytes=128 << 20).close()
    run_ranks(_save_step_3_twice_while_reclaiming if job == "saved_again_while_reclaiming"
              else _save_remove_and_save_again, 2, region)
    with ckptfs.Store(region) as store:
        latest = store.latest("k")
        needed = named_by(store, "k", [(latest.step, latest.counter)])
        assert len(needed) == 2
        kept = {(name, v.counter) for name, _ in needed for v in store.versions(name, hidden=True) if v.kept}
        assert needed <= kept, (needed, kept)


def test_the_latest_step_saved_again_is_the_new_save_and_loads(tmp_path):
    """A job that saves the step it resumed at (the latest) again: its parts hide the first
    save's in the part models, so the step is recorded again, naming them. The first save's
    global version named parts that no listing found any more: loading the step failed ('the
    part of rank 0 ... is gone') although the save had succeeded."""
    region = str(tmp_path / "r.region")
    ckptfs.Store.create(region, size_bytes=128 << 20).close()
    run_ranks(_save_with_a_kill, 2, region, 1, None)
    run_ranks(_save_step_1_again, 2, region)
    with ckptfs.Store(region) as store:
        assert [v.step for v in store.versions("k")] == [1]
        assert store.load("k")["w1"].eq(8.0).all()  # the whole checkpoint in one process, too
        from ckptfs.dist.parts import named_by

        first, again = [(v.step, v.counter) for v in store.versions("k", hidden=True)]
        # the hidden first save's parts are found by its counter (what a removal of the step gives back)
        assert named_by(store, "k", [first]) and named_by(store, "k", [first]).isdisjoint(named_by(store, "k", [again]))
        # the first save's parts went back at the second's commit: kept, each save of the step
        # kept one more part for good (a job resumed at its latest step again and again)
        kept = [(".k.rank1", v.counter) for v in store.versions(".k.rank1", hidden=True) if v.kept]
        assert len(kept) == 1 and kept[0] in named_by(store, "k", [again]), kept
        # the first save's part reused by its ring: the step still loads, and verifies
        (gone,) = [c for name, c in named_by(store, "k", [first]) if name == ".k.rank1"]
        _drop_part(store, ".k.rank1", gone)
        assert store.load("k") and store.verify("k", 1) == [] and store.verify("k") == []
    run_ranks(_save_with_a_kill, 2, region, 2, None)
    with ckptfs.Store(region) as store:  # the first save's parts of step 1 went back at step 2's commit
        assert [(v.step, v.kept) for v in store.versions(".k.rank1", hidden=True) if v.kept] == [(2, True)]


def _save_disagreeing(rank, world, region, what):
    step = 7 + (rank if what == "step" else 0)
    model = "agree" + (str(rank) if what == "model" else "")
    with ckptfs.Store(region) as store:
        # ranks that count steps (or name the model) differently fail at once, every time
        with pytest.raises(BaseException, match=f"do not save the same {what}.*rank\\(s\\) 0.*rank\\(s\\) 1"):
            dcp.save({f"w{rank}": torch.ones(3)}, storage_writer=ckptfs.dcp.StorageWriter(store, model, step=step))
        assert [m for m in store.models() if not m.startswith(".")] == []  # nothing committed
        if what == "step":
            # rank 1 skipped step 10 (its state-dict code raised, and the loop went on) after both
            # saved step 9: rank 0's step 10 fails at once, and rank 1 waits at step 11, rank
            # 0's next save (every later save paired rank 0's step N with rank 1's N+1)
            dcp.save({f"w{rank}": torch.ones(3)}, storage_writer=ckptfs.dcp.StorageWriter(store, model, step=9))
            if rank == 0:
                with pytest.raises(BaseException, match="step 10 of 'agree' was skipped by rank\\(s\\) 1, which "
                                                        "save step 11 already.*nothing was committed"):
                    dcp.save({"w0": torch.ones(3)}, storage_writer=ckptfs.dcp.StorageWriter(store, model, step=10))
            dcp.save({f"w{rank}": torch.ones(3)}, storage_writer=ckptfs.dcp.StorageWriter(store, model, step=11))
            assert [v.step for v in store.versions(model)] == [9, 11]
        with pytest.raises(BaseException, match=f"do not load the same {what}.*rank\\(s\\) 0.*rank\\(s\\) 1.*"
                                                f"StorageReader; nothing was read"):
            dcp.load({f"w{rank}": torch.ones(3)}, storage_reader=ckptfs.dcp.StorageReader(store, model, step=step))


class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("cannot pickle this")


def _one_rank_cannot_write_its_state(rank, world, region):
    """Rank 1's state holds a value that cannot be written (its pickling raises) at step 2: every
    rank fails at once, naming it (the others waited for its part until timeout_s, and the
    coordination group was broken: every later save failed), and step 3 saves."""
    with ckptfs.Store(region) as store:
        for step in (1, 2, 3):
            state = {"w": torch.full((4,), float(step)), "extra": _Unpicklable() if (rank, step) == (1, 2) else 0}
            writer = ckptfs.dcp.StorageWriter(store, "m", step=step, timeout_s=60)
            if step != 2:
                dcp.save(state, storage_writer=writer)
                continue
            started = time.monotonic()
            with pytest.raises(BaseException, match="step 2 of 'm' was not committed: rank 1: .*cannot pickle this"):
                dcp.save(state, storage_writer=writer)
            assert time.monotonic() - started < 20
        assert [v.step for v in store.versions("m")] == [1, 3]


def test_a_rank_whose_state_cannot_be_written_fails_every_rank_at_once(tmp_path):
    region = str(tmp_path / "r.region")
    ckptfs.Store.create(region, size_bytes=64 << 20).close()
    run_ranks(_one_rank_cannot_write_its_state, 2, region)


def _async_save_while_training(rank, world, region, kind):
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    model = sharded(toy_model(), world)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    import torch.distributed as dist

    ckpt_group = dist.new_group(backend="gloo")  # DCP's advice for async_save: its own group
    with ckptfs.Store(region) as store:
        # two steps: the second reuses what the first set up (with "process", DCP's background
        # process per rank and the store and writers it opened there)
        for step in (1, 2):
            train_steps(model, opt, 1, seed=step)
            msd, _ = get_state_dict(model, opt)
            expected = {k: v.full_tensor().clone() for k, v in msd.items()}
            fut = dcp.async_save({"model": msd}, process_group=ckpt_group,
                                 storage_writer=ckptfs.dcp.StorageWriter(store, "async", step=step, group=ckpt_group),
                                 async_checkpointer_type=AsyncCheckpointerType(kind))
            train_steps(model, opt, 3, seed=10 + step)  # training goes on while the checkpoint is written
            fut.result()
        assert [v.step for v in store.versions("async")] == [1, 2]
        back = {"model": get_state_dict(model, opt)[0]}
        dcp.load(back, storage_reader=ckptfs.dcp.StorageReader(store, "async"))
        assert all(torch.equal(back["model"][k].full_tensor(), expected[k]) for k in expected)  # the step-2 state


@pytest.mark.parametrize("what", ["step", "model"])
def test_ranks_that_disagree_on_step_or_model_commit_nothing(tmp_path, what):
    region = str(tmp_path / "r.region")
    ckptfs.Store.create(region, size_bytes=64 << 20).close()
    run_ranks(_save_disagreeing, 2, region, what)


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_async_save_while_training_continues(tmp_path, kind):
    """DCP's async_save with ckptfs storage, from a thread or (``AsyncCheckpointerType.PROCESS``)
    from a background process per rank: the StorageWriter travels there as its region's path."""
    region = str(tmp_path / "r.region")
    ckptfs.Store.create(region, size_bytes=64 << 20).close()
    run_ranks(_async_save_while_training, 2, region, kind)


def test_the_commits_of_saves_in_flight_never_wait_for_each_other(tmp_path, monkeypatch):
    """Three async_saves of three models in flight at once (a model, its EMA, ...): their commits
    all run together. Across ranks, one commit queued behind two others could wait for a rank
    whose running commits wait for it; here each commit waits until all three have started."""
    from ckptfs.dist.storage import StorageWriter

    started = threading.Barrier(3, timeout=20)
    commit = StorageWriter.commit

    def commit_once_all_started(self, *args, **kwargs):
        started.wait()
        return commit(self, *args, **kwargs)

    monkeypatch.setattr(StorageWriter, "commit", commit_once_all_started)
    with ckptfs.Store.create(str(tmp_path / "r.region"), size_bytes=64 << 20) as store:
        futures = [dcp.async_save({"w": torch.full((4,), float(i))}, storage_writer=StorageWriter(store, f"m{i}", step=1))
                   for i in range(3)]
        for f in futures:
            f.result(timeout=60)
        assert [store.load(f"m{i}")["w"].tolist() for i in range(3)] == [[float(i)] * 4 for i in range(3)]


def _saves_across_process_groups(rank, world, region, store_file):
    """Two process groups one after the other in each rank's process (a job that re-forms its
    group after a peer's failure, a notebook that starts again): the saves and loads of the
    second use groups of the second, not ones made in the first and destroyed with it."""
    import torch.distributed as dist

    with ckptfs.Store(region) as store:
        for run in range(2):
            if run:  # the first group is run_ranks's; the second a new one, over a file store
                dist.destroy_process_group()
                dist.init_process_group("gloo", store=dist.FileStore(store_file, world), rank=rank, world_size=world)
            state = {"w": torch.arange(8.0) + 10 * run}  # replicated: the same on every rank
            dcp.save(state, storage_writer=ckptfs.dcp.StorageWriter(store, "regroup", step=run + 1))
            back = {"w": torch.zeros(8)}
            dcp.load(back, storage_reader=ckptfs.dcp.StorageReader(store, "regroup"))
            assert torch.equal(back["w"], state["w"])
            with store.writer("own", group=dist.group.WORLD) as w:
                w.save({"w": state["w"]}, step=run + 1).result()
            back = {"w": torch.zeros(8)}
            store.load("own", group=dist.group.WORLD, into=back)
            assert torch.equal(back["w"], state["w"])


def test_saves_and_loads_in_a_process_group_made_again(tmp_path):
    region = str(tmp_path / "r.region")
    ckptfs.Store.create(region, size_bytes=64 << 20).close()
    run_ranks(_saves_across_process_groups, 2, region, str(tmp_path / "second-group"))


def _save_dtensors(rank, world, region, out):
    """DTensors placed Shard(0), Shard(1) and Replicate() over the ranks, saved through ckptfs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(5)
    full = {"rows": torch.randn(64, 48), "cols": torch.randn(48, 64), "rep": torch.randn(1000)}
    placed = {"rows": distribute_tensor(full["rows"], mesh, [Shard(0)]),
              "cols": distribute_tensor(full["cols"], mesh, [Shard(1)]),
              "rep": distribute_tensor(full["rep"], mesh, [Replicate()])}
    with ckptfs.Store(region) as store:
        dcp.save(placed, storage_writer=ckptfs.dcp.StorageWriter(store, "dt", step=1))
    if rank == 0:
        torch.save(full, out)


@requires_fuse
def test_dtensors_sharded_on_either_dimension_or_replicated(tmp_path):
    region = str(tmp_path / "r.region")
    ckptfs.Store.create(region, size_bytes=64 << 20).close()
    out = str(tmp_path / "full.pt")
    run_ranks(_save_dtensors, 2, region, out)
    full = torch.load(out)
    back = {k: torch.zeros_like(v) for k, v in full.items()}
    with ckptfs.Store(region) as store:
        dcp.load(back, storage_reader=ckptfs.dcp.StorageReader(store, "dt"))  # one process: whole tensors
        parts = sum(v.data_bytes for r in (0, 1) for v in store.versions(f".dt.rank{r}"))
    assert all(torch.equal(back[k], full[k]) for k in full)
    assert parts < 1.2 * sum(t.numel() * 4 for t in full.values())  # the replicated one written once
    _check_whole_files(region, tmp_path / "mnt", "dt", full)


def _load_rows_counting_reads(rank, world, region, out):
    """Load the ``w`` saved by one process as a Shard(0) DTensor over ``world`` ranks, counting
    the bytes this rank reads from the region."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.load(out)
    state = {"w": distribute_tensor(torch.zeros_like(full["w"]), mesh, [Shard(0)])}
    with ckptfs.Store(region) as store:
        reads = []
        real = store.region.backend.read_direct
        store.region.backend.read_direct = lambda at, view: (reads.append(len(view)), real(at, view))[1]
        dcp.load(state, storage_reader=ckptfs.dcp.StorageReader(store, "rows"))
    assert torch.equal(state["w"].to_local(), full["w"].chunk(world)[rank])
    # the stored tensor is 16 MiB in four blocks with CRCs of their own: this rank's rows are
    # two of them, read and checked alone (the whole tensor before block CRCs)
    assert 8 << 20 <= sum(reads) <= (8 << 20) + (64 << 10), reads


def test_a_resharded_load_reads_only_the_blocks_of_its_rows(tmp_path):
    """A rank that needs some rows of a stored tensor reads the blocks that hold them, each
    checked against its own CRC, not the whole tensor (a W=4 shard read at W=2 needs a row or
    two of its neighbour's shard)."""
    region = str(tmp_path / "r.region")
    out = str(tmp_path / "full.pt")
    full = {"w": torch.randn(4096, 1024)}  # 16 MiB: four 4 MiB blocks of 1024 rows
    torch.save(full, out)
    with ckptfs.Store.create(region, size_bytes=64 << 20) as store:
        dcp.save(full, storage_writer=ckptfs.dcp.StorageWriter(store, "rows", step=1))
    run_ranks(_load_rows_counting_reads, 2, region, out)


def _check_whole_files(region, mnt, model, full, ranks=2, plain=None) -> dict:
    """The mount shows the multi-rank version's tensors whole: checkpoint.pt and state.safetensors
    equal ``full`` (by dotted FQN), checkpoint.pt's other values ``plain`` (by dotted path), the
    zip entries' CRCs and metadata.json's are the whole tensors' own (unzip -t), and
    dcp-parts.json names every rank's part and leaves nothing out. Returns checkpoint.pt's state."""
    import subprocess
    import zlib

    from safetensors.torch import load_file

    with mounted(region, str(mnt)) as m:
        version = m / f"{model}/latest"
        # copied while mounted: a page of an mmap'd tensor first touched after the unmount is a
        # bus error (it was, once, in a fresh venv's run, where the pages were not yet resident)
        pt = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in
              _dotted(torch.load(os.path.join(version, "checkpoint.pt"), weights_only=True, mmap=True)).items()}
        state = torch.load(os.path.join(version, "checkpoint.pt"), weights_only=True)
        st = load_file(os.path.join(version, "state.safetensors"))
        meta = json.load(open(os.path.join(version, "metadata.json")))
        parts = json.load(open(os.path.join(version, "dcp-parts.json")))
        test = subprocess.run(["unzip", "-tq", os.path.join(version, "checkpoint.pt")], capture_output=True, text=True)
        own = [_dotted(torch.load(os.path.join(version, f"parts/rank-{r:05d}/checkpoint.pt"), weights_only=True))
               for r in range(ranks)]
    # each rank's own files: its shards, named by FQN and their place in the whole tensor
    seen = set()
    for shards in own:
        for name, shard in shards.items():
            fqn, _, at = name.partition("@")
            offsets = [int(x) for x in at.split(",")] if at else [0] * shard.dim()
            where = tuple(slice(o, o + n) for o, n in zip(offsets, shard.shape))
            assert torch.equal(full[fqn][where], shard), name
            seen.add(fqn)
    assert seen == set(full)
    assert {k: v for k, v in pt.items() if not isinstance(v, torch.Tensor)} == (plain or {})
    assert {k for k, v in pt.items() if isinstance(v, torch.Tensor)} == set(st) == set(full)
    for k, v in full.items():
        assert torch.equal(pt[k], v) and torch.equal(st[k], v), k
    crcs = {t["name"]: t["crc32"] for t in meta["tensors"]}
    assert crcs == {k: f"{zlib.crc32(v.numpy().tobytes()):08x}" for k, v in full.items()}
    assert test.returncode == 0, test.stdout + test.stderr
    assert [p["rank"] for p in parts["ranks"]] == list(range(ranks)) and all(p["in_this_region"] for p in parts["ranks"])
    assert parts["not_shown"] == []
    return state


def _dotted(obj, prefix="") -> dict:
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items() for k, v in _dotted(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: obj}


def test_ls_hides_the_ranks_parts_unless_asked(store, capsys):
    from test_cli import run

    dcp.save({"w": torch.ones(4)}, storage_writer=ckptfs.dcp.StorageWriter(store, "m", step=1))
    code, out, _ = run(capsys, "ls", "--region", store.path)
    assert code == 0 and [line.split()[0] for line in out.splitlines()[1:]] == ["m"]
    assert "in 1 rank(s)" in out  # a DCP checkpoint's size is its parts'
    code, out, _ = run(capsys, "ls", "--region", store.path, "m")
    assert code == 0 and "in 1 rank(s)" in out.splitlines()[1]
    code, out, _ = run(capsys, "ls", "-a", "--region", store.path)
    assert [line.split()[0] for line in out.splitlines()[1:]] == [".m.rank0", "m"]
    # a version that goes between the listing and the look at its parts (a job saving every
    # half second: its ring reused the slot) is left out; `ls` failed with "has no step 1"
    dcp.save({"w": torch.ones(4)}, storage_writer=ckptfs.dcp.StorageWriter(store, "m", step=2))
    real = ckptfs.dist.parts.checkpoint_bytes

    def gone_meanwhile(store, model, step):
        if step == 1:
            raise ckptfs.errors.NotFoundError(f"{model!r} has no step 1")
        return real(store, model, step)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ckptfs.dist.parts, "checkpoint_bytes", gone_meanwhile)
        code, out, err = run(capsys, "ls", "--region", store.path, "m")
    assert code == 0 and [line.split()[0] for line in out.splitlines()[1:]] == ["2"], (out, err)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_whole_tensor_pieces_reassemble_any_grid_of_chunks(data):
    """A whole tensor from its chunks (ckptfs.dist.whole._pieces): any shape, split along any
    dims into uneven blocks (empty ones included), each chunk in a part of its own, comes back
    byte for byte; a chunk missing is refused."""
    from ckptfs.dist.whole import _Chunk, _pieces
    from ckptfs.errors import CorruptionError
    from ckptfs.manifest import TensorRecord

    shape = tuple(data.draw(st.lists(st.integers(0, 5), max_size=3)))
    cuts = [sorted(set(data.draw(st.lists(st.integers(0, n), max_size=3)))) for n in shape]
    bounds = [list(zip([0, *c], [*c, n])) for c, n in zip(cuts, shape)]
    whole = torch.arange(max(1, torch.Size(shape).numel()), dtype=torch.int16)[:torch.Size(shape).numel()].reshape(shape)
    chunks, parts = [], []
    for block in itertools.product(*bounds):
        offsets = tuple(lo for lo, _ in block)
        sizes = tuple(hi - lo for lo, hi in block)
        piece = whole[tuple(slice(lo, hi) for lo, hi in block)].contiguous()
        parts.append(piece.numpy().tobytes())
        chunks.append(_Chunk(offsets, sizes, len(parts) - 1, TensorRecord("c", "int16", sizes, 0, len(parts[-1]))))
    got = b"".join(parts[p.part][p.offset:p.offset + p.nbytes] for p in _pieces(shape, 2, chunks))
    assert got == whole.numpy().tobytes()
    live = [c for c in chunks if math.prod(c.sizes)]
    if len(live) > 1:
        with pytest.raises(CorruptionError):
            _pieces(shape, 2, [c for c in chunks if c is not live[-1]])


def test_info_export_and_verify_of_a_multi_rank_version(store, capsys, tmp_path):
    """`ckptfs info` lists the whole tensors, `export` writes them whole, `verify MODEL` checks
    the ranks' parts too and finds a flipped byte in one; an export of the damaged version fails
    and leaves nothing."""
    from test_cli import flip_a_tensor_byte, run

    full = {"w": torch.randn(64, 32), "b": torch.arange(10.0)}
    dcp.save(full, storage_writer=ckptfs.dcp.StorageWriter(store, "m", step=7))
    code, out, _ = run(capsys, "info", "--region", store.path, "m")
    assert code == 0 and "in 2 tensors" in out and "dcp-parts.json" in out
    assert "data     8.0 KiB in 2 tensors" in out, out  # the tensors' bytes, as ls counts them
    assert {line.split()[0] for line in out.splitlines() if line.startswith(("w ", "b "))} == {"w", "b"}
    assert run(capsys, "export", "--region", store.path, "m", str(tmp_path / "out") + "/")[0] == 0
    back = torch.load(tmp_path / "out" / "checkpoint.pt", weights_only=True)
    assert all(torch.equal(back[k], v) for k, v in full.items()) and set(back) == set(full)
    assert run(capsys, "verify", "--region", store.path, "m")[0] == 0
    store.close()
    flip_a_tensor_byte(store.path, ".m.rank0", 7, "items.0")
    code, _, err = run(capsys, "verify", "--region", store.path, "m", "--step", "7")
    assert code == 1 and re.search(r"\.m\.rank0 step 7 tensor (w|b) \(the part of rank 0\): ", err), err
    code, _, err = run(capsys, "export", "--region", store.path, "m", str(tmp_path / "bad") + "/")
    assert code != 0 and re.search(r"(w|b) \(the part of rank 0\)' of .m.rank0 step 7 fails its checksum", err), err
    assert not os.path.exists(tmp_path / "bad") or not os.listdir(tmp_path / "bad")
    with ckptfs.Store(store.path) as again:  # a load reads through the same checks
        back = {"w": torch.zeros(64, 32), "b": torch.zeros(10)}
        with pytest.raises(BaseException, match=r"'(w|b) \(the part of rank 0\)' of .m.rank0 step 7 fails its checksum"):
            dcp.load(back, storage_reader=ckptfs.dcp.StorageReader(again, "m"))


_plain = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False) | st.text(max_size=3),
                      lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner)
                      | st.dictionaries(st.text(max_size=2), inner, max_size=2), max_leaves=6)
_states = st.recursive(st.builds(torch.full, st.tuples(st.integers(1, 3)), st.floats(-9, 9)) | _plain,
                       lambda inner: st.lists(inner, min_size=1, max_size=3)  # a dict's keys: str, or int
                       | st.dictionaries(st.text("ab0", min_size=1, max_size=2), inner, min_size=1, max_size=3)
                       | st.dictionaries(st.integers(0, 3), inner, min_size=1, max_size=3), max_leaves=10)


@settings(max_examples=100, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink])
@given(st.dictionaries(st.text("xyz", min_size=1, max_size=2), _states, min_size=1, max_size=3))
def test_the_whole_states_nesting_is_dcps_own(state):
    """The whole view's skeleton, built from DCP's key paths (planner data) with each byte
    item's plain value, unflattens to exactly what DCP's own unflattening makes of the same
    flattened state: lists stay lists, tuples tuples, dict keys become str."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict

    from ckptfs.dist.whole import _skeleton
    from ckptfs.flatten import plain_node
    from ckptfs.skeleton import unflatten

    flat, mappings = flatten_state_dict(state)
    tensors, paths = [], []
    for fqn, value in flat.items():
        if isinstance(value, torch.Tensor):
            paths.append((mappings[fqn], {"tensor": len(tensors)}))
            tensors.append(value)
        else:
            paths.append((mappings[fqn], plain_node(value)))
    assert_same(unflatten_state_dict(flat, mappings), unflatten(_skeleton(paths), tensors))


def test_a_multi_rank_version_loads_whole_in_one_process_with_its_plain_values(store, tmp_path, monkeypatch, capsys):
    """Store.load of a DCP checkpoint in one process: its whole state, with the byte items that
    are plain data (stored by the parts in the index's encoding, never unpickled), nested as
    DCP's own unflattening does (lists, dicts of str keys); the rest left out with a warning,
    and loaded by into= (through DCP). A part whose values hold a tensor reference is refused."""
    from test_cli import run

    w = torch.arange(6.0)
    state = {"w": w, "epoch": 3, "groups": [{"lr": 0.1, "betas": (0.9, 0.99)}, {"lr": 0.2, "betas": (0.8, 0.9)}],
             "sparse": {0: w + 1, 2: w + 2}, "cfg": {"tag": None, "ids": [1, 2], "on": True}, "z": 1j,
             # torch's and numpy's small objects (ckptfs.leaves) are plain data too
             "rng": np.random.RandomState(3).get_state(), "amp": {"dtype": torch.bfloat16, "shape": torch.Size([2])},
             "best": np.float32(0.5)}
    dcp.save(state, storage_writer=ckptfs.dcp.StorageWriter(store, "m", step=1, extra={"config.json": {"n": 1}}))
    # hf/ holds the saver's extras, not ckptfs's records of the ranks' parts
    from ckptfs.dist.whole import as_whole, version_files
    from ckptfs.views import files_for

    whole, _ = as_whole(store, store.open_version("m"))
    with whole:
        names = set(version_files(whole, files_for))
    assert {"config.json", "dcp-metadata.json", "dcp-parts.json", "hf/config.json"} <= names
    assert not any(n.startswith("hf/dcp-") for n in names)
    # DCP's key paths keep a list's indices and make every dict key a str (as dcp_to_torch_save)
    expected = {**{k: v for k, v in state.items() if k != "z"}, "sparse": {"0": w + 1, "2": w + 2}}
    with pytest.warns(UserWarning, match=r"m step 1: left out z \(values that are not plain data, kept as DCP's "
                                         r"pickles"):
        back = store.load("m")
    assert_same(_sorted(expected), _sorted(back))
    into = {"w": torch.zeros(6), "epoch": 0, "groups": [{"lr": 0.0, "betas": (0.0, 0.0)}, {"lr": 0.0, "betas": ()}],
            "sparse": {0: torch.zeros(6), 2: torch.zeros(6)}, "cfg": {"tag": 1, "ids": [], "on": False}, "z": 0,
            "rng": None, "amp": {"dtype": None, "shape": None}, "best": 0.0}
    assert store.load("m", into=into) is into
    assert_same(state, into)
    # the CLI says what the whole files leave out; it exported them in silence
    code, _, err = run(capsys, "export", "--region", store.path, "m", str(tmp_path / "m.pt"))
    assert code == 0 and err.startswith("ckptfs: warning: m step 1: left out z (values that are not plain "), err
    assert_same(_sorted(expected), _sorted(torch.load(tmp_path / "m.pt", weights_only=False)))  # numpy's too
    code, out, _ = run(capsys, "info", "--region", store.path, "m")
    assert code == 0 and "left out z (values that are not plain data" in out
    assert run(capsys, "info", "--region", store.path, "m", "--json")[1].count('"not_shown": [\n  "z"\n ]') == 1
    # a part whose values are not plain data (a tensor reference into the part) is refused
    real = ckptfs.dist.parts.part_state
    monkeypatch.setattr(ckptfs.dist.parts, "part_state",
                        lambda tensors, values: real(tensors, {k: torch.ones(1) for k in values}))
    dcp.save(state, storage_writer=ckptfs.dcp.StorageWriter(store, "m", step=2))
    with pytest.raises(ckptfs.errors.CorruptionError, match="not plain data"):
        store.load("m", step=2)


# ------------------------------------------------------------------------------ parts given back, parts kept


def _save_sharded_steps(rank, world, region, steps, keep=()):
    """Each rank saves a row-sharded tensor (its rows hold the step), a rank-local part per rank."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    with ckptfs.Store(region) as store:
        for s in steps:
            w = distribute_tensor(torch.full((8, 4), float(s)), mesh, [Shard(0)])
            dcp.save({"w": w}, storage_writer=ckptfs.dcp.StorageWriter(store, "m", step=s, keep=s in keep))


def _load_step(rank, world, region, step):
    with ckptfs.Store(region) as store:
        back = {"w": torch.zeros(8, 4)}
        dcp.load(back, storage_reader=ckptfs.dcp.StorageReader(store, "m", step=step))
        assert torch.equal(back["w"], torch.full((8, 4), float(step)))


def test_a_job_resumed_at_fewer_ranks_gives_back_the_parts_of_the_others(tmp_path):
    """Saved at 4 ranks, resumed at 2: the part models of ranks 2 and 3 held their last parts
    kept for good (their slots never reused). Once no global version names them, they go."""
    region = str(tmp_path / "r.region")
    ckptfs.Store.create(region, size_bytes=128 << 20).close()
    run_ranks(_save_sharded_steps, 4, region, [1, 2])
    with ckptfs.Store(region) as store:
        free_at_4 = store.status()["free_bytes"]
    run_ranks(_save_sharded_steps, 2, region, [3])
    with ckptfs.Store(region) as store:  # step 2, at 4 ranks, is still a version: its parts stay
        assert {".m.rank2", ".m.rank3"} <= set(store.models())
    run_ranks(_load_step, 1, region, 2)
    run_ranks(_save_sharded_steps, 2, region, [4, 5, 6])
    with ckptfs.Store(region) as store:
        assert 2 not in [v.step for v in store.versions("m")]
        assert sorted(m for m in store.models() if m.startswith(".")) == [".m.rank0", ".m.rank1"]
        assert store.status()["free_bytes"] > free_at_4  # the two rings' space is back
    run_ranks(_load_step, 2, region, 6)


def test_a_model_saved_on_by_one_process_gives_back_the_parts_no_version_names(tmp_path):
    """Saved at 2 ranks (step 1 kept, then unkept), then fine-tuned on by one process under the
    same name: once its ring reuses the global versions, their parts go back, and the part
    models with them. They stayed kept for good, unlisted: a multi-rank commit, which never
    came, was the only thing that gave them back."""
    region = str(tmp_path / "r.region")
    ckptfs.Store.create(region, size_bytes=128 << 20).close()
    run_ranks(_save_sharded_steps, 2, region, [1, 2], (1,))
    with ckptfs.Store(region) as store:
        free_after_dcp = store.status()["free_bytes"]
        store.unkeep("m", 1)
        with store.writer("m") as w:
            w.save({"w": torch.full((8, 4), 3.0)}, 3).result()  # step 1 and 2 are still versions
            assert {".m.rank0", ".m.rank1"} <= set(store.models())
            assert store.verify("m") == []  # a version of one process beside global ones (KeyError once)
            for step in range(4, 10):
                w.save({"w": torch.full((8, 4), float(step))}, step).result()
        # the model's ring keeps 3 (a multi-rank ring's); its spare slots went back once this
        # writer's saves filled it
        assert [v.step for v in store.versions("m")] == [7, 8, 9]
        assert not [m for m in store.models() if m.startswith(".")]
        assert store.status()["free_bytes"] > free_after_dcp
        assert torch.equal(store.load("m")["w"], torch.full((8, 4), 9.0))


@requires_fuse
def test_a_global_step_whose_parts_are_gone_is_not_listed_and_is_not_found(tmp_path, caplog, capsys):
    """A step other than the latest holds its parts only until a newer step commits and the
    ranks' rings reuse them; its global version may stay in its own ring a while (a reader held
    it). Such a version is not listed (``ckptfs ls``, the mount), and a read of it is "not
    found" with the way (it was listed, and its read an I/O error in the mount, found with a
    reader following latest while a job saved)."""
    from click.testing import CliRunner

    from test_cli import run

    from ckptfs.cli import cli
    from ckptfs.dist.parts import loadable

    region = str(tmp_path / "r.region")
    ckptfs.Store.create(region, size_bytes=128 << 20).close()
    run_ranks(_save_sharded_steps, 2, region, range(1, 5))
    with ckptfs.Store(region) as store:
        steps = [v.step for v in store.versions("m")]
        assert 3 in steps and steps[-1] == 4, steps
        store.remove(".m.rank1", 3)  # as the ring reuses its slot
        assert [v.step for v in loadable(store, "m", store.versions("m"))] == [s for s in steps if s != 3]
        # what loadable read of each version is remembered while the version is listed, not after
        from ckptfs.dist import parts as parts_module

        def remembered() -> set:
            here = store.region.superblock.uuid.hex()
            return {key[3] for key in parts_module._parts if key[:2] == (here, "m")}
        versions = store.versions("m")
        assert versions[0].counter in remembered()
        loadable(store, "m", versions[1:])  # as a listing after the ring reused the oldest's slot
        assert versions[0].counter not in remembered() and versions[1].counter in remembered()
        with pytest.raises(ckptfs.errors.PartGoneError, match="that step can no longer be loaded.*keep a step"):
            store.load("m", step=3)
        # verify skips it as ls does, and says what is wrong with it when asked for it (it said "ok")
        assert store.verify("m") == []
        assert [(p.model, p.step) for p in store.verify("m", 3)] == [("m", 3)]
        assert "the part of rank 1 (counter 3) of 'm' is gone" in str(store.verify("m", 3)[0])
    code, _, err = run(capsys, "verify", "--region", region, "m", "--step", "3")
    assert code == 1 and "is gone" in err, err
    listed = CliRunner().invoke(cli, ["--region", region, "ls", "m"])
    assert listed.exit_code == 0 and "\n3 " not in listed.output and "\n4 " in listed.output, listed.output
    with mounted(region, str(tmp_path / "mnt")) as m:
        assert "step-00000003" not in os.listdir(m / "m") and "step-00000004" in os.listdir(m / "m")
        assert torch.load(m / "m/latest/checkpoint.pt", weights_only=True)
    with ckptfs.Store(region) as store:  # the latest's own part gone (damage): an older one loads
        store.remove(".m.rank1", 4, allow_latest=True)
        with caplog.at_level("WARNING", logger="ckptfs"):
            back = store.load("m")
        assert "loaded step 2 of 'm' instead" in caplog.text and back
        with pytest.raises(ckptfs.errors.PartGoneError) as gone:
            store.load("m", step=4)
        assert "load the latest" not in str(gone.value) and "`ckptfs ls m` lists the steps" in str(gone.value)
        assert [(p.step, "rank 1" in p.message) for p in store.verify("m")] == [(4, True)]  # the latest's


def test_a_listing_keeps_a_version_whose_record_cannot_be_read(monkeypatch):
    """``parts.loadable`` hides the versions whose parts are gone; a version whose record it
    cannot read (damaged, or not ckptfs's metadata) stays listed, as before, rather than failing
    the listing (``ckptfs ls`` of the region, the mount's whole model)."""
    from types import SimpleNamespace

    from ckptfs.dist import parts

    class Store:
        def versions(self, name, missing_ok=False, hidden=False):
            return [SimpleNamespace(counter=7)]

    def unreadable(store, model, step, counter):
        raise ckptfs.errors.CorruptionError("damaged record")
    monkeypatch.setattr(parts, "_parts_of", unreadable)
    monkeypatch.setattr(parts, "_forget_parts_before", lambda store, model, counter: None)  # nothing remembered
    versions = [SimpleNamespace(step=1, counter=1, latest=False), SimpleNamespace(step=2, counter=2, latest=True)]
    assert parts.loadable(Store(), "m", versions, ["m", ".m.rank0"]) == versions


def test_a_kept_global_step_keeps_its_parts(tmp_path):
    """A milestone of a multi-rank checkpoint (``keep=True``, or ``Store.keep`` later) stays
    loadable while the job saves on: its parts are kept with it."""
    region = str(tmp_path / "r.region")
    ckptfs.Store.create(region, size_bytes=128 << 20).close()
    run_ranks(_save_sharded_steps, 2, region, range(1, 6), {1})
    with ckptfs.Store(region) as store:
        store.keep("m", 5)  # after the fact: its parts are still there
        assert all(v.kept for name in (".m.rank0", ".m.rank1") for v in store.versions(name) if v.step == 5)
    run_ranks(_save_sharded_steps, 2, region, range(6, 14))
    with ckptfs.Store(region) as store:
        assert [v.step for v in store.versions("m") if v.kept] == [1, 5]
        store.remove(".m.rank1", 12)  # as if its slot had been reused
        with pytest.raises(ckptfs.errors.CkptfsError, match="step 12 of 'm' cannot be kept: the part of rank 1 is gone"):
            store.keep("m", 12)
        assert not any(v.kept for name in ("m", ".m.rank0") for v in store.versions(name) if v.step == 12)
    for step in (1, 5):
        run_ranks(_load_step, 2, region, step)
        run_ranks(_load_step, 1, region, step)
    with ckptfs.Store(region) as store:  # a kept step's part lost is damage: verify says so
        assert store.verify("m") == []
        (counter,) = [c for name, c in ckptfs.dist.parts.named_by(store, "m", [
            (v.step, v.counter) for v in store.versions("m") if v.step == 5]) if name == ".m.rank0"]
        _drop_part(store, ".m.rank0", counter)
        assert [(p.step, "rank 0" in p.message) for p in store.verify("m")] == [(5, True)]


def test_a_global_step_is_kept_whole_or_not_at_all(tmp_path, monkeypatch):
    """Keeping a multi-rank step whose part of rank 1 cannot be kept (its ring would be left no
    slot to save into): RegionFullError, and the part of rank 0, kept first, is unkept again
    (it stayed kept: a half-kept milestone, its one part's slot lost to the ring for good)."""
    region = str(tmp_path / "r.region")
    ckptfs.Store.create(region, size_bytes=128 << 20).close()
    run_ranks(_save_sharded_steps, 2, region, range(1, 4))
    real = ckptfs.store.room_after_keeping
    monkeypatch.setattr(ckptfs.store, "room_after_keeping",
                        lambda region, v: v.entry.name != ".m.rank1" and real(region, v))
    with ckptfs.Store(region) as store:
        with pytest.raises(ckptfs.errors.RegionFullError, match="keeping step 2 of '.m.rank1'"):
            store.keep("m", 2)
        assert not any(v.kept for name in ("m", ".m.rank0", ".m.rank1") for v in store.versions(name) if v.step == 2)
        monkeypatch.setattr(ckptfs.store, "room_after_keeping", real)
        assert store.keep("m", 2)
        assert all(v.kept for name in ("m", ".m.rank0", ".m.rank1") for v in store.versions(name) if v.step == 2)


def test_removed_global_versions_give_back_their_parts_and_a_rollback_keeps_the_new_latests(tmp_path, capsys):
    """Removing a multi-rank version gives its parts back to their rings: a removed milestone's
    stayed kept for good once the job had ended. A rollback keeps the parts of the version that
    becomes latest, as a latest's are: given back when a newer step superseded it, they were
    the first the resumed job's saves overwrote, leaving, while those failed, no version that
    loads. Where one of them is gone the rollback is refused, naming the step to remove too;
    ``ckptfs rm`` removes the latest last, so that both in one command roll back past it."""
    from ckptfs.cli import main as cli_main

    region = str(tmp_path / "r.region")
    ckptfs.Store.create(region, size_bytes=128 << 20).close()
    run_ranks(_save_sharded_steps, 2, region, range(1, 7), {1, 2})
    names = (".m.rank0", ".m.rank1")

    def kept(store):
        return {n: [v.step for v in store.versions(n, hidden=True) if v.kept] for n in names}

    with ckptfs.Store(region) as store:
        assert [v.step for v in store.versions("m")] == [1, 2, 4, 5, 6]
        assert kept(store) == {n: [1, 2, 6] for n in names}
        store.remove("m", 2)
        assert kept(store) == {n: [1, 6] for n in names}
        store.remove("m", 6, allow_latest=True)
        assert store.latest("m").step == 5 and kept(store) == {n: [1, 5] for n in names}
        store.remove(".m.rank1", 4)  # as if its slot had been reused
        with pytest.raises(ckptfs.errors.CkptfsError, match=r"step 5 of 'm' is latest, and step 4, which would become "
                           r"latest, cannot be loaded \(its part of rank 1 is gone\); remove step 4 too"):
            store.remove("m", 5, allow_latest=True)
        assert store.latest("m").step == 5 and kept(store) == {n: [1, 5] for n in names}
    with pytest.raises(SystemExit) as e:
        cli_main(["rm", "--region", region, "--allow-latest", "m", "5", "4"])
    assert e.value.code == 0
    assert capsys.readouterr().out.splitlines() == ["removed m step 4", "removed m step 5", "latest of m: step 1"]
    with ckptfs.Store(region) as store:
        assert kept(store) == {n: [1] for n in names}
    run_ranks(_load_step, 2, region, 1)


def test_removing_a_multi_rank_model_removes_its_parts(store):
    dcp.save({"w": torch.ones(4)}, storage_writer=ckptfs.dcp.StorageWriter(store, "m", step=1))
    dcp.save({"w": torch.ones(4)}, storage_writer=ckptfs.dcp.StorageWriter(store, "n", step=1))
    assert {".m.rank0", ".n.rank0"} <= set(store.models())
    store.remove_model("m")
    assert ".m.rank0" not in store.models() and {"n", ".n.rank0"} <= set(store.models())
    # saved again in this process: the writer it kept for the removed part model is not reused
    dcp.save({"w": torch.full((4,), 2.0)}, storage_writer=ckptfs.dcp.StorageWriter(store, "m", step=1))
    back = {"w": torch.zeros(4)}
    dcp.load(back, storage_reader=ckptfs.dcp.StorageReader(store, "m"))
    assert torch.equal(back["w"], torch.full((4,), 2.0))
    store.remove_model("m")
    with store.open_version(".n.rank0", 1):  # a reader holds the part: the model goes, the part says so
        with pytest.raises(ckptfs.errors.BusyError, match=r"removed 'n', but not its ranks' parts \.n\.rank0"):
            store.remove_model("n")
    assert "n" not in store.models()
    store.remove_model(".n.rank0")
    assert not [m for m in store.models() if m.startswith((".m", ".n"))]


def test_a_load_reads_ahead_while_dcp_plans_and_lets_go_if_planning_fails(store, monkeypatch):
    """StorageReader.prepare_local_plan opens the parts and starts reading their first chunks
    while DCP's planning runs; read_data checks those instead of reading them again. A planning
    that fails leaves nothing pinned once the reader is reset (DCP resets it at every load)."""
    from ckptfs import scan as scan_module

    monkeypatch.setattr(scan_module, "READ_CHUNK_BYTES", 1 << 20)
    state = {f"t{i}": torch.randn(1 << 18) for i in range(6)}  # 6 MiB: 6 chunks, all read ahead
    dcp.save(state, storage_writer=ckptfs.dcp.StorageWriter(store, "m", step=1))
    reads = []
    real = store.region.backend.read_direct
    monkeypatch.setattr(store.region.backend, "read_direct",
                        lambda at, view: (reads.append((at, threading.current_thread().name)), real(at, view)))

    back = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(back, storage_reader=ckptfs.dcp.StorageReader(store, "m"))
    assert all(torch.equal(back[k], state[k]) for k in state)
    assert len(reads) == len(set(reads)) == 6, reads  # read once each: ahead, then checked
    assert all(thread.startswith("ckptfs-read-ahead") for _, thread in reads), reads

    def failing_plan(self, plans):
        raise RuntimeError("injected: a rank's planning failed")
    monkeypatch.setattr(ckptfs.dcp.StorageReader, "prepare_global_plan", failing_plan)
    r = ckptfs.dcp.StorageReader(store, "m")
    with pytest.raises(CheckpointException) as failed:
        dcp.load(back, storage_reader=r)
    assert "injected" in repr(failed.value.failures)
    part = ckptfs.dist.part_model("m", 0)

    def part_pinned() -> bool:  # as another process sees it (a pin is an open file description's lock)
        with ckptfs.Store(store.path) as other:
            return any(m["name"] == part and m["pinned_or_writing_slots"] for m in other.status()["models"])
    assert part_pinned()  # the read ahead holds it
    r.reset()
    assert not part_pinned()
    monkeypatch.undo()
    again = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(again, storage_reader=r)
    assert all(torch.equal(again[k], state[k]) for k in state)


def test_a_load_with_byte_items_uses_its_reads_ahead(store, monkeypatch):
    """Byte items (an optimizer's param_groups, an epoch) are copied whole before DCP takes
    them: a part holding some stays in the pipeline with its reads ahead (they were let go and
    every chunk read again, in every load of an optimizer's state)."""
    from ckptfs import scan as scan_module

    monkeypatch.setattr(scan_module, "READ_CHUNK_BYTES", 1 << 20)
    state = {f"t{i}": torch.randn(1 << 18) for i in range(4)}
    state["optim"] = {"param_groups": [{"lr": 0.25, "betas": (0.9, 0.95)}], "epoch": 3}
    dcp.save(state, storage_writer=ckptfs.dcp.StorageWriter(store, "m", step=1))
    reads = []
    real = store.region.backend.read_direct
    monkeypatch.setattr(store.region.backend, "read_direct",
                        lambda at, view: (reads.append((at, threading.current_thread().name)), real(at, view)))
    back = {f"t{i}": torch.zeros(1 << 18) for i in range(4)}
    back["optim"] = {"param_groups": [{"lr": 0.0, "betas": (0.0, 0.0)}], "epoch": 0}
    dcp.load(back, storage_reader=ckptfs.dcp.StorageReader(store, "m"))
    assert all(torch.equal(back[f"t{i}"], state[f"t{i}"]) for i in range(4))
    assert back["optim"] == state["optim"]
    assert len(reads) == len(set(reads)) <= scan_module.READ_BUFFERS, reads  # each read once, all ahead
    assert all(thread.startswith("ckptfs-read-ahead") for _, thread in reads), reads

    # into bfloat16: each tensor copied whole to be converted, and still read once, ahead
    reads.clear()
    half = {f"t{i}": torch.zeros(1 << 18, dtype=torch.bfloat16) for i in range(4)}
    dcp.load(half, storage_reader=ckptfs.dcp.StorageReader(store, "m"))
    assert all(torch.equal(half[f"t{i}"], state[f"t{i}"].to(torch.bfloat16)) for i in range(4))
    assert len(reads) == len(set(reads)) == 4, reads
    assert all(thread.startswith("ckptfs-read-ahead") for _, thread in reads), reads


def test_a_load_pauses_the_gc_from_its_start_to_its_reads_end(store, monkeypatch):
    """From DCP's start of a load (its read of checkpoint_id) to the end of read_data the
    cyclic GC is paused (DCP's planning, between the reader's calls, started a full collection of
    the heap in most loads); on again after the load, after a load that found nothing to read,
    and within a moment of the return of DCP's call that failed in planning (its reader, held by
    the error's traceback, kept the GC off for its timeout_s, 300 s by default). A GC someone
    else switched off stays off."""
    import gc
    import time

    dcp.save({"w": torch.ones(8)}, storage_writer=ckptfs.dcp.StorageWriter(store, "m", step=1))
    seen = []
    real_plan = ckptfs.dcp.StorageReader.prepare_global_plan

    def planning(self, plans):
        seen.append(gc.isenabled())
        return real_plan(self, plans)
    monkeypatch.setattr(ckptfs.dcp.StorageReader, "prepare_global_plan", planning)
    assert gc.isenabled()
    back = {"w": torch.zeros(8)}
    dcp.load(back, storage_reader=ckptfs.dcp.StorageReader(store, "m"))
    assert torch.equal(back["w"], torch.ones(8))
    assert seen == [False] and gc.isenabled()
    with pytest.raises(CheckpointException):  # nothing saved under that name: no load follows
        dcp.load(back, storage_reader=ckptfs.dcp.StorageReader(store, "nothing"))
    assert gc.isenabled()

    def failing(self, plans):
        raise RuntimeError("injected: planning failed")
    monkeypatch.setattr(ckptfs.dcp.StorageReader, "prepare_global_plan", failing)
    r = ckptfs.dcp.StorageReader(store, "m")
    with pytest.raises(CheckpointException) as failed:  # its reader is kept by the error's traceback
        dcp.load(back, storage_reader=r)
    r.reset()  # a reset ends it at once
    assert gc.isenabled()
    with pytest.raises(CheckpointException) as failed:
        dcp.load(back, storage_reader=ckptfs.dcp.StorageReader(store, "m"))
    t0 = time.monotonic()
    while not gc.isenabled() and time.monotonic() < t0 + 10:
        time.sleep(0.05)
    assert gc.isenabled() and time.monotonic() - t0 < 2  # not after its timeout_s (300 s)
    assert failed.value is not None

    monkeypatch.setattr(ckptfs.dcp.StorageReader, "prepare_global_plan", planning)
    gc.disable()  # someone else's
    try:
        dcp.load(back, storage_reader=ckptfs.dcp.StorageReader(store, "m"))
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_an_older_step_of_this_job_finishing_after_a_newer_one_is_quiet_in_any_process(store):
    """A DCP save asked for before a newer step of the job committed (an async_save of the
    process kind, finishing in DCP's background process, which records beside the training
    process) leaves the newer step latest and succeeds; it failed as "another job's". A save
    asked for after the newer step committed (a job resumed behind a run that got further) is
    still refused."""
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(8.0)}
    older = ckptfs.dcp.StorageWriter(store, "j", step=1)  # asked for first ...
    dcp.save(state, storage_writer=ckptfs.dcp.StorageWriter(store, "j", step=2))
    dcp.save(state, storage_writer=older)  # ... finished last
    assert store.latest("j").step == 2
    with pytest.raises(BaseException, match=r"already at step 2 .*ckptfs rm --allow-latest j"):
        dcp.save(state, storage_writer=ckptfs.dcp.StorageWriter(store, "j", step=1))
    assert store.latest("j").step == 2


def test_a_checkpoint_id_beside_the_storage_names_the_step_or_is_refused(store, tmp_path):
    """torchtitan passes checkpoint_id (a folder ending in step-N) with its storage: it was
    ignored, and a load of step 1 loaded the newest in silence."""
    for step in (1, 2):
        dcp.save({"w": torch.full((3,), float(step))}, checkpoint_id=f"ckptfs:ck@{step}",
                 storage_writer=ckptfs.dcp.StorageWriter(store, "ck", step=step))
    back = {"w": torch.zeros(3)}
    reader = ckptfs.dcp.StorageReader(store, "ck")
    dcp.load(back, checkpoint_id="ckptfs:ck@1", storage_reader=reader)
    assert back["w"][0] == 1.0
    dcp.load(back, checkpoint_id=tmp_path / "outputs" / "checkpoint" / "step-2", storage_reader=reader)
    assert back["w"][0] == 2.0
    dcp.load(back, checkpoint_id="/ckpt/ck/step-00000001/", storage_reader=reader)
    assert back["w"][0] == 1.0
    dcp.load(back, checkpoint_id="ckptfs:ck@newest", storage_reader=reader)
    assert back["w"][0] == 2.0
    dcp.load(back, checkpoint_id="out/checkpoint-1", storage_reader=reader)  # Hugging Face's Trainer
    assert back["w"][0] == 1.0
    dcp.load(back, checkpoint_id="/ckpt/ck/latest", storage_reader=reader)
    assert back["w"][0] == 2.0
    dcp.load(back, checkpoint_id="run/iter_0000001", storage_reader=reader)  # Megatron's
    assert back["w"][0] == 1.0
    for bad, said in (("ckptfs:other@1", "names model 'other'"), ("/ckpt/ck/final", "names no step"),
                      ("step-x", "is not a step")):
        with pytest.raises(ValueError, match=said):
            dcp.load(back, checkpoint_id=bad, storage_reader=reader)
    with pytest.raises(ValueError, match=r"names step 4, and StorageWriter\(step=3\)"):
        dcp.save({"w": torch.zeros(3)}, checkpoint_id="run/step-4", storage_writer=ckptfs.dcp.StorageWriter(store, "ck", step=3))
    assert [v.step for v in store.versions("ck")] == [1, 2]


def test_a_gc_hold_ends_at_its_expiry_or_when_the_call_it_spans_returns():
    import gc
    import sys
    import time

    from ckptfs.gcpause import GCHold

    hold = GCHold()
    t0 = time.monotonic()
    hold.hold(0.3)  # no call to watch: its expiry alone
    assert not gc.isenabled()
    while not gc.isenabled() and time.monotonic() < t0 + 5:
        time.sleep(0.02)
    assert gc.isenabled() and 0.25 < time.monotonic() - t0 < 2

    def load():  # as DCP's _load_state_dict: holds, then fails
        hold.hold(60, sys._getframe(0))
        raise RuntimeError("planning failed")
    with pytest.raises(RuntimeError) as kept:  # the traceback keeps the frame object alive
        load()
    t0 = time.monotonic()
    while not gc.isenabled() and time.monotonic() < t0 + 5:
        time.sleep(0.02)
    assert gc.isenabled() and time.monotonic() - t0 < 1 and kept.value.__traceback__ is not None
    hold.hold(60)
    hold.release()
    hold.release()  # idempotent: the GC's state is counted once
    assert gc.isenabled()


def test_a_bad_extra_is_refused_before_any_rank_writes(store):
    """An extra file that cannot be stored (NaN in JSON, a name ckptfs takes, a lone surrogate)
    is refused where the StorageWriter is made, on every rank: it was refused at the global
    commit, once every rank's part was written (and those parts were left unlisted)."""
    for extra, error in [({"x.json": float("nan")}, TypeError), ({"hf": "x"}, ValueError),
                         ({"dcp-parts.json": "{}"}, ValueError), ({"s.txt": "\udcff"}, ValueError)]:
        with pytest.raises(error, match=r"^extra"):
            ckptfs.dcp.StorageWriter(store, "m", step=1, extra=extra)
    assert store.models() == []


def test_an_optimizer_state_saved_through_dcp_loads_back_into_an_optimizer(store):
    """DCP's key paths make every dict key a str: the whole state gave an optimizer's state
    under "0", "1", which Optimizer.load_state_dict keeps as the state of no parameter (the
    moments silently dropped). Its keys are the param_groups' ints again; a user dict's int
    keys stay strs, as DCP's own unflattening leaves them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "other": {3: torch.ones(1)}}
    dcp.save(state, storage_writer=ckptfs.dcp.StorageWriter(store, "m", step=1))
    back = store.load("m")
    assert list(back["optim"]["state"]) == [0, 1, 2, 3] and list(back["other"]) == ["3"]
    again = torch.optim.AdamW(model.parameters())
    again.load_state_dict(back["optim"])
    for p in model.parameters():
        assert torch.equal(again.state[p]["exp_avg"], opt.state[p]["exp_avg"])
