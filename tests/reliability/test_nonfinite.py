"""A NaN in a worker's loss is caught before anything is sent: the run stops naming the worker
and step, or (--on-nonfinite skip) drops that worker's gradient and finishes with finite models."""

from __future__ import annotations

import json

import pytest
import torch

from distrain.runtime.checkpoint import load_checkpoint
from tests.reliability.common import QUICK, run_cli

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("algorithm", ["allreduce", "adpsgd"])
def test_nan_at_step_30_on_rank_1_stops_naming_both(tmp_path, algorithm):
    run = run_cli([*QUICK, "--workers", "2", "--epochs", "3", "--algorithm", algorithm, "--run-dir", str(tmp_path)],
                  DISTRAIN_INJECT_NAN="1:30")
    assert run.returncode == 1, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert "worker 1" in last and "non-finite loss at step 30" in last, run.stderr
    assert "Traceback" not in run.stderr
    assert run.orphans == []
    assert not (tmp_path / "summary.json").exists()


# (CI: allreduce; adpsgd's non-finite step is in CI through test_nan_at_step_30_on_rank_1_stops_naming_both)
@pytest.mark.parametrize("algorithm", ["allreduce", pytest.param("ps", marks=pytest.mark.slow),
                                       pytest.param("adpsgd", marks=pytest.mark.slow)])
def test_skip_drops_the_step_and_every_worker_ends_finite(tmp_path, algorithm):
    run = run_cli([*QUICK, "--workers", "2", "--epochs", "3", "--algorithm", algorithm, "--on-nonfinite", "skip",
                   "--run-dir", str(tmp_path)], DISTRAIN_INJECT_NAN="1:30")
    assert run.returncode == 0, run.stderr
    assert run.orphans == []
    summary = json.loads((tmp_path / "summary.json").read_text())
    records = [json.loads(line) for line in (tmp_path / "metrics" / "rank1.jsonl").read_text().splitlines()]
    skipped = [r["step"] for r in records if r.get("skipped")]
    assert skipped == [31]  # the 0-based step 30 is the 31st record
    for rank in range(2):  # each worker's final model (asynchronous workers end at different steps)
        final = max(tmp_path.glob(f"checkpoints/step-*/rank-{rank:04d}.pt"))
        state = load_checkpoint(final)
        assert state["step"] == summary["steps_per_worker"][rank] or algorithm == "adpsgd"
        for name, tensor in state["model"].items():
            assert torch.isfinite(tensor).all(), f"rank {rank} {name} not finite"
