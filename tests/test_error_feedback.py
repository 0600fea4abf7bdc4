"""Error feedback on real gloo ranks: what rounding to bf16 lost goes back in at the next step.

One launch runs the hook state's own path (``HookState.reduce_bucket``, what ``ring_hook``
calls) and a DDP model; the layout rebuild by parameter is checked without ranks.
"""

from __future__ import annotations

import io

import pytest
import torch

from ddp_ring_hooks.hooks.error_feedback import ErrorFeedback
from tests._dist import run_ranks
from tests.conftest import rank_input

NUMEL = 4099


def reduce(state, bucket: torch.Tensor) -> torch.Tensor:
    """One bucket through the hook state, as DDP hands it over (a single, last bucket)."""
    return state.reduce_bucket(bucket, is_last=True).wait()


def feedback_on_ranks(rank: int, world_size: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddp_ring_hooks
    from ddp_ring_hooks import HookState

    torch.set_num_threads(1)
    grads = [rank_input(r, NUMEL, torch.float32) for r in range(world_size)]
    exact = torch.stack([g.double() for g in grads]).mean(0)
    results = {}
    for algorithm in ("ring", "halving_doubling", "native"):
        # 1. The residual carries over a step: a zero bucket next brings back what the first lost.
        state = HookState(algorithm=algorithm, wire_dtype="bf16", error_feedback=True)
        first = reduce(state, grads[rank].clone())
        saved = io.BytesIO()
        torch.save(state.state_dict(), saved)
        second = reduce(state, torch.zeros(NUMEL))
        lost_first = float((first.double() - exact).abs().max())
        lost_both = float((first.double() + second.double() - exact).abs().max())
        # 2. ... and over state_dict(): a new state that loads it brings back the same.
        resumed = HookState(algorithm=algorithm, wire_dtype="bf16", error_feedback=True)
        saved.seek(0)
        resumed.load_state_dict(torch.load(saved, weights_only=True))
        again = reduce(resumed, torch.zeros(NUMEL))
        # 3. Over many steps of the same gradient the error does not build up with feedback.
        drift = {}
        for feedback in (False, True):
            steps = HookState(algorithm=algorithm, wire_dtype="bf16", error_feedback=feedback)
            total = torch.zeros(NUMEL, dtype=torch.float64)
            for _ in range(32):
                total += reduce(steps, grads[rank].clone()).double()
            drift[feedback] = float((total / 32 - exact).abs().mean())
        results[algorithm] = {
            "lost_first": lost_first, "lost_both": lost_both, "second_nonzero": bool(second.abs().max() > 0),
            "resumed_equal": again.equal(second), "drift": drift,
        }
    # 4. Gradient accumulation: DDP does not call the hook under no_sync; the residual waits.
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(64, 64))
    state = ddp_ring_hooks.register(model, wire_dtype="bf16", error_feedback=True)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(rank))

    def residuals() -> list[torch.Tensor]:
        return [kept.tensor.clone() for _, kept in sorted(state.plan.feedback._residuals.items())]

    model(x).square().sum().backward()
    after_sync = residuals()
    with model.no_sync():
        model(x).square().sum().backward()
    after_no_sync = residuals()
    model(x).square().sum().backward()
    results["accumulation"] = {
        "kept": len(after_sync) > 0 and all(a.equal(b) for a, b in zip(after_sync, after_no_sync, strict=True)),
        "iterations": state.iteration,
        "replaced": not all(a.equal(b) for a, b in zip(after_no_sync, residuals(), strict=True)),
        "grads_identical": [float(p.grad.abs().sum()) for p in model.parameters()],
    }
    state.close()
    return results


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(feedback_on_ranks, 3, timeout=240)


#: How much of the loss comes back. The schedules keep every rounding's loss; native (PyTorch's
#: compress hook) only its own cast's: gloo's bf16 additions round p - 1 more times, unseen.
RECOVERED = {"ring": 8, "halving_doubling": 8, "native": 1.2}
DRIFT = {"ring": 8, "halving_doubling": 8, "native": 2}


@pytest.mark.parametrize("algorithm", ["ring", "halving_doubling", "native"])
def test_the_residual_carries_over_a_step_and_over_state_dict(ranks, algorithm):
    found = ranks[0][algorithm]
    assert found["second_nonzero"], "a zero bucket came back zero: nothing was fed back"
    # what the second step brought back is what the first lost (bf16 rounds it again)
    assert found["lost_both"] < found["lost_first"] / RECOVERED[algorithm], found
    assert found["resumed_equal"], "a state restored from state_dict() fed back something else"


@pytest.mark.parametrize("algorithm", ["ring", "halving_doubling", "native"])
def test_the_rounding_error_does_not_build_up_over_steps(ranks, algorithm):
    drift = ranks[0][algorithm]["drift"]
    assert drift[True] < drift[False] / DRIFT[algorithm], drift


def test_under_no_sync_the_residual_waits_for_the_next_synced_step(ranks):
    for found in ranks:
        accumulation = found["accumulation"]
        assert accumulation["kept"] and accumulation["replaced"] and accumulation["iterations"] == 2
    assert len({tuple(found["accumulation"]["grads_identical"]) for found in ranks}) == 1


@pytest.mark.fast
def test_a_rebuilt_layout_takes_each_parameters_residual_with_it():
    """DDP's rebuild after the first step: bucket 0 holds the same parameters in another order,
    bucket 1 one that was in bucket 0; each parameter's residual goes with it."""
    a, b, c = (torch.nn.Parameter(torch.zeros(n)) for n in (3, 2, 4))
    feedback = ErrorFeedback()
    first = feedback.prepare(0, torch.empty(5), lambda: [a, b], is_last=False)
    first.copy_(torch.tensor([1.0, 2.0, 3.0, 10.0, 20.0]))  # a's residual, then b's
    other = feedback.prepare(1, torch.empty(4), lambda: [c], is_last=True)
    other.copy_(torch.tensor([7.0, 8.0, 9.0, 6.0]))
    assert feedback.nbytes == 9 * 4
    # rebuilt: bucket 0 = [b, c], bucket 1 = [a]
    rebuilt0 = feedback.prepare(0, torch.empty(6), lambda: [b, c], is_last=False)
    rebuilt1 = feedback.prepare(1, torch.empty(3), lambda: [a], is_last=True)
    assert rebuilt0.tolist() == [10.0, 20.0, 7.0, 8.0, 9.0, 6.0]
    assert rebuilt1.tolist() == [1.0, 2.0, 3.0]
    assert feedback.nbytes == 9 * 4  # the first layout's residuals are gone
    assert "residuals of 2 buckets" in feedback.summary_line()
    # the same layout again: the same residual, untouched
    assert feedback.prepare(0, torch.empty(6), lambda: [b, c], is_last=False) is rebuilt0


@pytest.mark.fast
def test_restored_residuals_wait_for_their_bucket_and_unmatched_ones_are_named():
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    saving = ErrorFeedback()
    saving.prepare(0, torch.empty(5), lambda: [a, b], is_last=True).copy_(torch.arange(5.0))
    saved = saving.state_dict()
    resumed = ErrorFeedback()
    resumed.load_state_dict(saved)
    # the resumed run's first iteration: DDP's provisional bucket, another layout
    assert resumed.prepare(0, torch.empty(5), lambda: [b, a], is_last=True).tolist() == [0.0] * 5
    # rebuilt: the saved layout, the saved residual added in
    assert resumed.prepare(0, torch.empty(5), lambda: [a, b], is_last=True).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    stranded = ErrorFeedback()
    stranded.load_state_dict(saved)
    with pytest.warns(UserWarning, match="1 residual.*match none of this run's buckets"):
        for _ in range(2):
            stranded.prepare(0, torch.empty(7), lambda: [torch.nn.Parameter(torch.zeros(7))], is_last=True)
