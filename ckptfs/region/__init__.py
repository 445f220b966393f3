"""The region: on-disk format, backends, pins and the slot lifecycle; the only code that knows the
byte layout (format.py) and the commit order (ring.py)."""
