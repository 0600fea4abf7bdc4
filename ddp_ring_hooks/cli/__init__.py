"""The ``ddp-ring-hooks`` command line. Each subcommand is a module of this package.

A subcommand module defines ``add_parser(subparsers)``, which adds its parser and sets
``func`` (called with the parsed arguments, returning an exit code). Modules are found by
name, so adding a command never touches this file or ``__main__``.
"""
