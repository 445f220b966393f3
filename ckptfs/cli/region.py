"""The commands of a region as a whole: ``mkfs``, ``upgrade``, ``status``."""
from __future__ import annotations

import json
from typing import Any

import click

from ckptfs.cli.common import cli, json_option, open_store, parse_size, region_option, table
from ckptfs.units import human_bytes


@cli.command()
@region_option
@click.option("--size", "size", metavar="SIZE",
              help="Size of a file region, e.g. 64G (default 64G, sparse). A device region takes the whole device.")
@click.option("--exist-ok", is_flag=True, help="Succeed without change if a region is already there.")
@click.option("--force", is_flag=True,
              help="Overwrite whatever is there: a region (every checkpoint in it), a file, a device holding data.")
@click.argument("path", required=False, metavar="[REGION]")
def mkfs(region, size, exist_ok, force, path):
    """Format a new region (a sparse file, a block device or a devdax device).

    REGION (or --region) defaults to the per-user default region. Refuses to overwrite an
    existing region, a non-empty file or a device holding data unless --force."""
    from ckptfs import Store, default_region_path

    if path is not None and region is not None and path != region:
        raise click.UsageError("give the region once: REGION or --region")
    region = path or region or default_region_path()

    if force and exist_ok:
        raise click.UsageError("--force and --exist-ok contradict each other: give one")
    kwargs: dict[str, Any] = {"exist_ok": exist_ok, "force": force}
    if size is not None:
        kwargs["size_bytes"] = parse_size(size)
    with Store.create(region, **kwargs) as store:
        click.echo(f"region {store.path} ready")


@cli.command()
@region_option
def upgrade(region):
    """Copy the region, written by an older ckptfs (format 1), into the current format: every
    version is copied and checked, the old file is kept as PATH.format1, then the copy takes its
    name."""
    from ckptfs.region.upgrade import upgrade as run
    from ckptfs.store import default_region_path

    region_path = region or default_region_path()
    for model, n in run(region_path):
        click.echo(f"upgraded {model}: {n} version(s)")
    click.echo(f"{region_path} now uses the current format; the old region is {region_path}.format1")
    return 0


KEPT_SHOWN = 4  # kept steps listed in status's column; more are counted (`ckptfs ls MODEL` marks each)


def _kept_column(steps: list[int]) -> str:
    """The KEPT cell: the steps, or with many (a job with keep_every keeps hundreds) the first and
    the last, and how many (they made the table hundreds of characters wide)."""
    if not steps:
        return "-"
    if len(steps) <= KEPT_SHOWN:
        return " ".join(map(str, steps))
    return f"{steps[0]}..{steps[-1]} ({len(steps)})"  # not a bare count beside VERSIONS


@cli.command()
@region_option
@json_option
def status(region, as_json):
    """Region usage, models, and the saves in flight with their progress."""
    with open_store(region) as store:
        st = store.status()
    if as_json:
        click.echo(json.dumps(st, indent=1, default=str))
        return 0
    click.echo(f"region   {st['path']} ({st['kind']}): {human_bytes(st['region_bytes'])}, "
               f"{human_bytes(st['used_bytes'])} in model rings, {human_bytes(st['free_bytes'])} free")
    if st.get("filesystem_free_bytes", 1 << 62) < st.get("unallocated_bytes", 0):
        # a sparse file: slots not written yet need blocks the filesystem no longer has
        click.echo(f"warning  the filesystem under the region has {human_bytes(st['filesystem_free_bytes'])} free "
                   f"for its {human_bytes(st['unallocated_bytes'])} not yet allocated: saves into new slots can "
                   "fail (ENOSPC); free space on that filesystem, or move the region where there is room")
    click.echo()
    table([[m["name"], m["versions"], "-" if m["latest_step"] is None else m["latest_step"],
             _kept_column(m["kept_steps"]), f"{m['slots']} (keeps {m['ring_slots']})",
             human_bytes(m["slot_bytes"]), m["saves_in_flight"],
             " ".join(f"{pid} ({cmd})" for pid, cmd in m["writers"]) or "-"] for m in st["models"]],
           ["MODEL", "VERSIONS", "LATEST", "KEPT", "SLOTS", "SLOT SIZE", "WRITING", "WRITER PROCESSES"])
    pins = [(m["name"], p) for m in st["models"] for p in m["pinned"]]
    click.echo()
    if not pins:
        click.echo("no versions pinned by readers")
    else:
        table([[name, p["step"], " ".join(f"{pid} ({cmd})" for pid, cmd in p["holders"]) + (
                    " for " + ", ".join(f"{pid} ({cmd})" for pid, cmd in p["readers"]) if p.get("readers") else "")]
                for name, p in pins], ["PINNED", "STEP", "BY PROCESS"])
    saves = st.get("saves_in_flight") or []
    click.echo()
    if not saves:
        click.echo("no saves in flight")
    else:
        table([[sv["model"], sv["step"], f"{human_bytes(sv['persisted_bytes'])} / {human_bytes(sv['total_bytes'])}",
                 f"{100 * sv['persisted_bytes'] / max(sv['total_bytes'], 1):.0f}%", sv["pid"]] for sv in saves],
               ["SAVING", "STEP", "PERSISTED", "", "PID"])
    return 0
