"""``python -m ckptfs.cli``: the ``ckptfs`` command."""
from ckptfs.cli import main

main()
