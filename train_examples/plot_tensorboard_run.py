"""Draw the scalars TensorBoard shows for a sweep run, as one picture (for the README).

    python train_examples/plot_tensorboard_run.py runs/accumulation_sweep/version_0 --output docs/tensorboard_scalars.png

Reads the event files the main job wrote (``accumulate_<k>/round_<r>/``) and draws, per k,
the charts ``tensorboard --logdir`` shows for them, with their tag names as titles: the loss,
the communication per optimizer step and the throughput, against the optimizer step.
"""

from __future__ import annotations

import argparse
from pathlib import Path

TAGS = ("train/loss", "comm/step/total_ms", "comm/step/exposed_ms", "throughput/samples_per_s")


def read_scalars(run: Path, tags=TAGS) -> dict[str, list[tuple[int, float]]]:
    """``tag -> [(step, value), ...]`` of one TensorBoard run directory, for those of ``tags`` it has."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run), size_guidance={"scalars": 0})  # every step, not a sample
    events.Reload()
    available = set(events.Tags()["scalars"])
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in tags if tag in available}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="a sweep's version_N directory")
    parser.add_argument("--round", type=int, default=0, help="which round to draw (default: %(default)s)")
    parser.add_argument("--output", type=Path, default=Path("tensorboard_scalars.png"), help="image to write")
    args = parser.parse_args(argv)
    runs = sorted(args.run_dir.glob("accumulate_*"), key=lambda p: int(p.name.split("_")[1]))
    if not runs:
        parser.error(f"no accumulate_<k> runs in {args.run_dir}; pass a sweep's version_N directory")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(TAGS), figsize=(4 * len(TAGS), 3.4))
    for run in runs:
        directory = run / f"round_{args.round}" if (run / f"round_{args.round}").is_dir() else run
        scalars = read_scalars(directory)
        for axis, tag in zip(axes, TAGS):
            points = scalars.get(tag, [])
            axis.plot([s for s, _ in points], [v for _, v in points], marker=".", label=f"k={run.name.split('_')[1]}")
    for axis, tag in zip(axes, TAGS):
        axis.set_title(tag, fontsize="medium", loc="left")
        axis.set_xlabel("optimizer step")
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(args.output, dpi=110)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
