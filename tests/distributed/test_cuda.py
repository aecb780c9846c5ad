"""distrain on a GPU (skipped without one): the user's loop through wrap() on CUDA tensors equals
one process on the concatenated batches, with workers sharing a GPU over gloo; NCCL takes one GPU
per process and more processes than GPUs are refused before any starts."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from tests.reliability.common import QUICK, cli_env, run_launch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SCRIPT = Path(__file__).with_name("cuda_script.py")


def launch(workers: int, algorithm: str, settings: dict, servers: int = 0) -> tuple[subprocess.CompletedProcess, dict]:
    """Run cuda_script.py as ``workers`` processes; its output and each rank's difference from one process."""
    done = run_launch(["--workers", str(workers), *(("--servers", str(servers)) if servers else ()), "--timeout", "60",
                       str(SCRIPT), algorithm, json.dumps(settings)], timeout=180)
    found = re.findall(rf"rank (\d+) of {workers}: cuda difference (\S+)", done.stdout + done.stderr)
    return done, {int(rank): float(diff) for rank, diff in found}


SHARED = {"allreduce": {}, "allreduce-fp16": {"compress": "fp16"},
          "diloco": {"sync_every": 1, "outer_optimizer": "sgd", "outer_lr": 1.0, "outer_momentum": 0.0}, "ps": {}}


@pytest.mark.parametrize("name", list(SHARED))
def test_workers_sharing_a_gpu_over_gloo_equal_one_process(name: str):
    algorithm = name.split("-")[0]
    done, diffs = launch(2, algorithm, {"backend": "gloo", **SHARED[name]}, servers=1 if algorithm == "ps" else 0)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(diffs) == [0, 1]
    bound = 2e-5 if name.endswith("fp16") else 1e-6  # fp16: the gradients are rounded on the wire
    assert max(diffs.values()) <= bound, diffs


def test_nccl_takes_a_gpu_per_process_and_more_processes_are_refused_before_any_starts(tmp_path: Path):
    gpus = torch.cuda.device_count()
    done, diffs = launch(gpus, "allreduce", {})
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(diffs) == list(range(gpus)) and max(diffs.values()) <= 1e-6, diffs
    refusal = (f"--backend: nccl needs a GPU for each process: {gpus + 1} processes on this machine, {gpus} GPU(s); "
               "use --backend gloo")
    done, _ = launch(gpus + 1, "allreduce", {})
    assert done.returncode != 0 and refusal in done.stderr
    train = subprocess.run([sys.executable, "-m", "distrain", "train", *QUICK, "--device", "cuda", "--workers",
                            str(gpus + 1), "--run-dir", str(tmp_path / "run")], env=cli_env(uuid.uuid4().hex),
                           capture_output=True, text=True, timeout=120)
    assert train.returncode == 2 and f"distrain: {refusal}" in train.stderr
    assert not (tmp_path / "run").exists()
