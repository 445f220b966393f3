"""The ``ckptfs`` command.

Every command takes ``--region PATH``, after the command or before it (``ckptfs --region R ls``;
default: ``$CKPTFS_REGION``, else the per-user default region). Errors are one line on stderr and
a non-zero exit status (1 for an error, 2 for a usage error, 130 when interrupted); a traceback is
printed only with ``CKPTFS_DEBUG=1``.

The commands live by what they act on: ``region`` (mkfs, upgrade, status), ``mounting`` (mount,
umount, install-mount-helper), ``versions`` (ls, info, verify, rm, keep, unkeep), ``transfer``
(export, import); ``common`` holds the group and what they share.
"""
from __future__ import annotations

import os
import sys

import click

from ckptfs.cli import mounting, region, transfer, versions
from ckptfs.cli.common import cli, cli_lines, one_line, say
from ckptfs.errors import CkptfsError, cli_words

__all__ = ["cli", "main"]
COMMAND_MODULES = (region, mounting, versions, transfer)  # importing each registers its commands with cli


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; exit with its status. Errors: one line on stderr, never a traceback
    (unless CKPTFS_DEBUG=1)."""
    from ckptfs.fs.daemon import MountError

    debug = os.environ.get("CKPTFS_DEBUG", "") not in ("", "0")
    try:
        with cli_words(), cli_lines():
            rv = cli.main(args=argv, prog_name="ckptfs", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.UsageError as exc:  # one line, as every other error
        where = exc.ctx.command_path if exc.ctx is not None else "ckptfs"
        click.echo(f"{where}: usage: {one_line(exc)} (see `{where} --help`)", err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except (click.exceptions.Abort, KeyboardInterrupt):
        click.echo("ckptfs: interrupted", err=True)
        sys.exit(130)
    except (CkptfsError, MountError, OSError, ValueError) as exc:  # ValueError: a bad argument
        if debug:
            raise
        say("error", one_line(exc))
        sys.exit(1)
    except Exception as exc:  # noqa: BLE001 - never a traceback for the user
        if debug:
            raise
        click.echo(f"ckptfs: internal error: {type(exc).__name__}: {one_line(exc)} "
                   "(run with CKPTFS_DEBUG=1 for details)", err=True)
        sys.exit(70)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
