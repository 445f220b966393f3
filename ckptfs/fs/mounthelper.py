"""The mount(8) helper: ``mount -t fuse.ckptfs REGION DIR`` and fstab lines run
``/sbin/mount.fuse.ckptfs``, a copy of ``mount.ckptfs`` (beside this module) that names the
``ckptfs`` of the Python environment that installed it."""
from __future__ import annotations

import os
from importlib import resources

from ckptfs.errors import CkptfsError
from ckptfs.fs.daemon import cli_argv

HELPER_NAMES = ("mount.fuse.ckptfs", "mount.ckptfs")  # what mount(8) looks for, and the short name
_UNSET = '\nINSTALLED_BIN=""\n'


def helper_text(command: list[str]) -> str:
    """The helper script with ``command`` (argv words) as the ckptfs it runs."""
    bad = [w for w in command if not w or any(c.isspace() or c in "'\"$`\\" for c in w)]
    if bad:
        raise CkptfsError(f"cannot name {bad[0]!r} in the mount helper (a shell word without spaces or quotes "
                          "is needed); set CKPTFS_BIN in the helper's environment instead")
    text = resources.files("ckptfs.fs").joinpath("mount.ckptfs").read_text()
    if _UNSET not in text:
        raise CkptfsError("the packaged mount.ckptfs has no INSTALLED_BIN line; reinstall ckptfs")
    return text.replace(_UNSET, f"\nINSTALLED_BIN='{' '.join(command)}'\n", 1)


def install(directory: str = "/sbin", command: list[str] | None = None) -> list[str]:
    """Write the helper into ``directory`` as ``mount.fuse.ckptfs`` (mode 755, replaced
    atomically) with ``mount.ckptfs`` a symlink to it; returns both paths. ``command``: the ckptfs
    to run (default: this interpreter's ``-m ckptfs.cli``)."""
    text = helper_text(command or cli_argv())
    main, short = (os.path.join(directory, n) for n in HELPER_NAMES)
    tmp = f"{main}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o755)
    os.replace(tmp, main)
    if os.path.lexists(short):
        os.unlink(short)
    os.symlink(HELPER_NAMES[0], short)
    return [main, short]
