"""Bad configuration and ranks that disagree fail at once with a message that says what to do.

All cases run on the same two gloo ranks (one spawn): each is tried, and its outcome (error
type, message, seconds to fail) is returned to the tests below, one test per case. A case
that must not break the group (every rank raises the same error at the same point) is
followed by a working reduction on the same group.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests._dist import run_ranks


def _outcome(action) -> dict:
    start = time.monotonic()
    try:
        value = action()
    except Exception as error:  # noqa: BLE001 - the error is what we record
        return {"error": type(error).__name__, "message": str(error), "seconds": time.monotonic() - start}
    return {"error": None, "value": value, "seconds": time.monotonic() - start}


def _ddp(module=None, **kwargs):
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    return DistributedDataParallel(module or torch.nn.Linear(4, 4), **kwargs)


def _backward(model, inputs) -> None:
    model(inputs).sum().backward()


def _try_bad_inputs(rank: int, world_size: int) -> dict[str, dict]:
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers backend "fake"

    import ddp_ring_hooks
    import ddp_ring_hooks.hooks.state as state_module
    from ddp_ring_hooks import HookState, register, ring_hook
    from ddp_ring_hooks.runtime import ExecutionObserver

    outcomes: dict[str, dict] = {}
    model = _ddp()  # built outside the timed actions: only registration is timed
    outcomes["unknown algorithm"] = _outcome(lambda: register(model, algorithm="rign"))
    outcomes["unknown option"] = _outcome(lambda: register(model, algorithm="ring", chunk_count=4))
    outcomes["hierarchical local_size not dividing"] = _outcome(
        lambda: register(model, algorithm="hierarchical", local_size=3)
    )
    outcomes["bad check_layout_steps"] = _outcome(lambda: HookState(check_layout_steps=-1))
    outcomes["bad concurrent_buckets"] = _outcome(lambda: HookState(concurrent_buckets=0))
    outcomes["integer bucket"] = _outcome(
        lambda: HookState().reduce_bucket(torch.ones(4, dtype=torch.int64), is_last=True).wait()
    )
    # sparse buckets are reduced (tests/test_sparse.py); a mode that does not exist is refused
    outcomes["bad sparse mode"] = _outcome(lambda: HookState(sparse="densify"))

    only_rank_0 = dist.new_group([0])  # every rank must call new_group
    outcomes["rank outside the group"] = _outcome(lambda: register(model, process_group=only_rank_0) and "ok")
    fake = dist.new_group([0, 1], backend="fake")
    model = _ddp()
    outcomes["unsupported backend"] = _outcome(lambda: register(model, process_group=fake))

    register(model)
    outcomes["registered twice"] = _outcome(lambda: register(model))

    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    model = _ddp()
    model.register_comm_hook(None, allreduce_hook)
    outcomes["registered over another hook"] = _outcome(lambda: register(model))

    # What register() is given instead of one DDP model, and the DDP modes it refuses.
    outcomes["not a module"] = _outcome(lambda: register("model"))
    outcomes["module without DDP"] = _outcome(lambda: register(torch.nn.Sequential(torch.nn.Linear(4, 4))))
    outcomes["two DDP models"] = _outcome(lambda: register(torch.nn.ModuleDict({"encoder": _ddp(), "decoder": _ddp()})))
    outcomes["parameters outside the DDP"] = _outcome(lambda: register(torch.nn.Sequential(_ddp(), torch.nn.Linear(4, 4))))
    outcomes["DataParallel"] = _outcome(lambda: register(torch.nn.DataParallel(torch.nn.Linear(4, 4))))
    from torch.distributed.fsdp import fully_shard

    outcomes["FSDP"] = _outcome(lambda: register(fully_shard(torch.nn.Sequential(torch.nn.Linear(4, 4)))))
    compiled = torch.compile(_ddp())  # compiles nothing until called: only the wrapper is looked into
    outcomes["compiled DDP"] = _outcome(
        lambda: register(compiled) and compiled._orig_mod._get_ddp_logging_data()["comm_hook"]
    )
    from torch._dynamo import config as dynamo_config

    with dynamo_config.patch(optimize_ddp="python_reducer"):
        python_reducer = _ddp()
    outcomes["python_reducer"] = _outcome(lambda: register(python_reducer))
    with dynamo_config.patch(compiled_autograd=True):
        outcomes["compiled autograd"] = _outcome(lambda: register(_ddp()))

    # Ranks that disagree. (Different parameter shapes are DDP's to catch, at construction: it
    # raises on the ranks that differ from rank 0, while rank 0 waits in its broadcast.)
    # Different bucket caps pass DDP; with find_unused_parameters, step 1's buckets differ.
    net = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    model = _ddp(net, bucket_cap_mb=0.001 if rank == 0 else 25, find_unused_parameters=True)

    def different_bucket_caps():
        register(model)
        _backward(model, torch.randn(2, 16))

    outcomes["different bucket layouts (bucket_cap_mb)"] = _outcome(different_bucket_caps)

    def disagree_then_recover(state, numel=10):
        try:
            state.reduce_bucket(torch.ones(numel), is_last=True).wait()
        except RuntimeError as error:
            # Every rank raised at the same point, so the group still works.
            recovered = HookState().reduce_bucket(torch.full((10,), float(rank)), is_last=True).wait()
            raise RuntimeError(f"{error}\n[recovered: {recovered.tolist()}]") from error

    outcomes["different bucket sizes at the hook"] = _outcome(lambda: disagree_then_recover(HookState(), 10 + rank))
    # Same buckets, reduced differently: the peers would wait for messages never sent.
    outcomes["different hierarchical local_size"] = _outcome(
        lambda: disagree_then_recover(HookState(algorithm="hierarchical", local_size=1 + rank))
    )
    outcomes["observers on rank 0 only"] = _outcome(
        lambda: disagree_then_recover(HookState(observers=(ExecutionObserver(),) if rank == 0 else ()))
    )
    outcomes["different concurrent_buckets"] = _outcome(
        lambda: disagree_then_recover(HookState(concurrent_buckets=1 + rank))
    )

    # The layout check runs for the first `check_layout_steps` iterations only.
    real_check = state_module.check_bucket_layout
    checks_run: dict[int, int] = {}
    for steps in (0, 2):
        calls = []
        state_module.check_bucket_layout = lambda *a, **k: calls.append(1) or real_check(*a, **k)
        state = HookState(check_layout_steps=steps)
        for _ in range(4):  # iterations of two buckets
            state.reduce_bucket(torch.ones(5), is_last=False).wait()
            state.reduce_bucket(torch.ones(3), is_last=True).wait()
        state_module.check_bucket_layout = real_check
        checks_run[steps] = len(calls)
    outcomes["layout checks per setting"] = {"error": None, "value": checks_run}
    outcomes["all_reduce of integers still sums"] = _outcome(
        lambda: ddp_ring_hooks.all_reduce(torch.full((5,), rank + 1, dtype=torch.int64)).tolist()
    )
    return outcomes


@pytest.fixture(scope="module")
def outcomes() -> list[dict[str, dict]]:
    return run_ranks(_try_bad_inputs, 2, timeout=120)


def _error(outcomes, case: str, rank: int = 0) -> str:
    outcome = outcomes[rank][case]
    assert outcome["error"] is not None, f"{case}: no error on rank {rank}: {outcome}"
    assert outcome["seconds"] < 10, f"{case}: took {outcome['seconds']:.1f}s to fail"
    return outcome["message"]


def test_unknown_algorithm_names_the_choices(outcomes):
    message = _error(outcomes, "unknown algorithm")
    assert "unknown algorithm 'rign'" in message and "ring" in message


def test_unknown_option_names_what_the_algorithm_accepts(outcomes):
    message = _error(outcomes, "unknown option")
    assert "unknown option 'chunk_count'" in message and "the ring algorithm takes ring_order, node_of" in message


def test_hierarchical_node_size_must_divide_world_size(outcomes):
    message = _error(outcomes, "hierarchical local_size not dividing")
    assert "hierarchical" in message and "2 ranks" in message and "local_size=3" in message


def test_layout_check_steps_must_be_a_count(outcomes):
    assert "check_layout_steps must be an integer >= 0" in _error(outcomes, "bad check_layout_steps")
    assert "concurrent_buckets must be an integer >= 1" in _error(outcomes, "bad concurrent_buckets")


def test_integer_bucket_is_refused_but_all_reduce_sums_integers(outcomes):
    message = _error(outcomes, "integer bucket")
    assert "torch.int64 bucket" in message and "ddp_ring_hooks.all_reduce" in message
    for rank_outcomes in outcomes:
        assert rank_outcomes["all_reduce of integers still sums"]["value"] == [3] * 5


def test_an_unknown_sparse_mode_is_refused_naming_both(outcomes):
    message = _error(outcomes, "bad sparse mode")
    assert "sparse='densify'" in message and "sparse='gather'" in message and "sparse='dense'" in message


def test_rank_outside_the_group_is_refused(outcomes):
    assert outcomes[0]["rank outside the group"]["error"] is None  # rank 0 is a member
    message = _error(outcomes, "rank outside the group", rank=1)
    assert "global rank 1) is not a member of the hook's process group" in message


def test_backend_without_point_to_point_is_refused(outcomes):
    message = _error(outcomes, "unsupported backend")
    assert "'fake' backend" in message and "backend='gloo'" in message


def test_registering_twice_is_refused(outcomes):
    assert "already has the communication hook 'ring_hook'" in _error(outcomes, "registered twice")
    assert "allreduce_hook" in _error(outcomes, "registered over another hook")


def test_register_finds_the_ddp_model_inside_a_wrapper(outcomes):
    for rank_outcomes in outcomes:  # registered on the DDP inside torch.compile's wrapper, as DDP reports
        assert (rank_outcomes["compiled DDP"]["error"], rank_outcomes["compiled DDP"]["value"]) == (None, "ring_hook")


@pytest.mark.parametrize(
    "case, says",
    [
        ("not a module", ["got str, which is not a torch.nn.Module", "a module that wraps one"]),
        ("module without DDP", ["found no DistributedDataParallel in Sequential(Linear)", "DistributedDataParallel(model)"]),
        ("two DDP models", ["ModuleDict holds 2 DistributedDataParallel models ('decoder', 'encoder')",
                            "register(model.get_submodule('decoder'))"]),
        ("parameters outside the DDP", ["Sequential has trainable parameters outside the DistributedDataParallel at '0'",
                                        "(1.weight, 1.bias)", "never be averaged", "wrap the whole model"]),
        ("DataParallel", ["in DataParallel(Linear)", "nn.DataParallel runs one process"]),
        ("FSDP", ["in FSDPSequential(Linear)", "sharded by FSDP"]),
        ("python_reducer", ['optimize_ddp = "python_reducer"', "(grad, param) tuple", 'optimize_ddp = "ddp_optimizer"']),
        ("compiled autograd", ["compiled autograd is on", "torch._dynamo.config.compiled_autograd = False"]),
    ],
)
def test_register_says_what_it_found_instead_of_one_ddp_model(outcomes, case, says):
    message = _error(outcomes, case)
    assert all(part in message for part in says), message


def test_different_bucket_layouts_fail_on_every_rank_in_the_first_step(outcomes):
    for rank in range(2):
        message = _error(outcomes, "different bucket layouts (bucket_cap_mb)", rank=rank)
        assert "the ranks disagree on the gradient bucket" in message, message
        assert "number of elements differs: rank 0:" in message and "bucket_cap_mb" in message


def test_different_bucket_sizes_fail_on_every_rank_and_leave_the_group_usable(outcomes):
    for rank in range(2):
        message = _error(outcomes, "different bucket sizes at the hook", rank=rank)
        assert "number of elements differs: rank 0: 10, rank 1: 11" in message, message
        assert "[recovered: " + str([0.5] * 10) + "]" in message


@pytest.mark.parametrize(
    "case, differs, advice",
    [
        ("different hierarchical local_size", "schedule differs: rank 0: 0x", "local_size (default: LOCAL_WORLD_SIZE"),
        ("observers on rank 0 only", "worker lanes differs: rank 0: 1, rank 1: 2", "give every rank observers or none"),
        ("different concurrent_buckets", "worker lanes differs: rank 0: 1, rank 1: 2", "the same concurrent_buckets"),
    ],
)
def test_ranks_that_would_reduce_differently_fail_on_every_rank_and_leave_the_group_usable(outcomes, case, differs, advice):
    for rank in range(2):
        message = _error(outcomes, case, rank=rank)
        assert differs in message and advice in message, message
        assert "number of elements differs" not in message and "bucket_cap_mb" not in message, message
        assert "[recovered: " + str([0.5] * 10) + "]" in message


def test_layout_check_runs_for_the_first_steps_only(outcomes):
    for rank_outcomes in outcomes:
        assert rank_outcomes["layout checks per setting"]["value"] == {0: 0, 2: 4}


@pytest.mark.fast
def test_hook_without_process_group_says_to_initialize():
    if dist.is_initialized():
        pytest.skip("this process already has a default process group")
    from ddp_ring_hooks import HookState

    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        HookState().reduce_bucket(torch.ones(3), is_last=True)
