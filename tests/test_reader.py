"""The one checked read path (ckptfs.reader.VersionData): ranges, front-to-back passes, scans."""
import os

import pytest
import torch

import ckptfs
from ckptfs.errors import CorruptionError
from ckptfs.views import safetensors_view

MIB = 1 << 20


def _saved_with_a_flipped_bit(path: str, state: dict, tensor: str, at: int, bit: int = 1) -> None:
    """Save ``state`` as step 1 of ``m`` in a new region at ``path``, then flip ``bit`` of the
    byte ``at`` bytes into ``tensor``, behind ckptfs's back."""
    with ckptfs.Store.create(path, size_bytes=64 << 20) as s:
        with s.writer("m") as w:
            w.save(state, step=1).result()
        version = s.region.latest(s.region.get("m"))
        rec = next(r for r in s.region.read_manifest(version).tensors if r.name == tensor)
        where = version.data_base + rec.offset + at
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, where)[0] ^ bit]), where)
    finally:
        os.close(fd)


@pytest.fixture
def damaged(tmp_path):
    """A version whose 3 MiB tensor ``b`` has one byte flipped near its start; ``a`` is intact."""
    path = str(tmp_path / "r.region")
    state = {"a": torch.arange(MIB // 4, dtype=torch.float32), "b": torch.ones(3 * MIB // 4)}
    _saved_with_a_flipped_bit(path, state, "b", 10)
    with ckptfs.Store(path) as s:
        yield s, state


def test_a_range_touching_a_damaged_tensor_is_refused_and_others_are_served(damaged):
    store, state = damaged
    with store.open_version("m") as v:
        a, b = v.manifest.tensors
        assert bytes(v.read(a.offset, a.nbytes)) == state["a"].numpy().tobytes()
        with pytest.raises(CorruptionError, match="tensor 'b' of m step 1"):
            v.read(b.offset + b.nbytes - 1, 1)  # the last byte: the whole tensor is checked first
        with pytest.raises(ValueError, match="outside"):
            v.read(0, v.manifest.data_bytes + 1)


def test_a_front_to_back_pass_refuses_before_the_damaged_tensors_last_block(damaged):
    store, _ = damaged
    with store.open_version("m") as v:
        view = safetensors_view(v.manifest)
        blocks = []
        with pytest.raises(CorruptionError, match="tensor 'b'"):
            for block in view.iter_blocks(v.data.sequential_reader(), block_bytes=MIB):
                blocks.append(len(block))
        # header, tensor a (1 block), then b's first two of three blocks; never its last
        assert blocks[1:] == [MIB, MIB, MIB]
        assert sum(blocks) < view.size - MIB + 1


def test_a_pass_out_of_order_is_checked_first(damaged):
    store, _ = damaged
    with store.open_version("m") as v:
        b = v.manifest.tensors[1]
        read = v.data.sequential_reader()
        with pytest.raises(CorruptionError):
            read(b.offset + MIB, MIB)  # not from the tensor's start: the whole tensor is checked


def test_an_intact_pass_equals_the_ranges(tmp_path):
    state = {"x": torch.randn(700_000), "y": torch.randn(3), "tied": None}
    state["tied"] = state["x"]
    with ckptfs.Store.create(str(tmp_path / "r.region"), size_bytes=64 << 20) as s:
        with s.writer("m") as w:
            w.save(state, step=1).result()
        with s.open_version("m") as v:
            view = safetensors_view(v.manifest)
            streamed = b"".join(bytes(b) for b in view.iter_blocks(v.data.sequential_reader(), block_bytes=MIB // 3))
            assert streamed == view.read(0, view.size, v.read)
            assert v.data.verify() == []


def test_a_pass_over_many_small_tensors_streams_blocks_that_span_them(tmp_path, monkeypatch):
    """Tensors stored one after another make one extent of a view; its blocks span several
    tensors, and each is still checksummed as it streams by (no check-first pass), a damaged one
    refused before the block holding its end is handed out."""
    path = str(tmp_path / "r.region")
    state = {f"t{i}": torch.full((1024 + 16 * i,), float(i)) for i in range(300)}  # 64-byte multiples
    with ckptfs.Store.create(path, size_bytes=64 << 20) as s:
        with s.writer("m") as w:
            w.save(state, step=1).result()
        with s.open_version("m") as v:
            view = safetensors_view(v.manifest)
            assert len(view.segments) < 10  # a header and a few long extents, not 300
            checked_first = []
            original = type(v.data)._crcs
            monkeypatch.setattr(type(v.data), "_crcs", lambda self, rs: checked_first.extend(rs) or original(self, rs))
            streamed = b"".join(bytes(b) for b in view.iter_blocks(v.data.sequential_reader(), block_bytes=10_000))
            assert checked_first == []
            assert streamed == view.read(0, view.size, v.read)
        version = s.region.latest(s.region.get("m"))
        rec = next(r for r in s.region.read_manifest(version).tensors if r.name == "t150")
        where = version.data_base + rec.offset + rec.nbytes - 1
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, where)[0] ^ 1]), where)
    finally:
        os.close(fd)
    with ckptfs.Store(path) as s, s.open_version("m") as v:
        view = safetensors_view(v.manifest)
        handed_out = 0
        with pytest.raises(CorruptionError, match="tensor 't150'"):
            for block in view.iter_blocks(v.data.sequential_reader(), block_bytes=10_000):
                handed_out += len(block)
        header = view.segments[0].length
        assert handed_out < header + rec.offset + rec.nbytes  # t150's last byte was never handed out


def test_a_pass_asks_for_the_bytes_ahead_once_per_half_window_not_per_read(tmp_path, monkeypatch):
    """An export of many small tensors stored apart (not 64-byte multiples): the reads ask the
    kernel to read ahead once per half of the window, not at each read (each advice walks the
    window's pages: 40,000 tensors took 4 s of advice)."""
    from ckptfs.reader import PREFETCH_AHEAD_BYTES

    path = str(tmp_path / "r.region")
    state = {f"t{i}": torch.full((1000 + i,), float(i)) for i in range(500)}
    with ckptfs.Store.create(path, size_bytes=64 << 20) as s:
        with s.writer("m") as w:
            w.save(state, step=1).result()
        with s.open_version("m") as v:
            view = safetensors_view(v.manifest)
            advised = []
            backend = s.region.backend
            original = backend.prefetch
            monkeypatch.setattr(backend, "prefetch", lambda o, n: advised.append(n) or original(o, n))
            reads = []
            reader = v.data.sequential_reader()
            streamed = b"".join(bytes(b) for b in view.iter_blocks(lambda o, n: reads.append(n) or reader(o, n),
                                                                    block_bytes=4096))
            assert streamed == view.read(0, view.size, v.read)
            assert len(reads) > 400
            assert 1 <= len(advised) <= v.manifest.data_bytes // (PREFETCH_AHEAD_BYTES // 2) + 1


def test_open_version_reuses_an_index_only_for_the_same_save(tmp_path, monkeypatch):
    """The mount hands the index it decoded to every later open of the version's files; the
    store uses it only while the pinned slot holds that very save."""
    with ckptfs.Store.create(str(tmp_path / "r.region"), size_bytes=64 << 20) as s:
        with s.writer("m", max_inflight=1, slots=2) as w:
            w.save({"x": torch.ones(4)}, step=1).result()
            with s.open_version("m", 1) as v:
                first = v.manifest
            decoded = []
            read_manifest = s.region.read_manifest
            monkeypatch.setattr(s.region, "read_manifest", lambda sv: decoded.append(sv.header.step) or read_manifest(sv))
            with s.open_version("m", 1, manifest=first) as v:
                assert v.manifest is first and decoded == []
                assert torch.equal(v.load()["x"], torch.ones(4))
            w.save({"x": torch.zeros(4)}, step=2).result()
            w.save({"x": torch.full((4,), 3.0)}, step=3).result()  # two slots: step 1's slot is reused
        with s.open_version("m", 3, manifest=first) as v:
            assert v.manifest is not first and v.manifest.step == 3 and decoded == [3]
        with pytest.raises(ckptfs.errors.NotFoundError):
            s.open_version("m", 1, manifest=first)


def test_load_into_overwrites_the_live_tensors_in_place(tmp_path):
    """Store.load(into=state): the tensors of the model and optimizer being resumed get the
    saved bytes in place (no second copy), tied weights stay tied, plain values come from the
    checkpoint; a state that differs is refused, naming where, before anything is written."""
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
    model[1].weight = model[0].weight  # tied
    opt = torch.optim.AdamW(model.parameters())
    model(torch.arange(3)).sum().backward()
    opt.step()
    saved = {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 7}
    expected = {k: v.clone() for k, v in saved["model"].items()}
    with ckptfs.Store.create(str(tmp_path / "r.region"), size_bytes=64 << 20) as s:
        with s.writer("m") as w:
            w.save(saved, step=1).result()
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()  # the live model drifts away from the checkpoint
        live = {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 0}
        before = {k: v.data_ptr() for k, v in live["model"].items()}
        out = s.load("m", into=live)
        assert out["epoch"] == 7
        for k, v in expected.items():
            assert torch.equal(model.state_dict()[k], v), k  # the model's own parameters, in place
            assert out["model"][k].data_ptr() == before[k]
        assert model[1].weight is model[0].weight
        moments = opt.state_dict()["state"][0]["exp_avg"]
        assert torch.equal(moments, saved["optim"]["state"][0]["exp_avg"])
        params = dict(model.named_parameters())  # tensors that require grad: written all the same
        params_state = {"model": {k: params.get(k, v) for k, v in model.state_dict().items()},
                        "optim": opt.state_dict(), "epoch": 0}
        s.load("m", into=params_state)
        wrong = {"model": {**model.state_dict(), "1.bias": torch.zeros(11)}, "optim": opt.state_dict(), "epoch": 0}
        untouched = wrong["model"]["0.weight"].clone()
        with pytest.raises(ValueError, match=r"'model.1.bias'.*float32\[10\].*float32\[11\]"):
            s.load("m", into=wrong)
        assert torch.equal(wrong["model"]["0.weight"], untouched)
        with pytest.raises(ValueError, match="tensors"):
            s.load("m", into={"model": {}})


def test_load_into_tells_autograd_the_tensors_changed(tmp_path):
    """load(into=) writes host tensors by address, not by a torch op: autograd still learns of
    it (as of copy_), so a graph that saved a parameter refuses to backpropagate through the
    values the load replaced."""
    p = torch.nn.Parameter(torch.ones(4))
    with ckptfs.Store.create(str(tmp_path / "r.region"), size_bytes=64 << 20) as s:
        with s.writer("m") as w:
            w.save({"p": p}, step=1).result()
        loss = (p * p).sum()  # saves p for its backward
        before = p._version
        s.load("m", into={"p": p})
        assert p._version > before
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def _wait_ahead(data) -> None:
    for future in list(data._ahead.values()):
        future.result(timeout=30)


def test_a_read_checks_the_tensors_after_it_in_the_background(tmp_path, monkeypatch):
    """A front-to-back reader (cp, torch.load through the mount) finds the tensors ahead of its
    reads already checked: their checks ran while it read the ones before."""
    state = {k: torch.full((MIB // 4,), float(i)) for i, k in enumerate("abc")}
    with ckptfs.Store.create(str(tmp_path / "r.region"), size_bytes=64 << 20) as s:
        with s.writer("m") as w:
            w.save(state, step=1).result()
        with s.open_version("m") as v:
            a, b, c = v.manifest.tensors
            assert bytes(v.read(a.offset, 16)) == state["a"].numpy().tobytes()[:16]
            assert not v.data._ahead  # one read is not yet a pass
            assert bytes(v.read(a.offset + 16, 16)) == state["a"].numpy().tobytes()[16:32]
            _wait_ahead(v.data)

            def no_more_reads(*args):
                raise AssertionError("a tensor checked ahead was read again")

            monkeypatch.setattr(s.region.backend, "checksums", no_more_reads)
            assert bytes(v.read(b.offset, b.nbytes)) == state["b"].numpy().tobytes()
            assert bytes(v.read(c.offset, c.nbytes)) == state["c"].numpy().tobytes()


def test_random_reads_check_only_what_they_read(tmp_path, monkeypatch):
    """Reads that do not continue one another (a tool sampling rows, torch.load(mmap=True)
    touching a few tensors) start no check ahead: each checks its own tensors or blocks, and
    the device serves them alone; the first read that continues a recent one does."""
    state = {k: torch.full((MIB // 4,), float(i)) for i, k in enumerate("abcd")}
    with ckptfs.Store.create(str(tmp_path / "r.region"), size_bytes=64 << 20) as s:
        with s.writer("m") as w:
            w.save(state, step=1).result()
        with s.open_version("m") as v:
            a, b, c, d = v.manifest.tensors
            for record, at in ((c, 100), (a, 8), (d, 4000), (b, 12)):
                v.read(record.offset + at, 16)
            assert not v.data._ahead and v.data._checked == {0, 1, 2, 3}
            v.data._checked.clear()
            v.read(a.offset + 24, 100)  # continues the read of a at 8
            assert set(v.data._ahead) == {1, 2, 3}


def test_many_small_tensors_are_checked_in_one_pass_each_alike(tmp_path):
    """A read over many small tensors checks them in one pass (Backend.checksums), each against
    its own CRC: one damaged among them is named, its neighbours are served."""
    state = {f"t{i}": torch.full((100 + i,), float(i)) for i in range(200)}
    path = str(tmp_path / "r.region")
    _saved_with_a_flipped_bit(path, state, "t77", 5, bit=4)
    with ckptfs.Store(path) as s, s.open_version("m") as v:
        records = {r.name: r for r in v.manifest.tensors}
        crcs = s.region.backend.checksums([(v.data._data_base + records[f"t{i}"].offset, records[f"t{i}"].nbytes)
                                           for i in range(200)], 4096, 0)
        assert [i for i in range(200) if crcs[i] != records[f"t{i}"].crc32] == [77]
        with pytest.raises(CorruptionError, match="tensor 't77'"):
            v.read(0, v.manifest.data_bytes)
        t78 = records["t78"]
        assert bytes(v.read(t78.offset, t78.nbytes)) == state["t78"].numpy().tobytes()


def test_a_damaged_tensor_checked_ahead_is_still_refused_at_its_read(damaged):
    store, _ = damaged
    with store.open_version("m") as v:
        a, b = v.manifest.tensors
        v.read(a.offset, 16)
        _wait_ahead(v.data)
        with pytest.raises(CorruptionError, match="tensor 'b' of m step 1"):
            v.read(b.offset + 100, 1)


def test_a_scan_of_some_tensors_reads_only_their_pages(tmp_path, monkeypatch):
    """``scan(only=)`` (a resharded load's read of one part) reads the pages of the wanted
    tensors, not the 32 MiB chunks around them: a small tensor between two large ones costs
    its own pages; the wanted tensors are checked (a damaged one reported), the others not."""
    state = {"big0": torch.ones(6 * MIB // 4), "small": torch.arange(1000, dtype=torch.float32),
             "big1": torch.full((6 * MIB // 4,), 2.0), "tail": torch.arange(10, dtype=torch.int64)}
    path = str(tmp_path / "r.region")
    _saved_with_a_flipped_bit(path, state, "big1", 100)
    with ckptfs.Store(path) as s, s.open_version("m") as v:
        index = {r.name: i for i, r in enumerate(v.manifest.tensors)}
        reads = []
        real = s.region.backend.read_direct
        monkeypatch.setattr(s.region.backend, "read_direct", lambda at, view: (reads.append(len(view)), real(at, view)))
        got = {}

        def on_chunk(buf, chunk):
            for p in chunk.pieces:
                got.setdefault(p.tensor, bytearray()).extend(buf.mapping[p.buffer_start:p.buffer_start + p.length])

        assert v.data.scan(on_chunk, only={index["small"], index["tail"]}) == []
        assert sum(reads) <= 3 * 4096, reads  # two runs of pages, not the 12 MiB chunk
        assert set(got) == {index["small"], index["tail"]}
        assert bytes(got[index["small"]]) == state["small"].numpy().tobytes()
        assert bytes(got[index["tail"]]) == state["tail"].numpy().tobytes()
        bad = v.data.scan(None, only={index["big1"]})
        assert [r.name for r, _ in bad] == ["big1"]


@pytest.fixture
def blocked(tmp_path):
    """A version of one 12 MiB tensor ``w`` (3072 rows of 4 KiB: three 4 MiB blocks, each with
    its own CRC) with one byte flipped 9 MiB in (in block 2), and an intact small ``b``."""
    from ckptfs.manifest import CRC_BLOCK_BYTES

    assert CRC_BLOCK_BYTES == 4 * MIB
    state = {"w": torch.arange(3072 * 1024, dtype=torch.float32).view(3072, 1024), "b": torch.ones(10)}
    path = str(tmp_path / "r.region")
    _saved_with_a_flipped_bit(path, state, "w", 9 * MIB + 5)
    with ckptfs.Store(path) as s:
        yield s, state


def test_a_range_of_a_tensor_with_blocks_checks_only_the_blocks_under_it(blocked, monkeypatch):
    """A 4 KiB read into a large tensor (the mount, a tool sampling rows) checks the 4 MiB
    block under it, not the tensor: served where its block is intact, refused naming the
    tensor where it is not; the tensor is never checked whole on the way."""
    store, state = blocked
    with store.open_version("m") as v:
        w = v.manifest.tensors[0]
        assert v.manifest.crc_block_bytes == 4 * MIB and len(w.block_crcs) == 3
        checked = []
        real = store.region.backend.checksums
        monkeypatch.setattr(store.region.backend, "checksums",
                            lambda ranges, *a: (checked.extend(n for _, n in ranges), real(ranges, *a))[1])
        monkeypatch.setattr(v.data, "_check_ahead", lambda offset: None)  # only the read's own checks
        expect = state["w"].numpy().tobytes()
        assert bytes(v.read(w.offset + 5 * MIB, 4096)) == expect[5 * MIB:5 * MIB + 4096]
        assert bytes(v.read(w.offset + 100, 8)) == expect[100:108]
        assert checked == [4 * MIB, 4 * MIB]  # blocks 1 and 0, once each
        assert {(0, 0), (0, 1)} <= v.data._checked and 0 not in v.data._checked
        with pytest.raises(CorruptionError, match="tensor 'w' of m step 1"):
            v.read(w.offset + 8 * MIB + 1, 1)
        assert bytes(v.read(w.offset + 3 * MIB, 2 * MIB)) == expect[3 * MIB:5 * MIB]  # blocks 0-1, checked
        assert checked == [4 * MIB, 4 * MIB, 4 * MIB]


def test_a_front_to_back_pass_over_a_tensor_with_blocks_refuses_at_the_damaged_block(blocked):
    """A pass (export, cp) checks a tensor with blocks block by block on the way: the bytes
    before the damaged block are handed out, the damaged block's end never is."""
    store, _ = blocked
    with store.open_version("m") as v:
        w = v.manifest.tensors[0]
        read, handed = v.data.sequential_reader(), 0
        with pytest.raises(CorruptionError, match="tensor 'w'"):
            for at in range(w.offset, w.offset + w.nbytes, MIB):
                read(at, MIB)
                handed += MIB
        assert handed == 11 * MIB  # blocks 0-1 and the first three MiB of block 2


def test_a_scan_of_rows_reads_and_checks_only_their_blocks(blocked, monkeypatch):
    """``scan(only={i: (start, end)})`` (a resharded load's rows of a stored shard) reads the
    pages of the blocks that hold those bytes and checks those blocks: the rows of an intact
    block load while another block of the tensor is damaged; rows in the damaged block are
    refused; ``verify`` (whole) reports the tensor."""
    store, state = blocked
    with store.open_version("m") as v:
        reads = []
        real = store.region.backend.read_direct
        monkeypatch.setattr(store.region.backend, "read_direct",
                            lambda at, view: (reads.append(len(view)), real(at, view)))
        got = bytearray(4096 * 10)

        def on_chunk(buf, chunk):
            for p in chunk.pieces:
                lo, hi = max(p.tensor_start, 4096 * 1030), min(p.tensor_start + p.length, 4096 * 1040)
                if p.tensor == 0 and lo < hi:
                    start = p.buffer_start + lo - p.tensor_start
                    got[lo - 4096 * 1030:hi - 4096 * 1030] = buf.mapping[start:start + hi - lo]

        assert v.data.scan(on_chunk, only={0: (4096 * 1030, 4096 * 1040)}) == []  # rows 1030-1039: block 1
        assert sum(reads) == 4 * MIB, reads
        assert bytes(got) == state["w"][1030:1040].numpy().tobytes()
        assert (0, 1) in v.data._checked and 0 not in v.data._checked
        bad = v.data.scan(None, only={0: (9 * MIB, 9 * MIB + 4096)})
        assert [r.name for r, _ in bad] == ["w"]
        assert [p.tensor for p in v.data.verify()] == ["w"]


@pytest.fixture
def chunked(tmp_path, monkeypatch):
    """A store whose model ``m`` holds 24 tensors of 1 MiB, read in chunks of 1 MiB (24 reads),
    with each read's offset recorded in ``reads`` and ``fail_at`` (a read number, counting from
    1) failing with an injected I/O error. Yields (store, state, reads, fail_at: a dict)."""
    from ckptfs import scan as reader
    from ckptfs.errors import RegionIOError

    monkeypatch.setattr(reader, "READ_CHUNK_BYTES", MIB)
    state = {f"t{i}": torch.full((MIB // 4,), float(i)) for i in range(24)}
    with ckptfs.Store.create(str(tmp_path / "r.region"), size_bytes=128 << 20) as s:
        with s.writer("m") as w:
            w.save(state, step=1).result()
        reads, fail_at = [], {}
        real = s.region.backend.read_direct

        def recorded(at, view):
            reads.append(at)
            if len(reads) == fail_at.get("read"):
                raise RegionIOError("injected: the device failed a read", 5, "pread")
            return real(at, view)

        monkeypatch.setattr(s.region.backend, "read_direct", recorded)
        yield s, state, reads, fail_at


def test_a_scan_stops_reading_at_a_failed_read_and_says_so(chunked):
    """A read that fails in the middle of a scan (reader threads ahead of checker threads) fails
    the load with that error; the reads not yet started are dropped, not done for nothing, and
    every buffer is given back (the scan returns)."""
    from ckptfs.errors import RegionIOError

    s, state, reads, fail_at = chunked
    fail_at["read"] = 3
    with pytest.raises(RegionIOError, match="injected"):
        s.load("m")
    assert len(reads) < 12, len(reads)  # of 24 chunks
    fail_at.clear()
    assert torch.equal(s.load("m")["t23"], state["t23"])


def test_a_scan_stops_reading_when_a_chunk_cannot_be_used(chunked):
    """A chunk whose copy-out fails (``on_chunk`` raises) fails the scan with that error, and
    the reads not yet started are not made."""
    s, _, reads, _ = chunked
    seen = []

    def on_chunk(buf, chunk):
        seen.append(chunk.start)
        if len(seen) == 2:
            raise ValueError("injected: the target refused the bytes")

    with s.open_version("m") as v, pytest.raises(ValueError, match="injected"):
        v.data.scan(on_chunk)
    assert len(reads) < 16, len(reads)  # of 24 chunks


def test_a_read_ahead_cancelled_makes_none_of_the_reads_not_started(tmp_path, monkeypatch):
    """ReadAhead.cancel (a load whose plan changed, a part read alone) waits for the reads under
    way, not for those queued behind them (it made every one), and gives every buffer back."""
    import time

    from ckptfs import scan as S

    monkeypatch.setattr(S, "READ_CHUNK_BYTES", 1 << 20)
    s = ckptfs.Store.create(str(tmp_path / "r.region"), size_bytes=64 << 20)
    with s.writer("m") as w:
        w.save({f"t{i}": torch.full((1 << 18,), float(i)) for i in range(8)}, step=1).result()
    reads = []
    real = s.region.backend.read_direct

    def slow(at, view):
        reads.append(at)
        time.sleep(0.2)
        return real(at, view)
    monkeypatch.setattr(s.region.backend, "read_direct", slow)
    with s.open_version("m") as v, S.ReadBuffers() as buffers:
        ahead = S.ReadAhead([v.data.scanner(None)], buffers)
        assert len(ahead.items) == S.READ_BUFFERS
        time.sleep(0.05)  # the first READ_THREADS reads are under way
        ahead.cancel()
        assert len(reads) == S.READ_THREADS, reads
        taken = [buffers._pool.acquire(timeout_s=5) for _ in range(S.READ_BUFFERS)]  # every buffer is back
        for buf in taken:
            buffers.release(buf)
    s.close()


def test_what_a_scan_callback_returns_is_no_verdict(tmp_path):
    """VersionData.scan's ``on_chunk`` may return anything (a list of the bytes it saw): only a
    callback marked ``gives_crcs`` (the load's copy_out, which takes the CRCs as it copies) has
    its return value taken as the chunk's CRCs; an intact version scans intact, and a damaged
    one is still found damaged."""
    s = ckptfs.Store.create(str(tmp_path / "r.region"), size_bytes=64 << 20)
    with s.writer("m") as w:
        w.save({"a": torch.arange(1000.0), "b": torch.ones(10)}, step=1).result()

    def seen(buf, chunk):
        return [bytes(buf.mapping[p.buffer_start:p.buffer_start + p.length]) for p in chunk.pieces]

    def lying(buf, chunk):
        return [0] * len(chunk.pieces)

    with s.open_version("m") as v:
        assert v.data.scan(seen) == [] and v.data.scan(lying) == []
        base, a = v._slot_version.data_base, v.manifest.tensors[0]
    s.close()
    with open(tmp_path / "r.region", "r+b") as f:  # one byte of "a" flipped on disk
        f.seek(base + a.offset + 5)
        byte = f.read(1)
        f.seek(base + a.offset + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    s = ckptfs.Store(str(tmp_path / "r.region"))
    with s.open_version("m") as v:
        assert [r.name for r, _ in v.data.scan(lying)] == ["a"]
    s.close()


def test_a_read_ahead_reads_the_largest_chunks_first_then_the_small_ones(tmp_path, monkeypatch):
    """The order of a scan's reads (a resharded load's parts, in one pipeline): the READ_BUFFERS
    largest chunks first, in data order (what a ReadAhead reads while DCP plans: the smallest
    there left the device idle through the planning), then the small ones, then the rest of
    the large ones in data order; every chunk once."""
    from ckptfs import scan as S

    monkeypatch.setattr(S, "READ_CHUNK_BYTES", 1 << 20)
    s = ckptfs.Store.create(str(tmp_path / "r.region"), size_bytes=64 << 20)
    with s.writer("big") as w:  # 10 chunks of 1 MiB
        w.save({f"t{i}": torch.full((1 << 18,), float(i)) for i in range(10)}, step=1).result()
    with s.writer("small") as w:  # a part of which a load wants a few scalars: small runs
        w.save({f"s{i}": torch.full((1 << 16,), float(i)) for i in range(12)}, step=1).result()
    with s.open_version("big") as big, s.open_version("small") as small, S.ReadBuffers() as buffers:
        scans = [small.data.scanner(None, only={0, 5, 11}), big.data.scanner(None)]
        order = [(chunk.start, chunk.length, scan) for chunk, scan in S._ordered(scans)]
        ahead = S.ReadAhead(scans, buffers)
        assert [(c.start, s_) for c, s_, _ in ahead.items] == [(a, s_) for a, _, s_ in order[:S.READ_BUFFERS]]
        ahead.cancel()
    head, rest = order[:S.READ_BUFFERS], order[S.READ_BUFFERS:]
    assert all(scan is scans[1] and n == 1 << 20 for _, n, scan in head)
    assert [a for a, _, _ in head] == sorted(a for a, _, _ in head) == [i << 20 for i in range(S.READ_BUFFERS)]
    smalls = [n for _, n, scan in rest if scan is scans[0]]
    assert smalls and all(n < 1 << 20 for n in smalls) and rest[:len(smalls)] == [r for r in rest if r[2] is scans[0]]
    assert [a for a, _, scan in rest if scan is scans[1]] == [i << 20 for i in range(S.READ_BUFFERS, 10)]
    assert len(order) == len(scans[0].chunks) + len(scans[1].chunks)
    s.close()


_AHEAD_THEN_SCAN = r"""
import sys, threading, time, torch, ckptfs
from ckptfs import scan as S
S.READ_CHUNK_BYTES = 1 << 20
store = ckptfs.Store.create(sys.argv[1], size_bytes=128 << 20)
state = {f"t{i}": torch.full((1 << 18,), float(i)) for i in range(16)}  # 16 chunks of 1 MiB
with store.writer("m") as w:
    w.save(state, step=1).result()
real = store.region.backend.read_direct

def read_direct(at, view):  # the reads ahead are slow: the scan's own readers start meanwhile
    if threading.current_thread().name.startswith("ckptfs-read-ahead"):
        time.sleep(0.3)
    return real(at, view)
store.region.backend.read_direct = read_direct
seen = {}
with store.open_version("m") as v, S.ReadBuffers() as buffers:
    scan = v.data.scanner(lambda buf, chunk: seen.update({p.tensor: bytes(buf.mapping[p.buffer_start:p.buffer_start + 4])
                                                          for p in chunk.pieces}))
    ahead = S.ReadAhead([scan], buffers)
    S.scan_together([scan], buffers, ahead)
    assert scan.bad() == []
assert sorted(seen) == list(range(16)), seen
print("scanned", len(seen))
"""


def test_a_scan_after_its_read_ahead_finishes_while_the_reads_ahead_wait(tmp_path):
    """A scan started while its ReadAhead's reads are still under way (a load whose planning
    is quick: one rank, DCP's planning of a model alone) completes: the scan's own readers
    took the buffers the reads ahead were waiting for, while the checkers waited for those
    reads in order, and the load hung for good (a subprocess, so that a hang fails the test
    instead of holding the test run)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _AHEAD_THEN_SCAN, str(tmp_path / "r.region")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "scanned 16" in done.stdout, done.stderr[-2000:]
