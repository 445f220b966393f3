"""GPU paths: pinned staging pool, side-stream D2H copies, loads onto the device.

Skipped cleanly without CUDA; run them on a GPU machine with `pytest tests/test_gpu.py`.
"""
import pytest
import torch

from conftest import assert_same, staging_buffers_made

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def gpu_state():
    g = torch.Generator(device="cuda").manual_seed(0)
    return {"model": {"w": torch.randn(1024, 1024, device="cuda", generator=g),
                      "h": torch.randn(64, 64, device="cuda", generator=g).half().t()},
            "optim": {"step": torch.tensor(3.0, device="cuda"), "lr": 0.1},
            "cpu_too": torch.arange(10)}


def test_save_cuda_tensors_and_load_back(store):
    state = gpu_state()
    with store.writer("gpu", chunk_bytes=1 << 20) as w:
        w.save(state, step=1).result()
    back = store.load("gpu")
    cpu = {"model": {k: v.cpu() for k, v in state["model"].items()},
           "optim": {"step": state["optim"]["step"].cpu(), "lr": 0.1}, "cpu_too": state["cpu_too"]}
    assert_same(cpu, back)
    on_device = store.load("gpu", map_location="cuda")
    assert on_device["model"]["w"].is_cuda
    assert torch.equal(on_device["model"]["w"], state["model"]["w"])


def test_tensors_larger_than_a_crc_block_copied_whole_and_loaded_into_gpu_tensors(store):
    """Tensors of several 4 MiB CRC blocks, within one chunk and across chunks: the snapshot
    copies each run of a tensor's pieces at once (chunks.copy_runs) and a load into GPU tensors
    (``into=``) does the same the other way; the bytes and every block CRC (verify) hold."""
    g = torch.Generator(device="cuda").manual_seed(1)
    state = {"big": torch.randn(3 * (1 << 20) + 3000, device="cuda", generator=g),  # 3 blocks and a bit
             "small": torch.randn(77, device="cuda", generator=g),
             "across": torch.randn(5 << 20, device="cuda", generator=g)}  # 20 MiB: across 16 MiB chunks
    with store.writer("blocks", chunk_bytes=16 << 20) as w:
        w.save(state, step=1).result()
    assert store.verify("blocks") == []
    into = {k: torch.full_like(v, float("nan")) for k, v in state.items()}
    store.load("blocks", into=into)
    for k, v in state.items():
        assert torch.equal(into[k], v), k
    back = store.load("blocks")
    assert all(torch.equal(back[k], v.cpu()) for k, v in state.items())


def test_load_onto_the_gpu_of_every_dtype_and_odd_shape(store):
    """A load onto a GPU stages the version in views of one pinned block and copies each tensor
    over: every dtype, scalars, empty and many small tensors come back as the CPU load does."""
    from test_roundtrip import every_dtype_tensors

    state = {"dtypes": every_dtype_tensors(), "scalar": torch.tensor(3.5), "empty": torch.empty(0, 4),
             "many": [torch.arange(i + 1, dtype=torch.int16) for i in range(300)]}
    with store.writer("dtypes", chunk_bytes=1 << 20) as w:
        w.save(state, step=1).result()
    on_cpu = store.load("dtypes")
    on_gpu = store.load("dtypes", map_location="cuda")
    assert on_gpu["scalar"].is_cuda and all(t.is_cuda for t in on_gpu["many"])
    assert_same(on_cpu, {"dtypes": {k: v.cpu() for k, v in on_gpu["dtypes"].items()},
                         "scalar": on_gpu["scalar"].cpu(), "empty": on_gpu["empty"].cpu(),
                         "many": [t.cpu() for t in on_gpu["many"]]})


def test_cuda_snapshot_sees_queued_kernels_and_not_later_ones(store):
    w_gpu = torch.zeros(1 << 20, device="cuda")
    with store.writer("gpu-order", chunk_bytes=1 << 20) as w:
        w_gpu.add_(1.0)  # queued on the current stream before save: must be in the snapshot
        fut = w.save({"w": w_gpu}, step=1, async_snapshot=True)
        w.wait_snapshot()
        w_gpu.add_(1.0)  # after the snapshot: must not be
        fut.result()
    assert torch.equal(store.load("gpu-order")["w"], torch.ones(1 << 20))


def save_between_two_updates(w, t: torch.Tensor, sleep_cycles: int) -> None:
    """A long kernel and an update queued before an async save, another update once the snapshot
    is taken: the saved version must hold the first update and not the second."""
    torch.cuda._sleep(sleep_cycles)
    t.add_(1.0)
    fut = w.save({"w": t}, step=1, async_snapshot=True)
    w.wait_snapshot()
    t.add_(1.0)
    fut.result()


def test_cuda_async_snapshot_follows_the_callers_own_stream(store):
    """The snapshot waits for the caller's current stream, even when it is not the default one
    (the snapshot thread's own current stream would not see the caller's work)."""
    w_gpu = torch.zeros(1 << 20, device="cuda")
    side = torch.cuda.Stream()
    with store.writer("own-stream", chunk_bytes=1 << 20) as w:
        with torch.cuda.stream(side):
            save_between_two_updates(w, w_gpu, 100_000_000)
    assert torch.equal(store.load("own-stream")["w"], torch.ones(1 << 20))


def test_cuda_async_snapshot_does_not_wait_for_work_queued_after_save(store):
    """The copy overlaps the caller's next forward/backward: kernels queued after save() are
    not waited for (a 1 s kernel against a copy of 4 MiB)."""
    import time

    w_gpu = torch.ones(1 << 20, device="cuda")
    with store.writer("overlap", chunk_bytes=1 << 20) as w:
        w.save({"w": w_gpu}, step=1).result()  # staging pool and side stream made
        cycles_per_s = torch.cuda.get_device_properties(0).clock_rate * 1000  # kHz
        fut = w.save({"w": w_gpu}, step=2, async_snapshot=True)
        torch.cuda._sleep(int(cycles_per_s))  # the "next forward", queued right after save
        t0 = time.perf_counter()
        w.wait_snapshot()
        waited_s = time.perf_counter() - t0
        torch.cuda.synchronize()
        fut.result()
    assert waited_s < 0.5, f"the snapshot waited {waited_s:.2f} s for work queued after save()"
    assert torch.equal(store.load("overlap")["w"], torch.ones(1 << 20))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cuda_async_snapshot_of_tensors_on_a_second_device(store):
    """A rank whose tensors live on cuda:1 (set_device(1), as DDP does): the copies run on a side
    stream of that device and the chunk is written only once they are done."""
    with torch.cuda.device(1):
        w_gpu = torch.zeros(8 << 20, device="cuda")
        with store.writer("second", chunk_bytes=4 << 20) as w:
            save_between_two_updates(w, w_gpu, 50_000_000)
    assert torch.equal(store.load("second")["w"], torch.ones(8 << 20))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_rank_on_the_second_gpu_saves_and_loads_without_a_context_on_the_first(store):
    """A process that uses only cuda:1 (set_device(1), as a rank does) saves and loads through
    buffers registered in that GPU's context: neither the snapshot nor the load's reader threads
    (whose current device is 0) make a context on GPU 0, which would take its memory."""
    import subprocess
    import sys

    script = f"""
import torch, ckptfs
torch.cuda.set_device(1)
state = {{"a": torch.randn(9 << 20, device="cuda"), "b": torch.randn(5, device="cuda")}}
store = ckptfs.Store({store.path!r})
with store.writer("one", chunk_bytes=4 << 20) as w:
    w.save(state, step=1).result()
into = {{k: torch.zeros_like(v) for k, v in state.items()}}
store.load("one", into=into)
assert all(torch.equal(into[k], v) for k, v in state.items())
assert not torch._C._cuda_hasPrimaryContext(0), "a context on GPU 0"
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def _dcp_save_on_gpus(rank, world, region, out, device="cuda"):
    """FSDP2 on each rank's GPU: dcp.save of step 1 and dcp.async_save of step 2 through ckptfs
    (DCP's collectives on a gloo group, as DCP advises for async saves); rank 0 writes the
    unsharded state of step 2 to ``out``."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    import ckptfs
    from ckptfs.testing.ranks import sharded_gpt2, train_gpt2

    gloo = dist.new_group(backend="gloo")
    model = sharded_gpt2(world, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    with ckptfs.Store(region) as store:
        for step in (1, 2):
            train_gpt2(model, opt, 1, seed=step, device=device)
            msd, osd = get_state_dict(model, opt)
            writer = ckptfs.dcp.StorageWriter(store, "dcp", step=step, group=gloo)
            if step == 1:
                dcp.save({"model": msd, "optim": osd}, storage_writer=writer, process_group=gloo)
            else:
                dcp.async_save({"model": msd, "optim": osd}, storage_writer=writer, process_group=gloo).result()
    full = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(full, out)


def _dcp_load_on_gpus(rank, world, region, out, device="cuda"):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import ckptfs
    from ckptfs.testing.ranks import sharded_gpt2, train_gpt2
    from test_dist_writer import compare_full

    gloo = dist.new_group(backend="gloo")
    model = sharded_gpt2(world, seed=1, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    train_gpt2(model, opt, 1, seed=99, device=device)  # other values, to be overwritten
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    with ckptfs.Store(region) as store:
        dcp.load(state, storage_reader=ckptfs.dcp.StorageReader(store, "dcp", group=gloo), process_group=gloo)
    assert all(t.device.type == device for t in state["model"].values())
    compare_full(rank, model, opt, state, out)


@pytest.mark.slow
def test_fsdp2_on_gpus_through_both_apis_and_loaded_again_on_the_cpu(tmp_path):
    """A job of one rank per GPU (up to 4; NCCL for the model, gloo for the checkpoint):
    ckptfs's own writer (async snapshots, 2 in flight) and DCP with ckptfs storage (save and
    async_save) on FSDP2 state dicts of CUDA DTensors; loaded back on the GPUs, and at one rank
    on the CPU, bit-exact against the unsharded state."""
    import ckptfs
    from ckptfs.testing.ranks import run_ranks
    from test_dist_writer import _load_and_compare, _train_and_save

    world = min(torch.cuda.device_count(), 4)
    nccl = "cpu:gloo,cuda:nccl"
    region = str(tmp_path / "r.region")
    ckptfs.Store.create(region, size_bytes=256 << 20).close()
    out = str(tmp_path / "full.pt")
    run_ranks(_train_and_save, world, region, out, "cuda", backend=nccl)
    run_ranks(_load_and_compare, world, region, out, "cuda", backend=nccl)
    run_ranks(_load_and_compare, 1, region, out)  # the GPU job's parts, on one CPU rank
    out_dcp = str(tmp_path / "full-dcp.pt")
    run_ranks(_dcp_save_on_gpus, world, region, out_dcp, backend=nccl)
    run_ranks(_dcp_load_on_gpus, world, region, out_dcp, backend=nccl)
    with ckptfs.Store(region) as store:
        assert [v.step for v in store.versions("dcp")] == [1, 2]


def test_a_load_into_gpu_tensors_reads_through_registered_buffers(store, monkeypatch):
    """In a process that uses CUDA a load's read buffers are registered with it, so that the
    copies into GPU tensors go by DMA; the tensors come back exact (``into=`` and DCP's load)."""
    import torch.distributed.checkpoint as dcp

    import ckptfs

    made = staging_buffers_made(monkeypatch)
    g = torch.Generator(device="cuda").manual_seed(2)
    state = {"a": torch.randn(3 << 20, device="cuda", generator=g), "b": torch.randn(77, 5, device="cuda", generator=g)}
    with store.writer("pinned", chunk_bytes=4 << 20) as w:
        w.save(state, step=1).result()
    made.clear()
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    store.load("pinned", into=into)
    assert all(torch.equal(into[k], v) for k, v in state.items())
    assert made and all(b.pinned for b in made)
    dcp.save(state, storage_writer=ckptfs.dcp.StorageWriter(store, "pinned_dcp", step=1))
    made.clear()
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(into, storage_reader=ckptfs.dcp.StorageReader(store, "pinned_dcp"))
    assert all(torch.equal(into[k], v) for k, v in state.items())
    assert made and all(b.pinned for b in made)
