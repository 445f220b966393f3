"""Many ranks, one checkpoint (issue 14, first part): torch.distributed.checkpoint with ckptfs as
its storage, on real gloo process groups (one process per rank) and FSDP2 over a CPU mesh:
saved at one world size and loaded at others, bit-exact against the unsharded state; the global
version committed only once every rank's part is durable; DCP's metadata stored as JSON."""
import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)

import ckptfs
from ckptfs.errors import MalformedInputError
from ckptfs.testing.ranks import run_ranks, sharded, toy_model, train_steps

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _save_sharded(rank, world, region, step, out):
    """FSDP2 + AdamW at ``world`` ranks, two training steps, dcp.save through ckptfs; rank 0 also
    writes the unsharded model and optimizer state (the reference) to ``out``."""
    model = sharded(toy_model(), world)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    train_steps(model, opt, 2, seed=7)
    msd, osd = get_state_dict(model, opt)
    with ckptfs.Store(region) as store:
        dcp.save({"model": msd, "optim": osd}, storage_writer=ckptfs.dcp.StorageWriter(store, "fsdp", step=step))
    full = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(full, out)


def _load_sharded(rank, world, region, out):
    """Load the newest global version at ``world`` ranks and compare the unsharded state."""
    model = sharded(toy_model(), world)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    train_steps(model, opt, 1, seed=99)  # different values and optimizer state to overwrite
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    with ckptfs.Store(region) as store:
        dcp.load(state, storage_reader=ckptfs.dcp.StorageReader(store, "fsdp"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:  # the unsharded state is gathered on rank 0 only
        ref_model, ref_optim = torch.load(out, weights_only=False)
        assert set(got[0]) == set(ref_model) and all(torch.equal(got[0][k], ref_model[k]) for k in ref_model)
        assert _flat(got[1]) == _flat(ref_optim) and len(_flat(ref_optim)) == 12


def _flat(osd) -> list:
    """An optimizer state dict as comparable plain data (tensors as lists)."""
    out = []
    for key, entry in sorted(osd["state"].items()):
        for name, v in sorted(entry.items()):
            out.append((key, name, v.tolist() if isinstance(v, torch.Tensor) else v))
    return out


@pytest.mark.slow
def test_fsdp2_saved_at_4_ranks_loads_at_2_at_1_and_at_4_again(tmp_path):
    region = str(tmp_path / "r.region")
    ckptfs.Store.create(region, size_bytes=256 << 20).close()
    out = str(tmp_path / "full.pt")
    run_ranks(_save_sharded, 4, region, 100, out)
    with ckptfs.Store(region) as store:
        assert [v.step for v in store.versions("fsdp")] == [100]
        assert sorted(m for m in store.models() if m.startswith(".")) == [f".fsdp.rank{r}" for r in range(4)]
    run_ranks(_load_sharded, 2, region, out)
    run_ranks(_load_sharded, 4, region, out)
    # and at world size 1, in this process, into the plain model: the unsharded weights
    model = toy_model()
    sd = {"model": model.state_dict()}
    with ckptfs.Store(region) as store:
        dcp.load(sd, storage_reader=ckptfs.dcp.StorageReader(store, "fsdp"))
    ref_model, _ = torch.load(out, weights_only=False)
    assert all(torch.equal(sd["model"][k], ref_model[k]) for k in ref_model)


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


def test_a_step_whose_part_failed_is_never_visible_and_its_parts_are_reclaimed(store):
    state = {"w": torch.arange(10.0)}
    dcp.save(state, storage_writer=ckptfs.dcp.StorageWriter(store, "m", step=1))

    class FailingFinish(ckptfs.dcp.StorageWriter):
        def finish(self, metadata, results):  # the coordinator dies before the global commit
            raise RuntimeError("coordinator lost")

    with pytest.raises(BaseException, match="coordinator lost|CheckpointException"):  # DCP wraps it
        dcp.save({"w": torch.arange(10.0) * 2}, storage_writer=FailingFinish(store, "m", step=2))
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
    dcp.save({"w": torch.arange(10.0) * 4}, storage_writer=ckptfs.dcp.StorageWriter(store, "m", step=2))
    assert store.latest("m").step == 3
    dcp.load(back, storage_reader=ckptfs.dcp.StorageReader(store, "m", step=1))  # a given global step
    assert torch.equal(back["w"], torch.arange(10.0))


def test_dcp_metadata_codec_roundtrips_and_refuses_what_is_not_its_own(store):
    from ckptfs.dist.codec import decode_metadata, encode_metadata

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


def test_reading_a_plain_version_through_dcp_says_what_it_is(store):
    with store.writer("plain") as w:
        w.save({"w": torch.ones(2)}, step=1).result()
    with pytest.raises(ckptfs.errors.NotFoundError, match="not a DCP checkpoint"):
        ckptfs.dcp.StorageReader(store, "plain").read_metadata()
    with pytest.raises(ckptfs.errors.NotFoundError):
        ckptfs.dcp.StorageReader(store, "nothing").read_metadata()
    assert os.path.basename(ckptfs.dist.part_model("gpt2", 3)) == ".gpt2.rank3"
