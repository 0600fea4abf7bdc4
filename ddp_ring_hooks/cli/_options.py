"""The algorithms' options on the command line, made from the registry's :class:`Option` records.

Every option a registered algorithm declares becomes one flag, its name with dashes
(``segments`` -> ``--segments K``), its help the option's ``doc`` after the algorithms that
take it, its value read by the option's ``parse``::

    Option("segments", 1, "pipeline the buffer in K segments", metavar="K")   # tree's record
    --segments K   tree only: pipeline the buffer in K segments (default: 1)   # explain --help

A command adds the flags with :func:`add_option_arguments`, reads what was given with
:func:`given_options`, and hands each algorithm its share with
:func:`~ddp_ring_hooks.schedules.options_for`; so a new option appears in ``explain``,
``animate``, ``model`` and ``bench`` without a line here. Values are checked by the registry
(the option's own ``check``), as everywhere else.
"""

from __future__ import annotations

import argparse
import re

from ..schedules import get_algorithm, options_by_name


def flag(name: str) -> str:
    """The command-line spelling of an option: ``local_size`` -> ``--local-size``."""
    return "--" + name.replace("_", "-")


def add_option_arguments(parser, *, when_needed: str = "") -> None:
    """One flag per registered option (by name, so a few stay in alphabetical order) on
    ``parser`` (or an argument group). ``when_needed`` is added to the help of a required
    option (one without a usable default), ``{algorithms}`` standing for the ones that take it;
    an optional one without a default says in its ``doc`` what happens when it is left out."""
    for name, (option, owners) in sorted(options_by_name().items()):
        takers = " and ".join(", ".join(owners).rsplit(", ", 1))
        default = _defaults(name, owners)
        if option.required:
            default = when_needed.format(algorithms=takers)
        try:
            parser.add_argument(
                flag(name), dest=name, type=option.parse, default=None, metavar=option.metavar,
                help=f"{takers} only: {option.doc}{default}",
            )
        except argparse.ArgumentError as error:
            raise ValueError(
                f"the {name} option of {takers} clashes with a flag of the command itself ({error}); rename the option"
            ) from None


def _defaults(name: str, owners: tuple[str, ...]) -> str:
    """`` (default: 1)``; `` (default: 1 for tree, by buffer size for hierarchical)`` when the
    algorithms that share an option differ in its default; nothing for a default of ``None``."""
    shown: dict[str, list[str]] = {}
    for owner in owners:
        option = get_algorithm(owner).option(name)
        if option.default is None and option.per_size is not None:
            shown.setdefault("by buffer size", []).append(owner)
        elif option.default is not None:
            shown.setdefault(str(option.default), []).append(owner)
    if not shown:
        return ""
    if len(shown) == 1 and len(next(iter(shown.values()))) == len(owners):
        return f" (default: {next(iter(shown))})"
    parts = [f"{value} for {' and '.join(names)}" for value, names in shown.items()]
    return f" (default: {', '.join(parts)})"


def given_options(args: argparse.Namespace) -> dict[str, object]:
    """The options given on the command line (flags left out are not in it)."""
    return {name: getattr(args, name) for name in sorted(options_by_name()) if getattr(args, name) is not None}


def command_line_hint(message: str, algorithm: str) -> str:
    """`` (on the command line: --local-size G)`` when ``message`` names an option of
    ``algorithm`` (the registry's messages spell options as Python does)."""
    named = [option for option in get_algorithm(algorithm).options if re.search(rf"\b{option.name}\b", message)]
    return f" (on the command line: {flag(named[0].name)} {named[0].metavar})" if named else ""
