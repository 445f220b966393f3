"""The snapshot copy routine (ckptfs.memcopy over the native copy_spans)."""
import mmap

import numpy as np
import pytest
import torch

from ckptfs.memcopy import copy_spans, default_copy_threads, host_bytes


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
                                  (0, b"abc", -1, 1), (0, b"abc", 0, -1)])
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
