"""The ``ddp-ring-hooks`` command line. Each subcommand is a module of this package.

A subcommand module defines ``add_parser(subparsers)``, which adds its parser and sets
``func`` (called with the parsed arguments, returning an exit code). Modules are found by
name, so adding a command never touches this file or ``__main__``.
"""

from __future__ import annotations

import re
import sys


def fail(command: str, message: str) -> int:
    """Print ``message`` on stderr as an error of ``ddp-ring-hooks <command>``; return 2, the
    exit code of a usage error (as argparse does)."""
    print(f"ddp-ring-hooks {command}: error: {message}", file=sys.stderr)
    return 2


def plain(text: str | None) -> str | None:
    """Docstring markup out of text shown in a terminal: ``x`` and :mod:`x` become x.

    Subcommands take their --help from their module docstrings, which Sphinx-style markup
    keeps readable in the source but litters with backticks on screen."""
    if not text:
        return text
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text)
    text = re.sub(r"``([^`]+)``", r"\1", text)
    return text.replace("::\n", ":\n")
