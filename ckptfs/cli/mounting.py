"""The mount: ``mount``, ``umount``, ``install-mount-helper``."""
from __future__ import annotations

import logging
import os
import sys

import click

from ckptfs.cli.common import cli, one_line, open_store, region_option, stop_cli_lines
from ckptfs.errors import CkptfsError
from ckptfs.fs.daemon import READAHEAD_KB
from ckptfs.fs.readers import MOUNT_COMMAND
from ckptfs.mounttable import is_mount_of


@cli.command()
@region_option
@click.option("--foreground", "-f", is_flag=True, help="Stay in the foreground (for debugging and services).")
@click.option("--allow-other", is_flag=True, help="Let other users read the mount (root, or user_allow_other).")
@click.option("-o", "options", multiple=True, metavar="OPT[,OPT...]",
              help="Mount options: views=ID[:ID...] shows only those views' files (ids: see below); "
                   "anything else goes to libfuse.")
@click.option("--auto-unmount/--no-auto-unmount", default=True, show_default=True,
              help="Have fusermount3 unmount if the daemon dies.")
@click.option("--readahead-kb", type=click.IntRange(0), default=READAHEAD_KB, show_default=True,
              help="Kernel readahead of the mount (root only; 0: leave FUSE's 128 KiB).")
@click.option("--log-file", type=click.Path(dir_okay=False), help="Where the daemon logs (default: stderr).")
@click.option("--debug", is_flag=True, help="Verbose log: pyfuse3 internals and every error answered to the kernel.")
@click.option("--ready-fd", type=int, hidden=True)
@click.argument("paths", nargs=-1, metavar="[REGION] MOUNTPOINT")
def mount(region, foreground, allow_other, options, auto_unmount, readahead_kb, log_file, debug, ready_fd,
          paths):
    """Mount the region at MOUNTPOINT: /MODEL/latest, /MODEL/step-NNNNNNNN/{checkpoint.pt, ...}.

    The region is --region's, or REGION's where it is given first, as mount(8) takes a source
    and a directory (`ckptfs mount run.region /ckpt`).

    Returns once the mount is up; the daemon keeps serving in the background (--foreground to
    stay attached). Unmount with `ckptfs umount MOUNTPOINT`, or SIGTERM/SIGINT to the daemon.

    Views (-o views=torch:metadata; ':' or '+' between ids): torch (checkpoint.pt), safetensors
    (state.safetensors, KEY.safetensors), metadata (metadata.json), files (the extra files saved
    with a version), hf (hf/, where a config.json was saved); default: all.
    """
    from ckptfs.fs import daemon

    region, mountpoint = _region_and_mountpoint(region, paths)
    mountpoint = os.path.abspath(mountpoint)
    extra = [o.strip() for opt in options for o in opt.split(",")]
    views = _views_option(extra)
    if not foreground:
        daemon.check_mountpoint(mountpoint)
        store = open_store(region, create=True)  # report a bad region here, from the caller
        path = os.path.abspath(store.path)  # the daemon runs in /
        store.close()
        argv = daemon.cli_argv() + ["mount", "--foreground", "--region", path, mountpoint]
        argv += ["--allow-other"] * allow_other + [f"-o{o}" for o in extra]
        argv += [] if auto_unmount else ["--no-auto-unmount"]
        argv += ["--readahead-kb", str(readahead_kb)]
        argv += ["--log-file", os.path.abspath(log_file)] if log_file else []
        argv += ["--debug"] if debug else []
        daemon.spawn_background(argv)
        return 0

    handler = logging.FileHandler(log_file) if log_file else logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s ckptfs[%(process)d] %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    stop_cli_lines()
    root.setLevel(logging.DEBUG if debug else logging.INFO)
    if ready_fd is not None:
        os.chdir("/")
    try:
        store = open_store(region, create=True)
    except CkptfsError as exc:
        daemon.report_failure(ready_fd, str(exc))
        raise
    _name_process(MOUNT_COMMAND)  # `ckptfs status` looks behind it for the processes reading the mount
    try:
        daemon.serve(store, mountpoint, allow_other=allow_other, auto_unmount=auto_unmount,
                     extra_options=[o for o in extra if not o.startswith("views=")], views=views,
                     readahead_kb=readahead_kb,
                     on_ready=daemon.ready_signaller(ready_fd))
    except (CkptfsError, daemon.MountError, OSError) as exc:
        daemon.report_failure(ready_fd, one_line(exc))
        raise
    finally:
        store.close()
    return 0


def _region_and_mountpoint(region: str | None, paths: tuple[str, ...]) -> tuple[str | None, str]:
    """The region and mount point of `ckptfs mount [REGION] MOUNTPOINT`; UsageError for more
    paths, or for a REGION that --region contradicts."""
    if not paths or len(paths) > 2:
        raise click.UsageError(f"got {len(paths) or 'no'} paths; give [REGION] MOUNTPOINT")
    if len(paths) == 1:
        return region, paths[0]
    given, mountpoint = paths
    if region is not None and os.path.abspath(region) != os.path.abspath(given):
        raise click.UsageError(f"two regions given: --region {region} and {given}; give one")
    return given, mountpoint


def _views_option(options: list[str]) -> tuple[str, ...] | None:
    """The view ids of ``-o views=ID[:ID...]`` (the last one given), or None; UsageError for an
    unknown id."""
    from ckptfs.views import check_view_ids

    given = [o[len("views="):] for o in options if o.startswith("views=")]
    if not given:
        return None
    ids = tuple(v for v in given[-1].replace("+", ":").split(":") if v)
    if not ids:
        raise click.UsageError("-o views= needs at least one view id, e.g. -o views=torch:metadata")
    try:
        return check_view_ids(ids)
    except ValueError as e:
        raise click.UsageError(f"-o views={given[-1]}: {e}") from None


@cli.command()
@region_option
@click.argument("mountpoint", type=click.Path(file_okay=False))
def umount(region, mountpoint):
    """Unmount a ckptfs mount (lazily if it is busy: it goes when its last user closes it)."""
    from ckptfs.fs import daemon

    entry = daemon.mount_entry(mountpoint)
    if region is not None and entry is not None and not is_mount_of(entry[1], region):
        raise daemon.MountError(f"{mountpoint} shows region {entry[1]}, not {region}")
    if daemon.umount(mountpoint) == "detached":
        click.echo(f"{mountpoint} is busy: detached it; it goes away when its last user closes it", err=True)
    return 0


@cli.command(name="install-mount-helper")
@click.option("--dir", "directory", default="/sbin", show_default=True, type=click.Path(file_okay=False),
              help="Where mount(8) looks for helpers.")
def install_mount_helper(directory):
    """Install the mount(8) helper (root), so that `mount -t fuse.ckptfs REGION DIR` and fstab
    lines work; it runs the ckptfs of this Python environment.

    \b
    fstab:  /var/lib/ckptfs/default.region  /ckpt  fuse.ckptfs  defaults,allow_other,nofail  0  0"""
    from ckptfs.fs import mounthelper

    if not os.path.isdir(directory):
        raise CkptfsError(f"no directory {directory}; give an existing one with --dir")
    for path in mounthelper.install(directory):
        click.echo(f"installed {path}")
    return 0


def _name_process(name: str) -> None:
    """This process's name in ps, top and /proc (the daemon was "python3")."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name)
    except OSError:
        pass  # not Linux's /proc: only a name
