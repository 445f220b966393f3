"""The snapshot copy routine (ckptfs.memcopy over the native copy_spans)."""
import mmap

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptfs.memcopy import HostTargets, copy_spans, copy_spans_crc32, default_copy_threads, host_bytes


def _random_bytes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.mark.parametrize("threads", [1, 2, 3, 16])
def test_spans_land_at_their_offsets(threads):
    # sizes straddle the streaming-store threshold (256 KiB) and the per-thread split; offsets are
    # deliberately unaligned on both sides
    sizes = [0, 1, 63, 4097, (256 << 10) - 1, (256 << 10) + 17, 3 << 20, (9 << 20) + 5]
    srcs = [_random_bytes(n + 13, i) for i, n in enumerate(sizes)]
    dst = bytearray(sum(sizes) + 64 * len(sizes) + 4096)
    spans, expect, offset = [], bytearray(len(dst)), 7
    for src, n in zip(srcs, sizes):
        spans.append((offset, src, 13, n))
        expect[offset:offset + n] = src[13:13 + n].tobytes()
        offset += n + 51
    copy_spans(dst, spans, threads)
    assert dst == expect


def test_copies_into_a_staging_mapping_from_tensor_bytes():
    t = torch.arange(5 << 20, dtype=torch.float32)
    src = host_bytes(t.view(torch.uint8))
    m = mmap.mmap(-1, len(src) + 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    copy_spans(m, [(4096, src, 0, len(src))], 2)
    out = torch.frombuffer(m, dtype=torch.uint8)[4096:].view(torch.float32)
    assert torch.equal(out, t)
    del out
    m.close()


@pytest.mark.parametrize("span", [(0, b"abc", 0, 4), (0, b"abc", 2, 2), (6, b"abc", 0, 3), (-1, b"abc", 0, 1),
                                  (0, b"abc", -1, 1), (0, b"abc", 0, -1),
                                  (1 << 62, b"abc", 1 << 62, 1 << 62)])  # offset + length past the signed maximum
def test_out_of_range_spans_are_refused_before_any_copy(span):
    dst = bytearray(8)
    with pytest.raises(ValueError):
        copy_spans(dst, [(0, b"xy", 0, 2), span], 1)
    assert dst == bytearray(8)  # the valid first span was not copied either


def test_bad_arguments():
    with pytest.raises(ValueError, match="threads"):
        copy_spans(bytearray(4), [], 0)
    with pytest.raises(TypeError):
        copy_spans(b"read-only", [(0, b"x", 0, 1)], 1)
    with pytest.raises(ValueError, match="contiguous CPU uint8"):
        host_bytes(torch.zeros(4, dtype=torch.float32))
    assert 1 <= default_copy_threads() <= 4


def test_chunk_pieces_of_cpu_sources_land_at_their_offsets():
    """copy_chunk_pieces (the copy of states that hold CUDA tensors) slices pieces as the plan
    says; CPU sources are copied at once and need no event."""
    from ckptfs.chunks import plan_chunks
    from ckptfs.manifest import TensorRecord
    from ckptfs.writer.cuda import copy_chunk_pieces

    sources = [torch.randint(0, 255, (5000,), dtype=torch.uint8), torch.randint(0, 255, (3000,), dtype=torch.uint8)]
    records = [TensorRecord("a", "uint8", (5000,), 0, 5000), TensorRecord("b", "uint8", (3000,), 5056, 3000)]
    chunks = plan_chunks(records, 8056, 4096)
    assert len(chunks) == 2 and len(chunks[0].pieces) == 1 and len(chunks[1].pieces) == 2  # "a" spans both
    expected = torch.zeros(8192, dtype=torch.uint8)
    expected[:5000], expected[5056:8056] = sources[0], sources[1]
    for chunk in chunks:
        buf = torch.zeros(4096, dtype=torch.uint8)
        assert copy_chunk_pieces(buf, chunk.pieces, sources, {}) == ()
        assert torch.equal(buf[:chunk.length], expected[chunk.start:chunk.start + chunk.length])


def test_scatter_lands_each_span_in_its_tensor():
    """HostTargets.scatter_crc32's copy, the reverse of copy_spans: spans in a chunk piece's
    order (target, dst_offset, length, src_offset), sizes across the streaming-store threshold
    and the native code's windows (256 KiB), tensors of other dtypes and shapes (written by
    address), a None target never touched."""
    src = _random_bytes(12 << 20, 7)
    targets = [torch.zeros(300, dtype=torch.float32), None, torch.zeros(3 << 20, dtype=torch.uint8),
               torch.zeros((1 << 20, 2), dtype=torch.float32)]
    spans = [(0, 8, 1000, 5), (2, 1, (256 << 10) + 3, 4099), (3, 0, 8 << 20, 4 << 20), (0, 0, 8, 2000)]
    assert HostTargets(targets).scatter_crc32(src, spans, []) == []
    for target, dst_offset, length, src_offset in spans:
        got = targets[target].view(-1).view(torch.uint8)[dst_offset:dst_offset + length]
        assert torch.equal(got, torch.from_numpy(src[src_offset:src_offset + length].copy()))
    assert targets[2][:1].item() == 0 and targets[2][(256 << 10) + 4 + 4099:].count_nonzero() == 0


@pytest.mark.parametrize("span", [(1, 0, 1, 0), (0, 0, 9, 0), (0, 5, 4, 0), (0, -1, 1, 0), (0, 0, 2, 7),
                                  (0, 0, -1, 0), (2, 0, 1, 0), (-1, 0, 1, 0),
                                  (0, 1 << 62, 1 << 62, 0), (0, 0, 1, 1 << 62), (0, 0, 1 << 62, 1 << 62)])
def test_scatter_refuses_a_span_outside_its_target_or_source_before_any_copy(span):
    t = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(ValueError):
        HostTargets([t, None]).scatter_crc32(b"abcdefgh", [(0, 0, 2, 0), span], [])
    assert t.count_nonzero() == 0  # the valid first span was not copied either


@pytest.mark.parametrize("piece", [(0, 0, 2, 7), (0, 0, 9, 0), (0, 0, -1, 0), (0, 0, 1, 1 << 62), (0, 0, 1)])
def test_scatter_refuses_a_piece_outside_the_source_before_any_copy(piece):
    t = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises((ValueError, TypeError)):
        HostTargets([t]).scatter_crc32(b"abcdefgh", [(0, 0, 2, 0)], [(0, 0, 8, 0), piece])
    assert t.count_nonzero() == 0


def test_scatter_crc32_takes_each_pieces_crc_in_the_copys_pass():
    """HostTargets.scatter_crc32 (a load's checker): each piece's CRC is crc32_pieces' of the
    same bytes, for pieces shorter than, equal to and across several of the native code's
    windows (256 KiB), at unaligned offsets; where the spans are the pieces (whole tensors) and
    where they are parts of them out of order, two from the same bytes (a resharded load's row
    ranges), or none."""
    from ckptfs.checksum import crc32, crc32_pieces

    window = 256 << 10
    src = _random_bytes(12 << 20, 11)
    sizes = [0, 1, 4095, window, window + 1, 3 * window - 5, (5 << 20) + 3]
    pieces, at = [], 3
    for i, n in enumerate(sizes):
        pieces.append((i, 9 if i % 2 else 0, n, at))
        at += n + 77
    expect = [crc32(src[p[3]:p[3] + p[2]]) for p in pieces]
    assert crc32_pieces(src, pieces) == expect

    whole = [torch.zeros(n + 9, dtype=torch.uint8) for n in sizes]
    assert HostTargets(whole).scatter_crc32(src, pieces, pieces) == expect
    for target, dst_offset, length, src_offset in pieces:
        assert torch.equal(whole[target][dst_offset:dst_offset + length],
                           torch.from_numpy(src[src_offset:src_offset + length].copy()))

    big, small = pieces[6], pieces[5]  # parts of two pieces, the later first, two from the same bytes
    rows = [torch.zeros(window * 2, dtype=torch.uint8), torch.zeros(window, dtype=torch.uint8),
            torch.zeros(100, dtype=torch.uint8)]
    spans = [(0, 0, window * 2, big[3] + 1000), (1, 0, window, big[3] + 1500), (2, 0, 100, small[3] + 7)]
    assert HostTargets(rows).scatter_crc32(src, spans, pieces) == expect
    for target, _, length, src_offset in spans:
        assert torch.equal(rows[target][:length], torch.from_numpy(src[src_offset:src_offset + length].copy()))
    assert HostTargets(rows).scatter_crc32(src, [], pieces[::-1]) == expect[::-1]


@pytest.mark.parametrize("threads", [1, 3])
def test_copy_spans_crc32_takes_each_pieces_crc_in_the_copys_pass(threads):
    """copy_spans_crc32 (a background snapshot's copy): the bytes land as copy_spans lands them,
    and each piece's CRC is crc32_pieces' of the destination, for pieces shorter than, equal to
    and across the windows (256 KiB) and across the threads' shares (12 MiB over 3 threads: a
    piece's parts from two threads are combined in order), spans given out of the order of their
    destinations, pieces out of order, several pieces in one span, and empty ones."""
    from ckptfs.checksum import crc32_pieces

    window = 256 << 10
    src = _random_bytes(13 << 20, 5)
    sizes = [0, 1, 4095, window, window + 1, 3 * window - 5, (7 << 20) + 3, 100, 200]
    pieces, at = [], 3
    for i, n in enumerate(sizes):
        pieces.append((i, 0, n, at))
        at += n + (0 if i >= 7 else 77)  # the last three pieces touch: one span covers them
    spans = [(p[3], src, p[3] + 11, p[2]) for p in pieces[:7]]
    spans.append((pieces[7][3], src, 5, pieces[7][2] + pieces[8][2]))
    dst = bytearray(at + 13)
    crcs = copy_spans_crc32(dst, spans[::-1], pieces[::-1], threads)
    expect = bytearray(len(dst))
    copy_spans(expect, spans, 1)
    assert dst == expect
    assert crcs == crc32_pieces(bytes(dst), pieces[::-1])
    assert crcs[-7] != 0  # the big piece, cut between threads


@settings(max_examples=40, deadline=None)
@given(data=st.data(), threads=st.integers(1, 5))
def test_copy_spans_crc32_equals_a_copy_then_crc32_pieces(data, threads):
    """Random layouts: runs of random lengths (up to 3 MiB, so that 2-5 threads split them),
    each from a random place of a source, at random gaps in the destination, cut into random
    pieces, given in a random order: the bytes and the CRCs are copy_spans' and crc32_pieces'."""
    from ckptfs.checksum import crc32_pieces

    src = _random_bytes(8 << 20, 3)
    lengths = data.draw(st.lists(st.integers(0, 3 << 20), min_size=1, max_size=6))
    spans, pieces, at = [], [], 0
    for i, n in enumerate(lengths):
        at += data.draw(st.integers(0, 5000))
        spans.append((at, src, data.draw(st.integers(0, len(src) - n)), n))
        cuts = sorted(data.draw(st.lists(st.integers(0, n), max_size=4)))
        for lo, hi in zip([0] + cuts, cuts + [n]):
            pieces.append((i, lo, hi - lo, at + lo))
        at += n
    order = data.draw(st.permutations(range(len(spans))))
    dst, expect = bytearray(at + 7), bytearray(at + 7)
    crcs = copy_spans_crc32(dst, [spans[i] for i in order], pieces[::-1], threads)
    copy_spans(expect, spans, 1)
    assert dst == expect
    assert crcs == crc32_pieces(bytes(expect), pieces[::-1])


def test_copy_spans_crc32_refuses_a_piece_outside_the_spans():
    """A piece the spans do not fill has no CRC of copied bytes: ValueError, as for a range
    outside a buffer (a piece outside the destination is refused before any byte is copied)."""
    src = bytes(range(256)) * 64
    dst = bytearray(len(src))
    with pytest.raises(ValueError, match="piece 1 is not all inside"):
        copy_spans_crc32(dst, [(0, src, 0, 100)], [(0, 0, 100, 0), (1, 0, 10, 95)], 1)
    with pytest.raises(ValueError, match="outside"):
        copy_spans_crc32(dst, [(0, src, 0, 100)], [(0, 0, 100, len(dst) - 50)], 1)
    with pytest.raises(ValueError, match="threads"):
        copy_spans_crc32(dst, [], [], 0)


def test_scatter_targets_must_be_contiguous_host_tensors():
    with pytest.raises(ValueError, match="contiguous CPU"):
        HostTargets([torch.zeros((4, 4)).t()])


def test_copy_out_fills_whole_and_partial_sinks_across_chunks():
    """The scan's copy-out (restore.copy_out), as Store.load and a DCP load use it: whole
    tensors, row ranges of a tensor (two sinks of one), a tensor nobody asked for, a zero-byte
    one; the chunks cut tensors in pieces."""
    from ckptfs.checksum import crc32_pieces
    from ckptfs.chunks import plan_chunks
    from ckptfs.manifest import TensorRecord
    from ckptfs.restore import copy_out

    class Buf:  # a read's bounce buffer, as the scan hands it over
        def __init__(self, data: bytes):
            self.mapping = bytearray(data)
            self.tensor = torch.frombuffer(self.mapping, dtype=torch.uint8)

    sizes = [5000, 0, 9000, 3000]
    records, offset = [], 0
    for i, n in enumerate(sizes):
        records.append(TensorRecord(f"t{i}", "uint8", (n,), offset, n))
        offset += (n + 63) // 64 * 64
    area = _random_bytes(offset + 4096, 3)
    whole0, rows_a, rows_b = torch.zeros(5000, dtype=torch.uint8), torch.zeros(4000, dtype=torch.uint8), \
        torch.zeros(2500, dtype=torch.uint8)
    empty = torch.zeros(0, dtype=torch.uint8)
    sinks = {0: [(0, 5000, whole0)], 1: [(0, 0, empty)], 2: [(1000, 5000, rows_a), (6500, 9000, rows_b)]}
    on_chunk = copy_out(sinks, records)
    for chunk in plan_chunks(records, offset, 4096):
        buf = Buf(area[chunk.start:chunk.start + chunk.length].tobytes())
        assert on_chunk(buf, chunk) == crc32_pieces(buf.mapping, chunk.pieces)  # taken as it copied
    stored = [torch.from_numpy(area[r.offset:r.offset + r.nbytes].copy()) for r in records]
    assert torch.equal(whole0, stored[0])
    assert torch.equal(rows_a, stored[2][1000:5000]) and torch.equal(rows_b, stored[2][6500:9000])

    everything = [torch.zeros(n, dtype=torch.uint8) for n in sizes]  # every tensor whole: the fast path
    on_chunk = copy_out({i: [(0, n, t)] for i, (n, t) in enumerate(zip(sizes, everything))}, records)
    for chunk in plan_chunks(records, offset, 4096):
        buf = Buf(area[chunk.start:chunk.start + chunk.length].tobytes())
        assert on_chunk(buf, chunk) == crc32_pieces(buf.mapping, chunk.pieces)
    assert all(torch.equal(t, s) for t, s in zip(everything, stored))


def test_prefaulted_maps_fresh_tensors_pages_ahead_and_leaves_their_bytes():
    """prefaulted (a fresh load's tensors): the pages of big fresh tensors are mapped on its
    thread, so the copy that fills them takes almost no faults; bytes already there stay."""
    import resource

    from ckptfs.memcopy import PREFAULT_MIN_BYTES, prefaulted

    def faults_to_fill(tensors) -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for t in tensors:
            t.fill_(1)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    def fresh_tensors():  # fresh mappings (malloc may hand out memory already touched)
        maps = [mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) for _ in range(4)]
        return maps, [torch.frombuffer(m, dtype=torch.uint8) for m in maps]

    pages = 4 * (8 << 20) // 4096
    _, control = fresh_tensors()
    assert faults_to_fill(control) > pages // 2
    _, fresh = fresh_tensors()
    with prefaulted(fresh):
        pass  # its thread has ended when the block does
    assert faults_to_fill(fresh) < pages // 20
    kept = torch.arange(PREFAULT_MIN_BYTES, dtype=torch.int32)
    with prefaulted([kept]):
        pass
    assert torch.equal(kept, torch.arange(PREFAULT_MIN_BYTES, dtype=torch.int32))
