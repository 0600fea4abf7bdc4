"""Two torchrun agents on one machine act as two nodes of two ranks each (c10d rendezvous on
127.0.0.1) and train with the ``hierarchical`` hook, whose node size comes from torchrun's
``LOCAL_WORLD_SIZE``::

    agent --node-rank=0:  global ranks 0, 1   (node 0)
    agent --node-rank=1:  global ranks 2, 3   (node 1)

Every step, each rank checks the hook's gradients against ``dist.all_reduce``; at the end the
parameters must be equal on all four ranks.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.scripts.train_with_hook import free_port, loopback_environment, torchrun_command

NODES, RANKS_PER_NODE, STEPS = 2, 2, 3


@pytest.mark.timeout(180)
def test_two_agents_run_the_hierarchical_hook_across_two_nodes(tmp_path):
    port = free_port()
    agents = [
        subprocess.Popen(
            torchrun_command(
                out=tmp_path, port=port, nnodes=NODES, node_rank=node, nproc=RANKS_PER_NODE,
                extra=("--algorithm=hierarchical", f"--steps={STEPS}"),
            ),
            env=loopback_environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for node in range(NODES)
    ]
    try:
        logs = [agent.communicate(timeout=160)[0] for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    for node, (agent, log) in enumerate(zip(agents, logs)):
        assert agent.returncode == 0, f"agent of node {node} failed:\n{log[-4000:]}"

    results = [json.loads((tmp_path / f"result_rank{r}.json").read_text()) for r in range(NODES * RANKS_PER_NODE)]
    for rank, result in enumerate(results):
        assert result["world_size"] == NODES * RANKS_PER_NODE
        assert result["node"] == rank // RANKS_PER_NODE and result["local_rank"] == rank % RANKS_PER_NODE
        assert result["algorithm"] == "hierarchical" and result["hook"] == "ring_hook"
        assert result["iteration"] == STEPS
        assert result["worst_grad_error"] < 1e-6
        assert result["params"] == results[0]["params"]
