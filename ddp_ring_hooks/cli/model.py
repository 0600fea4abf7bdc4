"""``ddp-ring-hooks model``: what the α-β-γ model predicts, per algorithm and world size.

The article's table done right: the same buffer, the same links, every algorithm, several
world sizes side by side, and the two lessons the numbers teach printed under the table::

    $ ddp-ring-hooks model --size 1GB --world-sizes 4,8,64 --bandwidth 100GB/s --latency 5us

On two tiers (``--placement``: nodes whose ranks share one uplink) every row is priced from
its schedule on that network (:class:`~ddp_ring_hooks.cost_model.TwoTier`): ``--bandwidth``
and ``--latency`` are each node's uplink, ``--local-bandwidth`` and ``--local-latency`` the
links inside a node::

    $ ddp-ring-hooks model --size 16M --world-sizes 4,8 --placement 2 --local-size 2 \
        --bandwidth 400Mb/s --latency 200us --local-bandwidth 1GB/s --local-latency 50us

Sizes are binary (K, KB, KiB = 1024 bytes, as ``bench`` reads them); bandwidths are decimal,
as links are quoted: ``GB/s`` = 1e9 bytes/s, ``GiB/s`` = 2^30, bits as ``Gb/s`` or ``Gbit/s``;
latencies ns, us (µs), ms, s.
"""

from __future__ import annotations

import argparse
import re
import textwrap
from collections.abc import Mapping

from ..cost_model import Links, TwoTier, coefficients, predict
from ..schedules import algorithm_names, check_given_options, get_algorithm, options_for
from ..units import SIZE_HELP, parse_size  # noqa: F401 - one size parser for every command
from ..units import format_bytes as format_size
from ..viz.text import format_seconds
from . import fail
from ._options import add_option_arguments, given_options

_SIZE_UNITS = {  # of bandwidths only: GB/s is 1e9 B/s as links are quoted
    "": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_BIT_PREFIXES = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_bandwidth(text: str) -> float:
    """Bytes per second: ``"100GB/s"`` -> 1e11; a lower-case b means bits: ``"25Gb/s"`` -> 3.125e9."""
    number, unit = _split(text, "bandwidth", "100GB/s or 25Gbit/s")
    if number <= 0:
        raise ValueError(f"bandwidth must be positive, got {text!r}")
    per = unit.removesuffix("/s").removesuffix("ps")  # GB/s, GBps, Gbit/s, Gbps
    if per.endswith("bit"):
        per = per[:-3] + "b"
    if per.endswith("b") and per[:-1].lower() in _BIT_PREFIXES:
        return number * _BIT_PREFIXES[per[:-1].lower()] / 8
    if per and per.lower() in _SIZE_UNITS:
        return number * _SIZE_UNITS[per.lower()]
    raise ValueError(f"unknown bandwidth unit {unit!r} in {text!r}; use e.g. GB/s, MiB/s or Gb/s (bits)")


def parse_time(text: str) -> float:
    """Seconds: ``"5us"`` -> 5e-6, ``"2ms"`` -> 2e-3."""
    number, unit = _split(text, "latency", "5us or 2ms")
    if unit.lower() not in _TIME_UNITS:
        raise ValueError(f"unknown time unit {unit!r} in {text!r}; use ns, us, ms or s")
    return number * _TIME_UNITS[unit.lower()]


def _split(text: str, what: str, examples: str) -> tuple[float, str]:
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([^\s0-9].*)?\s*", text)
    if not match:
        raise ValueError(f"cannot read {what} {text!r}; write a number and a unit, e.g. {examples}")
    return float(match.group(1)), (match.group(2) or "").strip()


def format_bytes(nbytes: float) -> str:
    """``1.0 GB``, ``64 KB``: powers of 1000, as bandwidths are quoted."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale * (1 - 1e-9):  # 1 / (1 / 1e9) is a hair under 1e9
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.3g} B"


def add_parser(subparsers) -> None:
    """Add ``model`` to the CLI."""
    parser = subparsers.add_parser(
        "model",
        help="predicted all-reduce time per algorithm and world size (alpha-beta-gamma model)",
        description=__doc__.split("\n\n")[0],
        epilog=f"{SIZE_HELP} Bandwidths are decimal (GB/s = 1e9 B/s; Gb/s in bits).",
    )
    parser.add_argument("--size", default="1GB", help="bytes per rank to all-reduce, e.g. 64K or 1GB; a comma list gives one table each (default: 1GB)")
    parser.add_argument("--world-sizes", default="4,8,64", help="comma-separated numbers of ranks, one column each (default: 4,8,64)")
    parser.add_argument("--bandwidth", default="100GB/s", help="link bandwidth, e.g. 100GB/s or 200Gb/s (default: 100GB/s)")
    parser.add_argument("--latency", default="5us", help="per-message latency alpha, e.g. 5us (default: 5us)")
    parser.add_argument("--reduce-bandwidth", default=None, help="rate of local additions, e.g. 400GB/s (gamma = 1/rate; default: free)")
    add_option_arguments(parser, when_needed="; adds the {algorithms} row")
    parser.add_argument("--local-bandwidth", default=None,
                        help="bandwidth of the links inside a node (hierarchical's; every row's with --placement; "
                             "default: --bandwidth)")
    parser.add_argument("--local-latency", default=None, help="latency inside a node (default: --latency)")
    parser.add_argument("--placement", default=None, metavar="G|N0,N1,...",
                        help="two tiers: nodes of G consecutive ranks, or the node of each rank (e.g. 0,1,0,1), "
                             "whose ranks share one uplink at --bandwidth/--latency; every row is priced from its "
                             "schedule on that network")
    parser.add_argument("--algorithms", default=",".join(priced_without_options()),
                        help="comma-separated rows (default: every algorithm the model prices with its options' "
                             "defaults; one that needs an option joins when the option is given)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print one table per size; return 0, or 2 with a message on bad input."""
    try:
        sizes = [parse_size(s) for s in args.size.split(",")]
        world_sizes = [int(p) for p in args.world_sizes.split(",")]
        links = links_from_flags(args, gamma=1 / parse_bandwidth(args.reduce_bandwidth) if args.reduce_bandwidth else 0.0)
        network = two_tier_network(args.placement, links)
        algorithms = [a.strip() for a in args.algorithms.split(",")]
        given = given_options(args)
        algorithms += [a for a in algorithms_needing(given) if a not in algorithms]
        for algorithm in algorithms:
            get_algorithm(algorithm)  # one message for an unknown name
        check_given_options(given)  # each option's own check, before any row is priced
        if min(world_sizes) < 1:
            raise ValueError("world sizes must be >= 1")
    except ValueError as error:
        return fail("model", str(error))
    for index, nbytes in enumerate(sizes):
        if index:
            print()
        print(render_table(nbytes, world_sizes, algorithms, links, given, network=network))
    return 0


def links_from_flags(args: argparse.Namespace, *, gamma: float = 0.0) -> Links:
    """``--latency``, ``--bandwidth`` (and ``--local-latency``, ``--local-bandwidth``: the links
    inside a node, each defaulting to the other tier's) as the network's one value."""
    alpha, beta = parse_time(args.latency), 1 / parse_bandwidth(args.bandwidth)
    local = None
    if args.local_latency or args.local_bandwidth:
        local = Links(parse_time(args.local_latency) if args.local_latency else alpha,
                      1 / parse_bandwidth(args.local_bandwidth) if args.local_bandwidth else beta)
    return Links(alpha, beta, gamma, local=local)


def two_tier_network(placement: str | None, links: Links) -> TwoTier | None:
    """``--placement`` as a :class:`TwoTier` network on ``links`` (``None`` without it): ``G`` or ``N0,N1,...``."""
    if placement is None:
        return None
    nodes = [int(word) for word in placement.split(",")]
    where = {"ranks_per_node": nodes[0]} if len(nodes) == 1 else {"placement": tuple(nodes)}
    if len(nodes) == 1 and nodes[0] < 1:
        raise ValueError(f"--placement {placement}: a node holds at least one rank")
    return TwoTier(links, **where)


def priced_without_options() -> list[str]:
    """Algorithms the model prices from the network alone: a cost formula, and a default for
    every option (hierarchical needs --local-size; native has no formula)."""
    return [
        name for name in algorithm_names()
        if get_algorithm(name).cost is not None and not any(o.required for o in get_algorithm(name).options)
    ]


def algorithms_needing(given: dict) -> list[str]:
    """Algorithms with a formula that an option given on the command line makes priceable."""
    return [
        name for name in algorithm_names()
        if get_algorithm(name).cost is not None
        and any(o.required and given.get(o.name) is not None for o in get_algorithm(name).options)
    ]


def no_formula_note(algorithm: str) -> str:
    """What ``model`` says instead of a number for an algorithm without a formula."""
    return (
        f"{algorithm}: no formula. It is {get_algorithm(algorithm).summary}: NCCL or gloo pick their ring, "
        "tree or other algorithm inside, per size and topology, so there is no schedule to price; measure "
        f"it with 'ddp-ring-hooks bench --algorithms ring,{algorithm}' or in training with "
        f"register(model, algorithm=\"{algorithm}\", log_dir=...)."
    )


def row_name(algorithm: str, options: Mapping[str, object]) -> str:
    """``tree (4 segments)``: the algorithm, and its options that differ from their defaults."""
    shown = [o.describe(options[o.name]) for o in get_algorithm(algorithm).options if options.get(o.name, o.default) != o.default]
    return f"{algorithm} ({', '.join(shown)})" if shown else algorithm


def render_table(nbytes, world_sizes, algorithms, links: Links, given: Mapping[str, object], *,
                 network: TwoTier | None = None) -> str:
    """The table for one size plus the lines that explain it; ``given``: the options given on
    the command line, each row taking those of its algorithm; ``network``: two tiers, every
    row priced on it."""
    gamma = f", gamma {links.gamma * 1e12:.3g} ps/B" if links.gamma else ""
    lines = [
        f"all-reduce of {format_size(nbytes)} per rank: alpha {format_seconds(links.alpha)}, "
        f"bandwidth {format_bytes(1 / links.beta)}/s{gamma}",
    ]
    if network is not None:
        where = (f"nodes of {network.ranks_per_node} ranks" if network.placement is None
                 else f"nodes {', '.join(map(str, network.placement))}")
        inside = network.links.inside
        lines[0] = (f"{lines[0]} per node's uplink, shared by its ranks ({where}); inside a node alpha "
                    f"{format_seconds(inside.alpha)}, bandwidth {format_bytes(1 / inside.beta)}/s")
    header = ["algorithm"] + [f"p={p}" for p in world_sizes]
    rows = [header]
    for algorithm in algorithms:
        if get_algorithm(algorithm).cost is None:  # no formula (native): say so instead of guessing
            rows.append([algorithm] + ["n/a"] * len(world_sizes))
            continue
        options = options_for(algorithm, given)
        cells = [row_name(algorithm, options)]
        for p in world_sizes:
            try:
                if network is not None:
                    cells.append(format_seconds(network.predict(algorithm, nbytes, p, **options)))
                else:
                    cells.append(format_seconds(predict(algorithm, nbytes, p, links, **options)))
            except ValueError:  # no formula, or options that do not fit p ranks (a node size not dividing p)
                cells.append("-")
        rows.append(cells)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
    notes = explain(nbytes, world_sizes, links, given) if network is None else [
        "", "two tiers: a step that crosses nodes waits for the busiest uplink, which carries every crossing "
        "hop of its node's ranks; the ring pushes 2(p-1)/p*n*h through it (h: its hops leaving one node, 1 when "
        "ranked node by node), hierarchical 2(N-1)/N*n on N nodes (docs/algorithms.md, Two tiers).",
    ]
    notes += [no_formula_note(a) for a in algorithms if get_algorithm(a).cost is None]
    lines += [textwrap.fill(line, width=100, subsequent_indent="  ") for line in notes]
    return "\n".join(lines)


def explain(nbytes: float, world_sizes: list[int], links: Links, given: Mapping[str, object] | None = None) -> list[str]:
    """How the ring's time grows with p at this size (barely when bandwidth-bound, steeply when
    latency-bound), and below which size the tree beats it (with the tree's options in ``given``)."""
    alpha, beta, gamma = links.alpha, links.beta, links.gamma
    low, high = min(world_sizes), max(world_sizes)
    if high < 2:
        return ["", "one rank: nothing to communicate."]
    ring_options = options_for("ring", given or {})  # the ring as the table's row prices it (its wire)
    ring = {p: coefficients("ring", p, **ring_options) for p in (low, high)}
    sent = {p: format_seconds(ring[p][1] * nbytes * beta) for p in (low, high)}
    latency = {p: format_seconds(ring[p][0] * alpha) for p in (low, high)}
    smallest = predict("ring", nbytes, max(low, 2), links, **ring_options)
    growth = predict("ring", nbytes, high, links, **ring_options) / smallest if smallest > 0 else 1.0
    if growth < 1.5:  # bandwidth-bound: the lesson of the article's table
        # The table's cells are the whole time: say how the two parts named here add up to them.
        total = {p: format_seconds(predict("ring", nbytes, p, links, **ring_options)) for p in (low, high)}
        ring_line = (
            f"ring barely grows with p: each rank sends 2(p-1)/p of the buffer, {sent[low]} at p={low} and "
            f"{sent[high]} at p={high}, never more than 2n/B = {format_seconds(2 * nbytes * beta)}; only its "
            f"latency 2(p-1)*alpha grows linearly, {latency[low]} -> {latency[high]}. The table adds "
            f"{'latency and reduction' if gamma else 'the two'}: {total[low]} at p={low}, {total[high]} at p={high}."
        )
    else:  # latency-bound: say so, the table shows it
        ring_line = (
            f"ring grows {growth:.3g}x from p={low} to p={high} at this size: its latency 2(p-1)*alpha, "
            f"{latency[low]} -> {latency[high]}, outweighs the bytes each rank sends, {sent[low]} -> {sent[high]} "
            f"(never more than 2n/B); algorithms with fewer steps win here."
        )
    lines = ["", ring_line]
    tree_options = options_for("tree", given or {})
    tree_name = row_name("tree", tree_options)
    for p in world_sizes:
        if p < 2:
            continue
        ring_steps, ring_sent, ring_added = coefficients("ring", p, **ring_options)
        tree_steps, tree_sent, tree_added = coefficients("tree", p, **tree_options)
        saved = (ring_steps - tree_steps) * alpha  # latency the tree saves
        extra = (tree_sent - ring_sent) * beta + (tree_added - ring_added) * gamma  # per byte it pays more
        if saved > 0 and extra > 0:
            lines.append(f"{tree_name} at p={p}: {tree_steps:g} latency steps instead of {ring_steps:g}; "
                         f"it beats the ring below {format_size(saved / extra)} per rank.")
    lines.append("halving_doubling: the ring's bytes in 2 lg p steps when p is a power of two; "
                 "otherwise its fold adds two whole-buffer messages.")
    return lines
