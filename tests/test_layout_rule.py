"""The bucket-layout check's rule, without ranks: what each rank's row holds, and what the error says.

On real ranks (``tests/test_ring_order.py``, ``tests/test_bad_input.py``) the rows are
all-gathered and every rank raises the same error; here the rows are built the way each rank
builds its own (``BucketLayout.as_row``) and handed to ``describe_mismatch`` directly: which
field differs, each rank's value, and the advice that fits that field and no other.
"""

from __future__ import annotations

import pytest
import torch

from ddp_ring_hooks.hooks.layout_check import BucketLayout, describe_mismatch
from ddp_ring_hooks.schedules import checked_schedule

pytestmark = pytest.mark.fast  # no test here starts a process

SAME_MODEL = "Every rank must build the same model"
SAME_ALGORITHM = "Every rank must run the same algorithm"
SAME_LANES = "Every rank must spread buckets over the same number of worker lanes"


def row(*, numel: int = 50_410, dtype=torch.float32, is_last: bool = False, algorithm: str = "ring",
        lanes: int = 2, world_size: int = 4, **options) -> list[int]:
    """One rank's row for bucket 0, as that rank builds it."""
    schedule = None if algorithm == "native" else checked_schedule(algorithm, world_size, **options)
    return BucketLayout(index=0, numel=numel, dtype=dtype, is_last=is_last, schedule=schedule, lanes=lanes).as_row()


def test_ranks_that_build_the_same_bucket_the_same_way_have_equal_rows():
    assert row() == row()
    assert row(algorithm="hierarchical", local_size=2) == row(algorithm="hierarchical", local_size=2)
    assert row(algorithm="native", lanes=1)[4:] == row(algorithm="native", lanes=1)[4:]


def test_a_different_bucket_size_names_each_ranks_count_and_the_same_model_rule():
    message = describe_mismatch([row(), row(numel=50_610)], iteration=0)
    assert "  - number of elements differs: rank 0: 50,410, rank 1: 50,610" in message
    assert SAME_MODEL in message and SAME_ALGORITHM not in message and SAME_LANES not in message
    assert "different numbers of buckets" not in message
    assert message.endswith("HookState(check_layout_steps=0) turns this check off.")


def test_a_last_bucket_on_one_rank_only_means_different_numbers_of_buckets():
    message = describe_mismatch([row(is_last=True), row(), row()], iteration=3)
    assert "(bucket 0 on rank 0, iteration 3)" in message
    assert "  - last bucket differs: rank 0: yes, rank 1: no, rank 2: no" in message
    assert "(so the ranks have different numbers of buckets)" in message


def test_a_different_dtype_is_named_by_its_torch_name():
    message = describe_mismatch([row(), row(dtype=torch.bfloat16)], iteration=1)
    assert "  - dtype differs: rank 0: float32, rank 1: bfloat16" in message


@pytest.mark.parametrize("first, second, named", [
    ({"algorithm": "hierarchical", "local_size": 2}, {"algorithm": "hierarchical", "local_size": 4},
     "hierarchical's options: local_size (default: LOCAL_WORLD_SIZE, which differs when nodes run different"),
    ({"ring_order": (0, 1, 2, 3)}, {"ring_order": (0, 2, 1, 3)}, "ring's options: ring_order, node_of"),
])
def test_the_same_algorithm_with_other_options_is_a_different_schedule_and_names_its_options(first, second, named):
    one, other = row(**first), row(**second)
    assert one[4] == other[4] and one[5] != other[5]  # same algorithm code, another schedule digest
    message = describe_mismatch([one, other], iteration=0)
    assert "  - schedule differs: " in message and "algorithm differs" not in message
    assert SAME_ALGORITHM in message and named in message and SAME_MODEL not in message


def test_a_different_algorithm_names_both():
    message = describe_mismatch([row(), row(algorithm="tree")], iteration=0)
    assert "  - algorithm differs: rank 0: ring, rank 1: tree" in message
    assert SAME_ALGORITHM in message


def test_different_worker_lanes_name_concurrent_buckets_and_observers():
    message = describe_mismatch([row(lanes=2), row(lanes=1)], iteration=0)
    assert "  - worker lanes differs: rank 0: 2, rank 1: 1" in message
    assert SAME_LANES in message and "concurrent_buckets" in message and "observers=" in message
    assert SAME_MODEL not in message and SAME_ALGORITHM not in message
