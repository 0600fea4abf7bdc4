"""Print the reliability table of docs/reliability.md: each fault and bad input, what the user sees, time to fail.

Runs the same cases as ``tests/test_bad_input.py`` and ``tests/test_faults.py`` (their rank
functions, on real gloo ranks) plus one case that belongs to DDP itself (different parameter
shapes), and prints a markdown table::

    python tests/scripts/fault_table.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, when not installed

import torch  # noqa: E402

from tests._dist import run_ranks  # noqa: E402
from tests.test_bad_input import _try_bad_inputs  # noqa: E402
from tests.test_faults import PG_TIMEOUT, VICTIM, WORLD_SIZE, _run_with_a_victim  # noqa: E402

PARAMETER_SHAPES_TIMEOUT = 10.0


def _different_parameter_shapes(rank: int, world_size: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    start = time.monotonic()
    try:
        DistributedDataParallel(torch.nn.Linear(4, 4 + rank))
    except RuntimeError as error:
        return {"error": type(error).__name__, "message": str(error), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def _first_line(message: str, width: int = 150) -> str:
    line = message.strip().splitlines()[0].replace("|", "\\|")
    return line if len(line) <= width else line[: width - 1] + "…"


def main() -> None:
    rows = []
    for case, per_rank in _by_case(run_ranks(_try_bad_inputs, 2, timeout=120)).items():
        failed = [o for o in per_rank if o.get("error")]
        if not failed or case.startswith("all_reduce"):
            continue
        seconds = max(o["seconds"] for o in failed)
        where = "every rank" if len(failed) == len(per_rank) else f"{len(failed)} of {len(per_rank)} ranks"
        rows.append((case, f"`{failed[0]['error']}` on {where}: {_first_line(failed[0]['message'])}", seconds))

    survivors, _ = _run_with_a_victim(WORLD_SIZE, VICTIM, timeout=90)
    for rank, outcome in sorted(survivors.items()):
        message = outcome["message"].removeprefix("Got the following error when running the callback: ")
        rows.append((f"rank {VICTIM} of {WORLD_SIZE} SIGKILLed mid-training (seen by rank {rank})",
                     f"`RuntimeError` from `backward()`: {_first_line(message, 260)}", outcome["seconds"]))

    shapes = run_ranks(_different_parameter_shapes, 2, timeout=60, pg_timeout=PARAMETER_SHAPES_TIMEOUT)
    for rank, outcome in enumerate(shapes):
        rows.append((f"different parameter shapes (DDP constructor, rank {rank})",
                     f"`{outcome['error']}`: {_first_line(outcome.get('message', 'no error'))}", outcome["seconds"]))

    print("| fault or bad input | what the user sees | time to fail |\n|---|---|---|")
    for case, seen, seconds in rows:
        print(f"| {case} | {seen} | {seconds:.2f} s |")
    print(f"\n(process-group timeout {PG_TIMEOUT:.0f} s for the kill, {PARAMETER_SHAPES_TIMEOUT:.0f} s for the shapes)")


def _by_case(outcomes: list[dict]) -> dict[str, list[dict]]:
    return {case: [rank_outcomes[case] for rank_outcomes in outcomes] for case in outcomes[0]}


if __name__ == "__main__":
    main()
