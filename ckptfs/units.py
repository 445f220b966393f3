"""Sizes as people read them, in every message and listing."""


def human_bytes(n: int) -> str:
    """``n`` bytes as ``512 B``, ``1.5 KiB``, ``233.0 MiB``, ... (binary units, one decimal)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
