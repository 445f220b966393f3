"""The staging pool: a hard budget, and buffers made ahead of the first save where its size is
known (a writer opened on a model that has a version, i.e. a job resumed after a restart, or
told the state by Writer.prepare)."""
import threading
import time

import pytest
import torch

import ckptfs.errors
from ckptfs.writer.staging import StagingPool
from conftest import assert_same, staging_buffers_made


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


def test_saves_work_where_the_host_page_is_64_kib(tmp_path, monkeypatch):
    """On a host of 64 KiB pages (arm64 kernels built so, as on some Grace Hopper nodes) a save of
    a few KiB plans chunks of a multiple of the format's 4 KiB page: the staging pool took only
    multiples of the host's page and refused them, so every small save failed. Chunks are
    O_DIRECT-aligned at the format's page; mmap rounds a buffer up to the host's page itself.
    Here a region made on such a host (its blocks, and so its slots' extents, of 64 KiB) takes
    saves small and large, grown, kept and removed, and reads back whole on reopening."""
    import mmap

    from ckptfs.region.backend import Backend

    monkeypatch.setattr(mmap, "PAGESIZE", 64 << 10)
    monkeypatch.setattr(Backend, "block_bytes", 64 << 10)
    region = str(tmp_path / "r.region")
    small = {"w": torch.arange(2500, dtype=torch.float32)}  # 10,000 bytes: a chunk of 12 KiB
    grown = {"w": torch.randn(300_001), "b": torch.arange(7, dtype=torch.int16)}
    with ckptfs.Store.create(region, size_bytes=64 << 20) as store:
        assert store.region.superblock.block_bytes == 64 << 10
        with store.writer("small") as w:
            w.save(small, 1).result()
            w.save(grown, 2, keep=True).result()
            w.save(small, 3).result()
        store.remove("small", 1)
    with ckptfs.Store(region) as store:
        assert [v.step for v in store.versions("small")] == [2, 3]
        assert torch.equal(store.load("small")["w"], small["w"])
        assert_same(store.load("small", 2), grown)
        assert store.verify() == []
    pool = StagingPool(3 * 4096, 3 * 4096)
    try:
        assert len(pool.acquire(timeout_s=1).mapping) >= 3 * 4096
        with pytest.raises(ValueError, match="multiple of 4096"):
            StagingPool(4096 + 512, 8192)
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


def test_a_resumed_writer_prefills_its_pool_before_the_first_save(store, monkeypatch):
    """Where CUDA is available it does not (such a job snapshots through a pinned pool of its
    own): both, whatever this machine has."""
    state = {"w": torch.randn(1 << 18)}  # 1 MiB
    with store.writer("m", chunk_bytes=256 << 10) as w:
        w.save(state, step=1).result()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with store.writer("m", chunk_bytes=256 << 10) as w:
        assert w._background == [] and w._pools == {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    w = store.writer("m", chunk_bytes=256 << 10)
    try:
        (thread,) = w._background
        thread.join(timeout=30)
        (pool,) = w._pools.values()
        assert pool.chunk_bytes == 256 << 10 and len(pool._free) == pool.max_buffers == 8  # 2 saves in flight
        w.save(state, step=2).result()
        assert len(pool._all) == 8  # the first save took prefilled buffers, made none
    finally:
        w.close()
    assert torch.equal(store.load("m")["w"], state["w"])
    with store.writer("new") as fresh:
        assert fresh._background == []  # no version: nothing to size a pool by


def test_a_state_that_outgrows_its_first_save_gets_chunks_and_a_pool_of_its_size(store, monkeypatch):
    """A first save before the optimizer had state (a few KiB) fixed 4 KiB chunks and a pool of
    two of them for good: every later save of 100 MiB took 20x as long as a fresh writer's. The
    pool is made again for the larger state; the outgrown one's buffers are given back."""
    made = staging_buffers_made(monkeypatch)
    chunk_bytes = 1 << 20
    big = {"w": torch.randn(1 << 20), "b": torch.randn(3)}  # 4 MiB: 4+1 chunks of 1 MiB
    with store.writer("m", chunk_bytes=chunk_bytes, max_inflight=2) as w:
        w.save({"w": torch.randn(64)}, step=1).result()
        small_buffers = list(made)
        assert small_buffers and all(len(b.mapping) == 4096 for b in small_buffers)
        for step in (2, 3):
            w.save(big, step=step).result()
        big_buffers = made[len(small_buffers):]
        assert {len(b.mapping) for b in big_buffers} == {chunk_bytes}
        assert len(big_buffers) <= w._pools[False].max_buffers  # the second big save made none
        assert all(b.mapping.closed for b in small_buffers)
        assert len(w._planner.plan(big, 4).layout.chunks) == 5
        w.save({"w": torch.randn(64)}, step=5).result()  # smaller again: the larger pool serves it
        assert made[len(small_buffers):] == big_buffers
    loaded = store.load("m", step=3)
    assert torch.equal(loaded["w"], big["w"]) and torch.equal(loaded["b"], big["b"])


def test_prepare_makes_the_plan_and_the_pool_so_the_first_save_makes_neither(store, monkeypatch):
    """Writer.prepare(state): the structure planned and the staging faulted in off the caller's
    thread; the first save then flattens nothing and makes no buffer."""
    from ckptfs.writer import plan as plan_module, staging

    state = {"model": {f"w{i}": torch.randn(1000) for i in range(50)}, "step": 3}
    with store.writer("m", chunk_bytes=64 << 10) as w:
        w.prepare(state).result(timeout=60)
        (pool,) = w._pools.values()
        assert len(pool._free) == pool.max_buffers  # all faulted in
        flattened, made = [], []
        real_flatten = plan_module.flatten
        monkeypatch.setattr(plan_module, "flatten", lambda obj: flattened.append(obj) or real_flatten(obj))
        new_buffer = staging._new_buffer
        monkeypatch.setattr(staging, "_new_buffer", lambda *a, **k: made.append(a) or new_buffer(*a, **k))
        w.save(state, step=1).result()
        assert flattened == [] and made == []
        with pytest.raises(ckptfs.errors.UnsupportedObjectError):  # what a save would refuse
            w.prepare({"x": object()}).result(timeout=60)
        assert torch.equal(store.load("m")["model"]["w7"], state["model"]["w7"])
        # a state that changed after prepare (a key added, a shape changed) is planned anew
        changed = {"model": {**state["model"], "w7": torch.randn(3, 5), "extra": torch.ones(2)}, "step": 4}
        w.save(changed, step=2).result()
        loaded = store.load("m")
        assert torch.equal(loaded["model"]["w7"], changed["model"]["w7"]) and loaded["model"]["extra"].tolist() == [1, 1]


def test_a_prepare_during_close_is_refused_and_leaves_no_staging_behind(store, monkeypatch):
    """prepare() from another thread while close runs (here: while it waits for the saves):
    refused as closed. (Accepted, its thread made a staging pool after close had given the
    pools back, and that one stayed allocated.)"""
    from ckptfs.writer.writer import Writer

    state = {"w": torch.randn(1 << 16)}
    refused = []
    real_wait, real_pool = Writer.wait, Writer._pool

    def wait_while_another_thread_prepares(self):
        try:
            self.prepare(state).result(timeout=30)
        except ckptfs.errors.CkptfsError as e:
            refused.append(str(e))
        return real_wait(self)

    def slow_pool(self, *args):
        time.sleep(0.2)  # after close has given the pools back, as a loaded machine may
        return real_pool(self, *args)

    monkeypatch.setattr(Writer, "wait", wait_while_another_thread_prepares)
    monkeypatch.setattr(Writer, "_pool", slow_pool)
    w = store.writer("m", chunk_bytes=64 << 10)
    w.close()
    assert refused and "closed" in refused[0]
    assert all(pool._closed for pool in w._pools.values())


def test_a_snapshot_larger_than_the_budget_gets_back_the_buffers_of_parked_crcs(store):
    """The chunks written while a snapshot runs park their CRCs (and so their buffers) until it
    is taken; a snapshot that needs one of those buffers lets them go instead of waiting."""
    state = {"w": torch.randn(1 << 19)}  # 2 MiB: 32 chunks through a pool of 2 buffers
    with store.writer("m", chunk_bytes=64 << 10, staging_budget_bytes=128 << 10, timeout_s=10) as w:
        for step in (1, 2):
            result = w.save(state, step=step).result(timeout=60)
            assert result.step == step
        (pool,) = w._pools.values()
        assert pool.max_buffers == 2 and len(pool._free) == 2
    loaded = store.load("m")  # every chunk's CRC checked on the way
    assert torch.equal(loaded["w"], state["w"])
    assert store.verify("m") == []


def test_a_snapshot_that_fails_gives_back_every_buffer(store, monkeypatch):
    """Those of its parked CRCs, and the one it was copying into."""
    from ckptfs.writer import snapshot

    state = {"w": torch.randn(1 << 19)}
    copies = []
    real_copy = snapshot.copy_spans

    def failing_copy(*args):
        copies.append(1)
        if len(copies) == 20:
            raise RuntimeError("the tensor went away")
        return real_copy(*args)

    with store.writer("m", chunk_bytes=64 << 10, staging_budget_bytes=8 * (64 << 10), timeout_s=10) as w:
        w.save(state, step=1).result(timeout=60)
        monkeypatch.setattr(snapshot, "copy_spans", failing_copy)
        with pytest.raises(RuntimeError, match="went away"):
            w.save(state, step=2)
        (pool,) = w._pools.values()
        deadline = time.monotonic() + 10
        while len(pool._free) != len(pool._all) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(pool._free) == len(pool._all) == pool.max_buffers
        monkeypatch.setattr(snapshot, "copy_spans", real_copy)
        w.save(state, step=3).result(timeout=60)
    assert [v.step for v in store.versions("m")] == [1, 3]


@pytest.mark.parametrize("make, copies", [
    (lambda: torch.arange(12.0).reshape(3, 4), False),
    (lambda: torch.arange(12.0).reshape(3, 4)[1:], False),  # a contiguous view at an offset
    (lambda: torch.empty(0), False),
    (lambda: torch.arange(12.0).reshape(3, 4).t(), True),
    (lambda: torch.arange(12.0)[::2], True),
    (lambda: torch.arange(4.0).neg().reshape(2, 2)._neg_view(), True),
    (lambda: torch.complex(torch.ones(3), torch.ones(3)).conj(), True),
])
def test_byte_source_runs_a_copy_exactly_where_the_gpu_snapshot_enters_the_side_stream(make, copies):
    """The CUDA snapshot enters the side stream only for tensors whose bytes need a copy (a
    kernel); for the others the bytes must be a view of the tensor's own memory."""
    from ckptfs.writer.snapshot import _is_own_bytes, byte_source

    t = make()
    assert (not _is_own_bytes(t)) is copies
    src = byte_source(t)
    if t.numel():
        assert (src.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()) is copies
        assert torch.equal(src.view(t.resolve_conj().resolve_neg().dtype).view(t.shape),
                           t.resolve_conj().resolve_neg().contiguous())


def test_read_buffers_are_registered_only_where_cuda_is_in_use_and_fall_back_where_they_cannot_be(
        store, monkeypatch):
    """A load's read buffers are registered with CUDA in a process that already started it (its
    copies into GPU tensors then go by DMA), in the context of the loading thread's current GPU
    (the reader threads' own is GPU 0), never start CUDA in one that did not (the mount, the
    CLI), and a buffer the driver refuses to register is made unregistered: the load works."""
    import contextlib

    import ckptfs.scan as scan
    import ckptfs.writer.staging as staging

    state = {"w": torch.arange(300_000, dtype=torch.float32)}
    with store.writer("m", chunk_bytes=1 << 20) as w:
        w.save(state, step=1).result()
    made = staging_buffers_made(monkeypatch)
    if not torch.cuda.is_initialized():
        assert scan.current_cuda_device() is None
        assert torch.equal(store.load("m")["w"], state["w"])
        assert made and not any(b.pinned for b in made)
        assert not torch.cuda.is_initialized()  # a load did not start CUDA
    made.clear()
    current = [0]  # the fake driver's current device, per call (the threads share it here)
    registered, unregistered = [], []

    @contextlib.contextmanager
    def on_device(index):
        before, current[0] = current[0], index
        try:
            yield
        finally:
            current[0] = before

    def register(t):
        registered.append((current[0], threading.current_thread().name))
        if len(registered) == 1:
            raise RuntimeError("cudaHostRegister refused")  # the first: that buffer is made unregistered

    class FakeCudart:
        def cudaHostUnregister(self, ptr):
            unregistered.append(current[0])
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "device", on_device)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    monkeypatch.setattr(staging, "_cuda_host_register", register)
    monkeypatch.setattr(scan, "READ_CHUNK_BYTES", 1 << 18)  # several chunks, several buffers
    assert torch.equal(store.load("m")["w"], state["w"])
    assert len(registered) == len(made) >= 2
    assert {d for d, _ in registered} == {3}  # GPU 3's context, not the reader threads' GPU 0
    assert any(not name.startswith("MainThread") for _, name in registered)
    assert [b.pinned for b in made] == [False] + [True] * (len(made) - 1)
    assert unregistered == [3] * (len(made) - 1)  # each registered one let go, in the same context
    with pytest.raises(RuntimeError, match="refused"):  # a writer that asks for pinned memory gets it or fails
        registered.clear()
        staging.StagingBuffer(1 << 20, True)


def test_a_budget_between_two_multiples_of_the_chunk_keeps_one_pool(store):
    """staging_budget_bytes=6 MiB with chunks of 4 MiB holds one buffer: the pool, compared by
    the budget asked rather than what it holds, was made again at every save."""
    state = {"w": torch.randn(1 << 21)}  # 8 MiB
    with store.writer("m", chunk_bytes=4 << 20, staging_budget_bytes=6 << 20) as w:
        w.save(state, step=1).result()
        pool = w._pools[False]
        for step in range(2, 5):
            w.save(state, step=step).result()
        assert w._pools[False] is pool and w._retired_pools == []


def test_a_retired_pool_closes_every_buffer_it_gets_back():
    """A pool replaced by a larger one: a buffer released while a snapshot waited went to its
    free list and, the wait over, stayed open; so did one a prefill finished after the
    retirement."""
    pool = StagingPool(4096, 4096)
    held = pool.acquire()
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(timeout_s=10)))
    waiter.start()
    while not pool.starved:
        time.sleep(0.01)
    pool.retire()
    pool.release(held)  # to the waiting snapshot
    waiter.join(10)
    assert got == [held] and not held.mapping.closed
    pool.release(held)  # the wait is over: closed
    assert held.mapping.closed and not pool.holds_buffers
    late = StagingPool(4096, 8192)
    late.retire()
    assert late.prefill() == 0 and not late.holds_buffers
