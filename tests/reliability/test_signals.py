"""SIGTERM to the launcher, or Ctrl-C (SIGINT to the whole process group): every worker stops
within 10 s at a step they agree on, leaves a valid checkpoint, and no process is left behind."""

from __future__ import annotations

import json
import signal
import time
import uuid

import pytest

from distrain.train.checkpoint import CheckpointStore
from tests.reliability.common import QUICK, kill_tagged, start_cli, tagged, wait_for

pytestmark = pytest.mark.timeout(240)

STOP_WITHIN_S = 10.0


def _started(run_dir):  # noqa: ANN001, ANN202
    return lambda: any((run_dir / "checkpoints").glob("step-*"))


@pytest.mark.parametrize("algorithm,workers,sig,group", [
    ("allreduce", 3, signal.SIGTERM, False),
    ("allreduce", 2, signal.SIGINT, True),  # Ctrl-C in a terminal reaches every process of the group
    ("ps", 2, signal.SIGTERM, False),
    ("adpsgd", 2, signal.SIGTERM, False),
])
def test_stop_request_ends_every_worker_with_a_checkpoint(tmp_path, algorithm, workers, sig, group):
    import os

    tag = uuid.uuid4().hex
    run_dir = tmp_path / "run"
    proc = start_cli([*QUICK, "--workers", str(workers), "--epochs", "200", "--algorithm", algorithm,
                      "--checkpoint-every", "5", "--run-dir", str(run_dir)], tag)
    try:
        wait_for(_started(run_dir), 120, "the first checkpoint")
        sent_at = time.monotonic()
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent_at
        orphans = tagged(tag)
    finally:
        proc.kill()
        kill_tagged(tag)
    assert proc.returncode == 130, err
    assert took <= STOP_WITHIN_S, f"took {took:.1f} s to stop"
    assert orphans == []
    assert "Traceback" not in err
    assert "--resume auto" in err.strip().splitlines()[-1], err
    nprocs = workers + (1 if algorithm == "ps" else 0)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] is True
    if algorithm == "adpsgd":  # asynchronous: each worker stops at its own step
        for rank in range(nprocs):
            assert list(run_dir.glob(f"checkpoints/step-*/rank-{rank:04d}.pt"))
        return
    store = CheckpointStore(run_dir, 0, nprocs)
    last = store.latest_complete()
    assert last is not None and last == max(store.steps())  # the stop step's set is complete
    assert all(steps == last for steps in summary["steps_per_worker"])  # every worker stopped there
    for rank in range(nprocs):
        assert CheckpointStore(run_dir, rank, nprocs).load(last)["step"] == last
