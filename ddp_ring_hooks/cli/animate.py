"""``ddp-ring-hooks animate``: draw an algorithm (or a recorded run) as a GIF, HTML or MP4.

    ddp-ring-hooks animate --algorithm ring --world-size 4 --output ring.gif
    ddp-ring-hooks animate --algorithm tree --world-size 7 --output tree.html
    ddp-ring-hooks animate --trace trace.rank*.json --output my_run.gif

One frame per step plus a first and a last frame. With ``--trace``, the schedule is rebuilt
from the point-to-point operations each rank recorded (``runtime.recording.TraceRecorder``),
so the animation shows what really ran. Needs matplotlib and pillow (``pip install
ddp_ring_hooks[viz]``); ``.mp4`` also needs ffmpeg.
"""

from __future__ import annotations

import argparse

from ..viz import format_ring_order, simulate
from ..viz.animate import SUFFIXES, render_animation
from ..viz.layout import choose_layout
from . import fail
from .explain import add_schedule_arguments, schedule_from_args


def add_parser(subparsers) -> None:
    """Add the ``animate`` subcommand."""
    parser = subparsers.add_parser(
        "animate",
        help="animate an all-reduce algorithm or a recorded run to .gif/.html/.mp4",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_schedule_arguments(parser)
    parser.add_argument(
        "--trace", nargs="+", default=None, metavar="FILE",
        help="render recorded runs instead of --algorithm: the trace file(s) of every rank",
    )
    parser.add_argument(
        "--run", type=int, default=0, metavar="I", help="with --trace: which recorded all-reduce to draw (default: 0)"
    )
    parser.add_argument(
        "--output", "-o", required=True, metavar="FILE", help=f"file to write; its suffix picks the format ({', '.join(SUFFIXES)})"
    )
    parser.add_argument("--fps", type=float, default=1.0, help="frames per second (default: 1)")
    parser.add_argument("--dpi", type=int, default=80, help="resolution; the figure is 8 x 8 inches (default: 80)")
    parser.add_argument("--no-progress", action="store_true", help="do not show a progress bar")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Write the animation; exit code 2 on bad arguments or an unreadable trace."""
    subtitle = ""
    try:
        if args.trace:
            from ..runtime.recording import load_recordings, schedule_from_recordings

            recordings = load_recordings(args.trace)
            schedule = schedule_from_recordings(recordings, run=args.run)
            subtitle = f"replay of a recorded run ({len(recordings)} ranks, all-reduce #{args.run})"
        else:
            schedule = schedule_from_args(args)
            subtitle = format_ring_order(schedule)
    except ValueError as error:
        return fail("animate", str(error))
    try:
        written = render_animation(
            simulate(schedule), choose_layout(schedule), args.output,
            fps=args.fps, dpi=args.dpi, subtitle=subtitle, progress=not args.no_progress,
        )
    except ImportError as error:
        return fail("animate", f"{error}; animations need matplotlib and pillow: pip install 'ddp_ring_hooks[viz]'")
    except (ValueError, RuntimeError) as error:  # bad --output, --fps or --dpi; no ffmpeg
        return fail("animate", str(error))
    print(f"wrote {written} ({len(schedule.steps) + 2} frames)")
    return 0
