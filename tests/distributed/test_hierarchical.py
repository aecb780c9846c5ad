"""Hierarchical all-reduce (reduce in each node, all-reduce among leaders, broadcast) equals the flat one."""

from __future__ import annotations

import pytest
import torch

from distrain.launch import launch_local
from distrain.runtime.checkpoint import CheckpointStore
from tests.conftest import small_config
from tests.distributed.test_allreduce import reference_parameters

WORLD = 4


@pytest.mark.timeout(240)
@pytest.mark.parametrize("per_node,sent_units,received_units", [
    (2, [2, 1, 2, 1], [2, 1, 2, 1]),
    pytest.param(3, [2, 2, 1, 1], [2, 1, 2, 1], marks=pytest.mark.slow),  # uneven nodes: `make test-all`
])
def test_hierarchical_allreduce_equals_flat_allreduce(tmp_path, per_node, sent_units, received_units):
    """Every worker ends with the parameters of one process stepped on the 4 workers' concatenated
    batches (what the flat all-reduce gives, see test_allreduce.py), and the bytes follow the nodes."""
    cfg = small_config(str(tmp_path / "run"), workers=WORLD, bucket_mb=0.001, workers_per_node=per_node)
    summary = launch_local(cfg)
    steps = summary["steps"]
    assert steps >= 10
    expected = reference_parameters(cfg, WORLD, steps)
    for rank in range(WORLD):
        got = CheckpointStore(tmp_path / "run", rank, WORLD).load(steps)["model"]
        for name, tensor in expected.items():
            torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")

    # Bytes, in units of one gradient per step. Nodes of 2: a member sends its gradient to its
    # leader; a leader sends one gradient to the other leader (all-reduce of 2) and one to its
    # member (broadcast). Nodes {0,1,2},{3}: reduce 1->2->0, broadcast 0->1->2, leaders 0<->3.
    grad_bytes = 4 * sum(t.numel() for t in expected.values())
    unit = grad_bytes * steps
    assert summary["bytes_sent_per_worker"] == [u * unit for u in sent_units]
    assert summary["bytes_received_per_worker"] == [u * unit for u in received_units]
    inter_node = [[0] * WORLD for _ in range(WORLD)]  # who sent how much to whom across nodes
    for src, row in enumerate(summary["bytes_sent_per_peer"]):
        for dst, n in enumerate(row):
            if src // per_node != dst // per_node:
                inter_node[src][dst] = n
    leaders = list(range(0, WORLD, per_node))
    assert inter_node[0][leaders[1]] == unit and inter_node[leaders[1]][0] == unit
    assert sum(map(sum, inter_node)) == 2 * unit  # only the two leaders cross, one gradient each
