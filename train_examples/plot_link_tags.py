"""Draw a run's per-link TensorBoard scalars (``comm/links/*``) as one picture (for docs/links.md).

    python train_examples/plot_link_tags.py runs/links --output docs/links_training.png

Reads the event files the hook wrote with ``spread_every=N, links=True`` and draws, against the
optimizer step, the charts ``tensorboard --logdir`` shows for those tags, with their names as
titles: the slowest link's and the median link's bandwidth, the slowest link's two ends, and the
rank whose network the rule names slow (-1: none).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from plot_tensorboard_run import read_scalars

CHARTS = (
    ("comm/links/slowest_MBps", "comm/links/median_MBps"),
    ("comm/links/slowest_src", "comm/links/slowest_dst"),
    ("comm/links/slow_nic_rank",),
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="the log_dir of a run with links=True")
    parser.add_argument("--output", type=Path, default=Path("links_training.png"), help="image to write")
    args = parser.parse_args(argv)
    scalars = read_scalars(args.run_dir, tags=[tag for chart in CHARTS for tag in chart])
    if not scalars:
        parser.error(f"no comm/links/* scalars in {args.run_dir}; pass the log_dir of a run with spread_every=N, links=True")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(CHARTS), figsize=(4.4 * len(CHARTS), 3.4))
    for axis, tags in zip(axes, CHARTS):
        for tag in tags:
            points = scalars.get(tag, [])
            axis.plot([s for s, _ in points], [v for _, v in points], marker=".", label=tag.rsplit("/", 1)[1])
        axis.set_title(" / ".join(tag.rsplit("/", 1)[1] for tag in tags), fontsize="medium", loc="left")
        axis.set_xlabel("optimizer step")
        axis.grid(alpha=0.3)
        if len(tags) > 1:
            axis.legend(fontsize="small")
    axes[0].set_ylabel("MB/s")
    axes[0].set_ylim(bottom=0)
    for axis in axes[1:]:
        axis.set_ylabel("rank")
        axis.set_ylim(-1.5, max(3.5, axis.get_ylim()[1]))
    figure.suptitle(f"{args.run_dir}: comm/links/*", fontsize="medium", x=0.01, ha="left")
    figure.tight_layout()
    figure.savefig(args.output, dpi=110)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
