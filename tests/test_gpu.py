"""GPU paths: pinned staging pool, side-stream D2H copies, loads onto the device.

Skipped cleanly without CUDA; run them on a GPU machine with `pytest tests/test_gpu.py`.
"""
import pytest
import torch

from conftest import assert_same

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


def test_cuda_snapshot_sees_queued_kernels_and_not_later_ones(store):
    w_gpu = torch.zeros(1 << 20, device="cuda")
    with store.writer("gpu-order", chunk_bytes=1 << 20) as w:
        w_gpu.add_(1.0)  # queued on the current stream before save: must be in the snapshot
        fut = w.save({"w": w_gpu}, step=1, async_snapshot=True)
        w.wait_snapshot()
        w_gpu.add_(1.0)  # after the snapshot: must not be
        fut.result()
    assert torch.equal(store.load("gpu-order")["w"], torch.ones(1 << 20))
