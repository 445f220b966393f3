"""The staging pool: a hard budget, and buffers made ahead of the first save where its size is
known (a writer opened on a model that has a version, i.e. a job resumed after a restart)."""
import threading

import torch

from ckptfs.writer.staging import StagingPool


def test_prefill_makes_buffers_up_to_the_budget_and_acquire_uses_them():
    pool = StagingPool(1 << 20, 3 << 20)
    try:
        assert pool.prefill() == 3 and pool.prefill() == 0
        bufs = [pool.acquire(timeout_s=1) for _ in range(3)]
        assert len({id(b) for b in bufs}) == 3
        bufs[0].tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)  # usable memory
        assert bytes(bufs[0].mapping[:4]) == b"\x01\x02\x03\x04"
    finally:
        pool.close()


def test_acquire_and_prefill_together_never_exceed_the_budget():
    pool = StagingPool(1 << 20, 4 << 20)
    try:
        threads = [threading.Thread(target=pool.prefill) for _ in range(3)]
        for t in threads:
            t.start()
        got = [pool.acquire(timeout_s=5) for _ in range(2)]
        for t in threads:
            t.join()
        assert len(pool._all) == 4 and len(pool._free) == 2 and len(got) == 2
    finally:
        pool.close()


def test_prefill_stops_when_the_pool_closes():
    pool = StagingPool(1 << 20, 64 << 20)
    pool.close()
    assert pool.prefill() == 0 and pool._all == []


def test_a_resumed_writer_prefills_its_pool_before_the_first_save(store):
    state = {"w": torch.randn(1 << 18)}  # 1 MiB
    with store.writer("m", chunk_bytes=256 << 10) as w:
        w.save(state, step=1).result()
    w = store.writer("m", chunk_bytes=256 << 10)
    try:
        assert w._prefill_thread is not None
        w._prefill_thread.join(timeout=30)
        (pool,) = w._pools.values()
        assert pool.chunk_bytes == 256 << 10 and len(pool._free) == pool.max_buffers == 8  # 2 saves in flight
        w.save(state, step=2).result()
        assert len(pool._all) == 8  # the first save took prefilled buffers, made none
    finally:
        w.close()
    assert torch.equal(store.load("m")["w"], state["w"])
    with store.writer("new") as fresh:
        assert fresh._prefill_thread is None  # no version: nothing to size a pool by
