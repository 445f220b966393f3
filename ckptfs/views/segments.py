"""A view: a synthesized file described as an ordered list of segments.

A segment is either ``Literal`` bytes (headers, pickles, JSON) or an ``Extent`` of the version's
data area (offset and length of tensor bytes). A view is computed from a manifest alone; bytes
are fetched only when someone reads, through a ``read_region(offset, length)`` callable that
returns a bytes-like object of exactly ``length`` bytes (``Version.read``: checked, zero-copy).
"""
from __future__ import annotations

from bisect import bisect_right
from itertools import accumulate
from typing import Callable, Iterable, Iterator, Union

from ckptfs.gcpause import paused_gc
from ckptfs.manifest import TENSOR_ALIGN_BYTES

ReadRegion = Callable[[int, int], "bytes | bytearray | memoryview"]


class Literal:
    """Bytes that are part of the view itself."""

    # Plain slotted classes, not dataclasses: a view of a version with 40,000 tensors is built of
    # as many segments, and a frozen dataclass costs several times as much to construct.
    __slots__ = ("data",)

    def __init__(self, data: bytes):
        self.data = data

    @property
    def length(self) -> int:
        return len(self.data)

    def __eq__(self, other) -> bool:
        return type(other) is Literal and other.data == self.data

    def __hash__(self) -> int:
        return hash((Literal, self.data))

    def __repr__(self) -> str:
        return f"Literal({self.data[:32]!r}{'...' if len(self.data) > 32 else ''})"


class Extent:
    """``length`` bytes of the version's data area starting at data offset ``offset``."""

    __slots__ = ("offset", "length")

    def __init__(self, offset: int, length: int):
        if offset < 0 or length < 0:
            raise ValueError(f"extent ({offset}, {length}) has a negative offset or length")
        self.offset = offset
        self.length = length

    def __eq__(self, other) -> bool:
        return type(other) is Extent and (other.offset, other.length) == (self.offset, self.length)

    def __hash__(self) -> int:
        return hash((Extent, self.offset, self.length))

    def __repr__(self) -> str:
        return f"Extent({self.offset}, {self.length})"


Segment = Union[Literal, Extent]


class View:
    """An immutable file of ``size`` bytes made of ``segments`` laid end to end.

    Empty segments are dropped, so every kept segment covers at least one byte and the
    segment holding a given file offset is found with one bisection.
    """

    __slots__ = ("segments", "size", "_starts")

    def __init__(self, segments: Iterable[Segment]):
        self.segments: tuple[Segment, ...] = tuple(s for s in segments if s.length)
        lengths = [s.length for s in self.segments]
        # _starts[i] is the file offset of segments[i]; the extra last entry is the file size.
        self._starts: list[int] = [0, *accumulate(lengths)]
        self.size: int = self._starts[-1]

    def __repr__(self) -> str:
        return f"View(size={self.size}, segments={len(self.segments)})"

    def read(self, offset: int, size: int, read_region: ReadRegion) -> bytes:
        """Bytes ``[offset, offset + size)`` of the file; shorter (possibly empty) past its end."""
        if offset < 0 or size < 0:
            raise ValueError(f"read({offset}, {size}): offset and size must be >= 0")
        end = min(offset + size, self.size)
        if offset >= end:
            return b""
        pieces: list = []
        run: list = []  # literals, and extents stored close together: their bytes read as one span
        last_end = -1  # the data offset where the run's last extent ends (-1: none yet)
        i = bisect_right(self._starts, offset) - 1
        pos = offset
        while pos < end:
            seg, seg_start = self.segments[i], self._starts[i]
            lo, hi = pos - seg_start, min(end - seg_start, seg.length)
            if type(seg) is Literal:
                run.append(seg.data[lo:hi])
            else:
                at = seg.offset + lo
                if last_end >= 0 and not _close_after(last_end, at):
                    pieces.extend(_read_run(run, read_region))
                run.append((at, hi - lo))
                last_end = at + hi - lo
            pos = seg_start + hi
            i += 1
        pieces.extend(_read_run(run, read_region))
        return pieces[0] if len(pieces) == 1 and type(pieces[0]) is bytes else b"".join(pieces)

    def iter_blocks(self, read_region: ReadRegion, block_bytes: int = 8 << 20) -> Iterator:
        """The whole file, in order, as bytes-like blocks: literals whole, extents in pieces of at
        most ``block_bytes``, extents stored close together (as ``read``) from one
        ``read_region`` of at most ``block_bytes`` (zero-copy where it returns memoryviews), so a
        consumer must use each block before asking for the next if ``read_region`` reuses
        buffers.
        """
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be > 0, got {block_bytes}")
        run: list = []  # as in read: literals and close extents, their bytes read as one span
        first = last_end = -1  # where the run's first extent starts and its last ends
        for seg in self.segments:
            if type(seg) is Literal:
                if run:
                    run.append(seg.data)
                else:
                    yield seg.data
                continue
            for lo in range(0, seg.length, block_bytes):
                at, n = seg.offset + lo, min(block_bytes, seg.length - lo)
                if run and not (_close_after(last_end, at) and at + n - first <= block_bytes):
                    yield from _read_run(run, read_region)
                if not run:
                    first = at
                run.append((at, n))
                last_end = at + n
        yield from _read_run(run, read_region)


class LazyView(View):
    """A View whose size is known at once and whose segments are made on first use: listing a
    version (a stat per file) needs sizes only, and a large index's segments cost more to make
    than its size costs to compute. ``build()`` gives the segments; AssertionError if they do
    not add up to ``size`` (the two computations disagree: a bug, never served)."""

    __slots__ = ("_build",)

    def __init__(self, size: int, build: Callable[[], Iterable[Segment]]):  # noqa: super() not called: lazy
        self.size = size
        self._build = build

    def __getattr__(self, name: str):
        # only for the slots not set yet: the segments and their starts
        if name not in ("segments", "_starts"):
            raise AttributeError(name)
        with paused_gc():  # tens of thousands of segments: see ckptfs.gcpause
            built = View(self._build())
        if built.size != self.size:
            raise AssertionError(f"a view's segments hold {built.size} bytes, its size says {self.size}")
        self.segments, self._starts = built.segments, built._starts
        return getattr(self, name)


def _close_after(end: int, at: int) -> bool:
    """Whether an extent stored at ``at`` may join a run whose last extent ends at ``end``: it
    starts less than ``TENSOR_ALIGN_BYTES`` after, so no other tensor lies between (see
    ``_read_run``)."""
    return 0 <= at - end < TENSOR_ALIGN_BYTES


def _read_run(run: list, read_region: ReadRegion) -> list:
    """The bytes of ``run``, in order, and ``run`` emptied. ``run``: literal bytes and
    (data offset, length) extents, the extents in ascending order, each starting less than
    ``TENSOR_ALIGN_BYTES`` after the one before it ends; their bytes come from one ``read_region``
    of their span. A read of 1 MiB of a file of 40,000 small tensors is then one read of the data
    area, not one per tensor, and, the gaps being smaller than the tensors' alignment, the span
    holds no byte of a tensor that is not in the file (whose damage would fail this read)."""
    extents = [item for item in run if type(item) is tuple]
    if len(extents) == 1 and len(run) == 1:
        out = [read_region(*extents[0])]
    elif extents:
        base = extents[0][0]
        span = memoryview(read_region(base, extents[-1][0] + extents[-1][1] - base))
        out = [span[item[0] - base:item[0] - base + item[1]] if type(item) is tuple else item for item in run]
    else:
        out = list(run)
    run.clear()
    return out


class ViewBuilder:
    """Appends segments in file order, coalescing adjacent literals into one and an extent that
    continues the one before it (the next tensor stored right after the last) into one.

    ``position`` is the file offset the next appended byte will have, which is what format
    writers need to compute their own offsets (zip local-header offsets, alignment padding).
    """

    def __init__(self) -> None:
        self._segments: list[Segment] = []
        self._pending: list[bytes] = []  # literal pieces, joined into one Literal when flushed
        self._extent_offset = self._extent_length = 0  # the extent being extended, if length > 0
        self.position = 0

    def literal(self, data: bytes) -> None:
        if data:
            if self._extent_length:
                self._flush_extent()
            self._pending.append(data)
            self.position += len(data)

    def extent(self, offset: int, length: int) -> None:
        self.extents(((offset, length),))

    def extents(self, pairs) -> None:
        """``length`` bytes at data offset ``offset`` for each (offset, length), in order; one
        that continues the extent before it (the next tensor stored right after the last) is
        merged into it. One call for the tensors of a file: a safetensors view of 40,000
        tensors is made on the first listing of its version."""
        if self._extent_length:
            start, end = self._extent_offset, self._extent_offset + self._extent_length
        else:
            start = end = -1
        added = 0
        for offset, length in pairs:
            if length <= 0 or offset < 0:
                if length == 0:
                    continue
                raise ValueError(f"extent ({offset}, {length}) has a negative offset or length")
            if self._pending:
                self._flush_literal()
            added += length
            if offset == end:
                end += length
                continue
            if start >= 0:
                self._segments.append(Extent(start, end - start))
            start, end = offset, offset + length
        self.position += added
        self._extent_offset, self._extent_length = (start, end - start) if start >= 0 else (0, 0)

    def build(self) -> View:
        self._flush_literal()
        self._flush_extent()
        return View(self._segments)

    def _flush_literal(self) -> None:
        if self._pending:
            self._segments.append(Literal(b"".join(self._pending)))
            self._pending = []

    def _flush_extent(self) -> None:
        if self._extent_length:
            self._segments.append(Extent(self._extent_offset, self._extent_length))
            self._extent_length = 0
