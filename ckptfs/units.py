"""Sizes: as people read them, in every message and listing (``human_bytes``), and rounded up to
an alignment (``align_up``)."""


def human_bytes(n: int) -> str:
    """``n`` bytes as ``512 B``, ``1.5 KiB``, ``233.0 MiB``, ... (binary units, one decimal)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def align_up(value: int, alignment: int) -> int:
    """The least multiple of ``alignment`` (> 0) that is at least ``value``."""
    return (value + alignment - 1) // alignment * alignment
