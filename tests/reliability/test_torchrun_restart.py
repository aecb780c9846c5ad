"""torchrun --max-restarts with periodic checkpoints: a worker killed at step 50 is restarted with
the others, they resume from the checkpoint of step 40, and end with the parameters of a run that
was never interrupted (same seed)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid

import pytest
import torch

from distrain.launch.common import free_port
from distrain.runtime.checkpoint import CheckpointStore
from tests.reliability.common import QUICK, cli_env, kill_tagged, tagged, wait_for

pytestmark = pytest.mark.timeout(400)


def torchrun(run_dir, **env: str) -> tuple[subprocess.CompletedProcess, list[int]]:  # noqa: ANN001
    tag = uuid.uuid4().hex
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--monitor-interval", "0.5",
           "-m", "distrain", "train", *QUICK, "--epochs", "2", "--checkpoint-every", "20", "--resume", "auto",
           "--timeout", "60", "--run-dir", str(run_dir)]  # a restart on a loaded machine takes a while
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=360, env=cli_env(tag, **env))
        return out, tagged(tag)
    finally:
        kill_tagged(tag)


@pytest.mark.slow  # `make test-all`; resuming bit for bit is in CI through distrain train (test_resume.py)
def test_killed_worker_restarts_and_resumes_from_the_last_checkpoint(tmp_path):
    broken, orphans = torchrun(tmp_path / "broken", DISTRAIN_INJECT_KILL="1:50")
    assert broken.returncode == 0, broken.stderr[-3000:]
    assert orphans == []
    summary = json.loads((tmp_path / "broken" / "summary.json").read_text())
    assert summary["resumed_from_step"] == 40
    total = summary["steps"]
    assert total > 60

    whole, _ = torchrun(tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert json.loads((tmp_path / "whole" / "summary.json").read_text())["resumed_from_step"] is None
    for rank in range(2):
        want = CheckpointStore(tmp_path / "whole", rank, 2).load(total)
        got = CheckpointStore(tmp_path / "broken", rank, 2).load(total)
        for name, tensor in want["model"].items():
            torch.testing.assert_close(got["model"][name], tensor, rtol=0, atol=0, msg=name)


def _agent(run_dir, endpoint: str, run_id: str, nproc: int, host: bool, tag: str, log,  # noqa: ANN001
           algorithm: tuple[str, ...] = ()) -> subprocess.Popen:
    """One node of an elastic torchrun job (--nnodes 1:2) in its own session (``host``: it holds
    the rendezvous store). A dead node is seen within 2 s (keep-alives every second); a round
    completes when both nodes joined, or 5 s after the first. Each round's rank 0 worker hosts the
    workers' store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE: torch 2.13's shared agent store never
    tells a node that joins a later round where it is)."""
    conf = f"join_timeout=120,last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=2,is_host={int(host)}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", str(nproc),
           "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
           "--rdzv-conf", conf, "--monitor-interval", "0.5", "-m", "distrain", "train", *QUICK, "--epochs", "4",
           "--latency", "5ms", "--checkpoint-every", "20", "--resume", "auto", "--timeout", "60",
           "--run-dir", str(run_dir), *algorithm]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=cli_env(tag, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"))


@pytest.mark.slow  # two torchrun agents, a node lost, a new rendezvous: about a minute
@pytest.mark.parametrize("algorithm", [(), ("--algorithm", "diloco", "--sync-every", "10")],
                         ids=["allreduce", "diloco"])
def test_an_elastic_job_that_loses_a_node_resumes_with_the_workers_left(tmp_path, algorithm):
    """torchrun --nnodes 1:2: node A (2 workers) and node B (1 worker) train together; once a
    checkpoint set of the 3 is complete, node B is killed outright (its agent's process group;
    its worker dies with its agent). A's agent restarts its workers alone with WORLD_SIZE 2, they
    resume from the 3 workers' checkpoint and train to the end of the 3 workers' plan: summary.json
    records the change, both end with the same parameters, nothing is left running. DiLoCo
    (H 10, a set every 20 steps: each at a round's end) the same."""
    run_dir = tmp_path / "run"
    port, run_id = free_port(), uuid.uuid4().hex
    endpoint = f"127.0.0.1:{port}"
    tags = [uuid.uuid4().hex, uuid.uuid4().hex]
    logs = [tmp_path / "node-a.log", tmp_path / "node-b.log"]
    try:
        with open(logs[0], "w") as log:
            a = _agent(run_dir, endpoint, run_id, 2, True, tags[0], log, algorithm)
        with open(logs[1], "w") as log:
            b = _agent(run_dir, endpoint, run_id, 1, False, tags[1], log, algorithm)
        store = CheckpointStore(run_dir, 0, 3)
        wait_for(lambda: store.latest_complete() is not None or a.poll() is not None or b.poll() is not None, 240,
                 "a complete checkpoint set of the 3 workers")
        assert a.poll() is None and b.poll() is None, "the run ended before node B could be lost"
        os.killpg(b.pid, signal.SIGKILL)
        b.wait(timeout=30)
        a.wait(timeout=300)
        err = logs[0].read_text()
        assert a.returncode == 0, err[-3000:]
        orphans = tagged(tags[0]) + tagged(tags[1])
    finally:
        for tag in tags:
            kill_tagged(tag)
    assert orphans == []
    summary = json.loads((run_dir / "summary.json").read_text())
    # (on a loaded machine node A may train alone for a moment before B joins: 2 workers, then 3)
    assert [c["event"] for c in summary["membership"]] in (["resized"], ["resized", "resized"])
    change = summary["membership"][-1]
    assert change["workers_before"] == 3 and change["members"] == [0, 1]
    assert change["left"] == [2] and change["joined"] == []
    resumed = summary["resumed_from_step"]
    assert change["resized_at_step"] == resumed and resumed % 20 == 0 and resumed > 0
    assert summary["workers"] == 2 and summary["workers_at_end"] == 2 and summary["global_batch"] == 32
    total = summary["steps"]
    assert total == 4 * 40 > resumed  # the 3 workers' plan: 1920 samples / 48 a step, 4 epochs
    assert summary["steps_per_worker"] == [total, total]
    models = [CheckpointStore(run_dir, r, 2).load(total)["model"] for r in range(2)]
    for name, tensor in models[0].items():
        torch.testing.assert_close(models[1][name], tensor, rtol=0, atol=0, msg=name)
    assert "was written by 3 workers; 2 go on from it" in err
