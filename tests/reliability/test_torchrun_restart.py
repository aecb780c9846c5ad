"""torchrun --max-restarts with periodic checkpoints: a worker killed at step 50 is restarted with
the others, they resume from the checkpoint of step 40, and end with the parameters of a run that
was never interrupted (same seed)."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest
import torch

from distrain.launch.common import free_port
from distrain.runtime.checkpoint import CheckpointStore
from tests.reliability.common import QUICK, cli_env, kill_tagged, tagged

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
