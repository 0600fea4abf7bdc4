"""``ddp-ring-hooks <command>`` / ``python -m ddp_ring_hooks <command>``."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import threading

from .. import cli
from ..interrupts import exit_promptly_on_ctrl_c, wait_for_forwarded_ctrl_c
from ..launch import under_torchrun


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per module in :mod:`ddp_ring_hooks.cli`."""
    parser = argparse.ArgumentParser(
        prog="ddp-ring-hooks",
        description="Run, measure and understand the all-reduce under DDP training.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in sorted(m.name for m in pkgutil.iter_modules(cli.__path__)):
        if module.startswith("_"):
            continue
        importlib.import_module(f"{cli.__name__}.{module}").add_parser(subparsers)
    for command in subparsers.choices.values():  # --help shows text, not docstring markup
        command.description = cli.plain(command.description)
        command.epilog = cli.plain(command.epilog)
        for action in command._actions:
            action.help = cli.plain(action.help)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen command; return its exit code."""
    args = build_parser().parse_args(argv)
    if not (under_torchrun() and threading.current_thread() is threading.main_thread()):
        return int(args.func(args) or 0)
    exit_promptly_on_ctrl_c()  # a rank of a torchrun job (bench, links): Ctrl-C ends it even while it waits in C++
    try:
        return int(args.func(args) or 0)
    except Exception as error:
        wait_for_forwarded_ctrl_c(error)  # a peer that took Ctrl-C first: this rank's is on its way
        raise


if __name__ == "__main__":
    sys.exit(main())
