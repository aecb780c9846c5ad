"""Sharded parameter servers over real gloo processes."""

from __future__ import annotations

import pytest
import torch

from distrain.algorithms.parameter_server import shard_bounds
from distrain.launch import launch_local
from distrain.train.checkpoint import CheckpointStore
from tests.conftest import small_config
from tests.distributed.test_allreduce import reference_parameters


def final_models(run_dir, workers: int, servers: int, step: int) -> list[dict[str, torch.Tensor]]:
    return [CheckpointStore(run_dir, r, workers + servers).load(step)["model"] for r in range(workers)]


def test_shards_are_balanced_and_cover_everything():
    for numel, servers in [(10, 3), (7, 7), (1_000_003, 4)]:
        bounds = shard_bounds(numel, servers)
        sizes = [hi - lo for lo, hi in bounds]
        assert bounds[0][0] == 0 and bounds[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
        assert max(sizes) - min(sizes) <= 1


@pytest.mark.timeout(240)
@pytest.mark.parametrize("servers", [1, 2])
def test_sync_ps_equals_single_process_on_concatenated_batches(tmp_path, servers):
    cfg = small_config(str(tmp_path / "run"), algorithm="ps", servers=servers, workers=2)
    summary = launch_local(cfg)
    expected = reference_parameters(cfg, 2, summary["steps"])
    for rank, got in enumerate(final_models(tmp_path / "run", 2, servers, summary["steps"])):
        for name, tensor in expected.items():
            torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")
    assert len(summary["bytes_sent_per_server"]) == servers and min(summary["bytes_sent_per_server"]) > 0


@pytest.mark.timeout(240)
def test_async_ps_with_zero_staleness_equals_sync(tmp_path):
    settings = {"algorithm": "ps", "servers": 2, "workers": 3, "momentum": 0.0}
    sync = launch_local(small_config(str(tmp_path / "sync"), **settings))
    launch_local(small_config(str(tmp_path / "async"), ps_mode="async", max_staleness=0, **settings))
    steps = sync["steps"]
    want = final_models(tmp_path / "sync", 3, 2, steps)[0]
    for got in final_models(tmp_path / "async", 3, 2, steps):
        for name, tensor in want.items():
            torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
