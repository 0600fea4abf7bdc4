"""``ddp-ring-hooks lab``: an emulated cluster on this machine (needs root), and jobs on it.

    ddp-ring-hooks lab up --hosts 4 --link 400Mbit                   # kept until `lab down`
    ddp-ring-hooks lab up --hosts 4 --nodes 2 --uplink 400Mbit --slow 3:100Mbit
    ddp-ring-hooks lab status
    ddp-ring-hooks lab run -- hostname -I                            # once on every host
    ddp-ring-hooks lab torchrun train_examples/ddp_ring.py --steps 20   # one torchrun agent per host
    ddp-ring-hooks lab down                                          # --stale: labs whose owner died
    ddp-ring-hooks lab table --world-sizes 2,4,8 --sizes 16M         # the seed's naive-vs-ring table, measured

``run`` and ``torchrun`` use the lab that ``up`` made; given --hosts (and --link, ...), they
bring up a lab of their own for the command and remove it afterwards:

    ddp-ring-hooks lab torchrun --hosts 4 --link 400Mbit -m ddp_ring_hooks bench -b 1M -e 64M

Each host is a network namespace with one link to a switch, shaped in both directions with a
``tbf`` qdisc; processes get torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT), GLOO_SOCKET_IFNAME and
DDP_RING_HOOKS_LAB_LINK (the slowest link's rate, which ``bench`` reads). Host 0's output is
printed as it comes, the others' after ``[host i]``. See docs/lab.md.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import textwrap

from ..lab import (
    RATE_HELP, EmulatedCluster, LabError, remove_kept_labs, remove_stale_labs, status_report,
)
from . import fail
from ._seed_table import add_table_parser


class _CommandParser(argparse.ArgumentParser):
    """A parser whose own options come first: the first word that is not one of them (or the
    words after ``--``) is the command, kept whole, dashes and all, in ``command``; so that
    ``lab torchrun --hosts 2 -m ddp_ring_hooks bench -b 1M`` hands ``-m ... -b 1M`` to torchrun."""

    def parse_known_args(self, args=None, namespace=None):
        if not any(action.dest == "command" for action in self._actions):
            return super().parse_known_args(args, namespace)
        args = list(sys.argv[1:] if args is None else args)
        own = 0
        while own < len(args) and args[own] != "--":
            action = self._option_string_actions.get(args[own].split("=", 1)[0])
            if action is None:
                break
            own += 1 if "=" in args[own] or action.nargs == 0 else 2
        command = args[own + 1:] if own < len(args) and args[own] == "--" else args[own:]
        namespace, extras = super().parse_known_args(args[:own], namespace)
        namespace.command = command
        return namespace, extras


def add_parser(subparsers) -> None:
    """Add the ``lab`` subcommand and its actions."""
    parser = subparsers.add_parser(
        "lab", help="an emulated cluster on this machine: hosts as network namespaces, shaped links",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=RATE_HELP,
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True, parser_class=_CommandParser)

    up = actions.add_parser("up", help="bring up a lab that stays until `lab down`", epilog=RATE_HELP,
                            description="Bring up a lab and keep it (after this command ends) until `lab down`.")
    _add_shape_arguments(up, required=True)
    up.set_defaults(func=run_up)

    down = actions.add_parser("down", help="remove the lab made by `lab up` (or NAME; --stale: orphaned labs)",
                              description="Remove labs made by `lab up` (all of them, or NAME). With --stale instead, "
                                          "every lab whose owner process is gone. Labs that a running process owns "
                                          "are never removed from here; their owner removes them.")
    down.add_argument("name", nargs="?", metavar="NAME", help="the lab to remove, e.g. drh0 (default: those of `lab up`)")
    down.add_argument("--stale", action="store_true", help="remove only the labs whose owner process is gone")
    down.set_defaults(func=run_down)

    status = actions.add_parser("status", help="list the labs: shape, owner, each host's address and namespace",
                                description="List every lab on this machine: its shape, owner, hosts and addresses.")
    status.set_defaults(func=run_status)

    for name, what, example in (
        ("run", "run CMD once on every host, with torchrun's variables set",
         "ddp-ring-hooks lab run -- python -c 'import os; print(os.environ[\"RANK\"])'"),
        ("torchrun", "start one torchrun agent per host (c10d rendezvous on host 0) with these torchrun options",
         "ddp-ring-hooks lab torchrun --hosts 2 --link 400Mbit train_examples/ddp_ring.py --steps 5"),
    ):
        job = actions.add_parser(
            name, help=what, epilog=RATE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
            description=f"{what[0].upper()}{what[1:]}.\n\n    {example}\n\n" + textwrap.fill(
                "The lab's options come first; the first word that is not one of them (or everything after --) "
                "is the command. Without --hosts, it runs on the lab that `lab up` made (or --lab NAME); with "
                "--hosts, on a lab of its own, removed afterwards. Exit status: 0 when every host succeeded, "
                "else the first failing host's.", width=90),
        )
        job.add_argument("--lab", metavar="NAME", help="run on this lab (default: the one `lab up` made)")
        _add_shape_arguments(job, required=False)
        job.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                         help="kill the job on every host after this long (default: no limit)")
        job.add_argument("command", nargs=argparse.REMAINDER, metavar="CMD ..." if name == "run" else "[torchrun options] SCRIPT ...")
        job.set_defaults(func=run_job, launcher=name)

    add_table_parser(actions)


def _add_shape_arguments(parser: argparse.ArgumentParser, *, required: bool) -> None:
    shape = parser.add_argument_group("the lab" if required else "a lab of its own for this command (instead of `lab up`'s)")
    shape.add_argument("--hosts", type=int, required=required, metavar="N", help="how many hosts")
    shape.add_argument("--link", metavar="RATE", help="each host's own link, e.g. 400Mbit or 1Gbit "
                                                      "(with --nodes, default: unshaped inside a node)")
    shape.add_argument("--nodes", type=int, metavar="M", help="two tiers: group the hosts into M nodes, "
                                                              "numbered node by node")
    shape.add_argument("--uplink", metavar="RATE", help="two tiers: each node's one link to the core switch")
    shape.add_argument("--slow", action="append", default=[], metavar="HOST:RATE",
                       help="this host's own link at RATE instead (repeat for several hosts)")
    shape.add_argument("--placement", metavar="N0,N1,...",
                       help="two tiers: the node of each host, e.g. 0,1,0,1 to alternate ranks between nodes")
    shape.add_argument("--cpus", type=float, metavar="CORES",
                       help="each host's share of this machine's cores (a cgroup quota), e.g. 0.25 for 8 hosts on 2 "
                            "cores: a host then computes as fast whether one or all of them run (default: all shared)")


def _cluster_from(args: argparse.Namespace) -> EmulatedCluster:
    """The lab the arguments describe (not up yet); ``ValueError`` names a bad argument."""
    slow = {}
    for item in args.slow:
        host, separator, rate = item.partition(":")
        if not separator or not host.strip().isdigit():
            raise ValueError(f"--slow takes HOST:RATE, e.g. --slow 2:100Mbit; got {item!r}")
        slow[int(host)] = rate
    placement = None
    if args.placement:
        try:
            placement = [int(node) for node in args.placement.split(",")]
        except ValueError:
            raise ValueError(f"--placement takes the node of each host, e.g. 0,1,0,1; got {args.placement!r}") from None
    return EmulatedCluster(hosts=args.hosts, link=args.link, nodes=args.nodes, uplink=args.uplink, slow=slow,
                           placement=placement, cpus=args.cpus)


def run_up(args: argparse.Namespace) -> int:
    try:
        lab = _cluster_from(args).up(keep=True)
    except (ValueError, LabError) as error:
        return fail("lab up", str(error))
    print(f"lab {lab.name} is up: {lab.spec.describe()}")
    for host in range(lab.hosts):
        print(f"  host {host}  {lab.address(host):<12} netns {lab.namespace(host):<10} node {lab.node_of_host(host)}")
    print("run on it:  ddp-ring-hooks lab run -- hostname -I\n"
          "            ddp-ring-hooks lab torchrun train_examples/ddp_ring.py\n"
          "remove it:  ddp-ring-hooks lab down")
    return 0


def run_down(args: argparse.Namespace) -> int:
    try:
        removed = remove_stale_labs() if args.stale else []
        if args.name or not args.stale:
            removed += remove_kept_labs(args.name)
    except LabError as error:
        return fail("lab down", str(error))
    print(f"removed {', '.join(removed)}" if removed else "no lab to remove")
    return 0


def run_status(args: argparse.Namespace) -> int:
    sys.stdout.write(status_report())
    return 0


def run_job(args: argparse.Namespace) -> int:
    what = f"lab {args.launcher}"
    if not args.command:
        return fail(what, "give the command to run, e.g. `ddp-ring-hooks lab run -- hostname -I`"
                          if args.launcher == "run" else "give the script, e.g. `ddp-ring-hooks lab torchrun train.py`")
    own = args.hosts is not None
    if not own and any((args.link, args.nodes, args.uplink, args.slow, args.placement, args.cpus)):
        return fail(what, "--link, --nodes, --uplink, --slow, --placement and --cpus shape a lab of its own: give --hosts too")
    if own and args.lab:
        return fail(what, "give either --lab NAME (a running lab) or --hosts (a lab of its own), not both")
    try:
        with contextlib.ExitStack() as stack:
            lab = stack.enter_context(_cluster_from(args)) if own else EmulatedCluster.attach(args.lab)
            start = lab.start if args.launcher == "run" else lab.start_torchrun
            results = start(args.command, echo=True).wait(timeout=args.timeout, check=False)
    except (ValueError, LabError) as error:  # HostUnreachable too: it names the hosts
        return fail(what, str(error))
    failed = [r for r in results if r.returncode != 0]
    if failed:
        print(f"ddp-ring-hooks {what}: host(s) {[r.host for r in failed]} failed (exit codes "
              f"{[r.returncode for r in failed]})", file=sys.stderr)
        return failed[0].returncode if failed[0].returncode > 0 else 1
    return 0
