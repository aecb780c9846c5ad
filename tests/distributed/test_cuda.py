"""distrain on a GPU (skipped without one): the user's loop through wrap() on CUDA tensors equals
one process on the concatenated batches, with workers sharing a GPU over gloo; every other
algorithm and pseudo-gradient compressor gives on the GPU what it gives on the CPU (or, where
timing decides what is exchanged, trains); a worker lost on the GPU joins Prague again with a
live worker's state, and stops a synchronous run with one line; NCCL takes one GPU per process and more processes than GPUs are refused before any
starts."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from distrain.data import load_dataset
from distrain.models import build_model
from distrain.tasks import build_task
from tests.distributed import test_elastic
from tests.reliability.common import QUICK, cli_env, run_cli, run_launch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SCRIPT = Path(__file__).with_name("cuda_script.py")
REPORT = r"rank (\d+) of {}: (\w+) difference (\S+) loss (\S+) -> (\S+)"


def launch(workers: int, algorithm: str, settings: dict, servers: int = 0, device: str = "cuda",
           out: Path | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    """Run cuda_script.py as ``workers`` processes on ``device``: its output and, per rank, the
    device its model ended on, its difference from one process, and its loss before and after."""
    done = run_launch(["--workers", str(workers), *(("--servers", str(servers)) if servers else ()), "--timeout", "60",
                       str(SCRIPT), algorithm, json.dumps(settings), device, *((str(out),) if out else ())], timeout=180)
    found = re.findall(REPORT.format(workers), done.stdout + done.stderr)
    return done, {int(rank): {"device": dev, "difference": float(diff), "before": float(before), "after": float(after)}
                  for rank, dev, diff, before, after in found}


SHARED = {"allreduce": {}, "allreduce-fp16": {"compress": "fp16"},
          "diloco": {"sync_every": 1, "outer_optimizer": "sgd", "outer_lr": 1.0, "outer_momentum": 0.0}, "ps": {}}


@pytest.mark.parametrize("name", list(SHARED))
def test_workers_sharing_a_gpu_over_gloo_equal_one_process(name: str):
    algorithm = name.split("-")[0]
    done, diffs = launch(2, algorithm, {"backend": "gloo", **SHARED[name]}, servers=1 if algorithm == "ps" else 0)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(diffs) == [0, 1] and {d["device"] for d in diffs.values()} == {"cuda"}
    bound = 2e-5 if name.endswith("fp16") else 1e-6  # fp16: the gradients are rounded on the wire
    assert max(d["difference"] for d in diffs.values()) <= bound, diffs


#: Deterministic algorithms and compressors whose result is not one process's: the GPU run must
#: give what the CPU run gives (the same script, the model and data on the CPU).
SAME_AS_CPU = {
    "dpsgd": {}, "d2": {},
    "allreduce-group_topk": {"compress": "group_topk:0.1:group=32"},
    "allreduce-int8": {"compress": "int8"},
    "ps-group_topk": {"compress": "group_topk:0.1:group=32"},
    "diloco-nesterov": {"sync_every": 2, "steps": 6},
    "diloco-streaming-int4": {"sync_every": 4, "fragments": 2, "overlap_steps": 1, "compress": "int4", "steps": 10},
    "diloco-sparseloco": {"sync_every": 2, "compress": "sparseloco:0.05", "steps": 6},
}


@pytest.mark.parametrize("name", list(SAME_AS_CPU))
def test_the_gpu_gives_what_the_cpu_gives(name: str, tmp_path: Path):
    algorithm, settings = name.split("-")[0], {"backend": "gloo", **SAME_AS_CPU[name]}
    servers = 1 if algorithm == "ps" else 0
    models = {}
    for device in ("cpu", "cuda"):
        (tmp_path / device).mkdir()
        done, runs = launch(2, algorithm, settings, servers=servers, device=device, out=tmp_path / device)
        assert done.returncode == 0, done.stderr[-3000:]
        assert sorted(runs) == [0, 1] and {d["device"] for d in runs.values()} == {device}
        models[device] = [torch.load(tmp_path / device / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    for on_cpu, on_gpu in zip(models["cpu"], models["cuda"], strict=True):
        for a, b in zip(on_cpu, on_gpu, strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    start = [p.detach() for p in torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(),
                                                     torch.nn.Linear(64, 3)).parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(models["cuda"][0], start, strict=True))  # it trained


#: Asynchronous algorithms and the adaptive ratio, whose exchanges depend on timing: on the GPU
#: every worker ends with a model on the GPU that fits the rows better than the model it began with.
TIMED = {"adpsgd": (2, {}), "prague": (4, {"group_size": 2}), "ps-async": (2, {"ps_mode": "async", "max_staleness": 2}),
         "allreduce-adaptive": (2, {"compress": "adaptive:base=0.1:min=0.01:max=0.5"})}


@pytest.mark.parametrize("name", list(TIMED))
def test_timed_algorithms_train_on_the_gpu(name: str):
    algorithm, (workers, settings) = name.split("-")[0], TIMED[name]
    done, runs = launch(workers, algorithm, {"backend": "gloo", "steps": 20, **settings},
                        servers=1 if algorithm == "ps" else 0)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(runs) == list(range(workers)) and {d["device"] for d in runs.values()} == {"cuda"}
    for rank, run in runs.items():
        assert run["after"] < 0.9 * run["before"], (rank, run)


def test_a_worker_lost_on_the_gpu_rejoins_prague_with_a_live_workers_state(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch):
    """Prague (the asynchronous algorithms go on without a lost worker on the GPU too): worker 0
    killed (SIGKILL), started again and joining with a member's model; test_elastic's assertions,
    with the model on the GPU."""
    monkeypatch.setenv("ELASTIC_DEVICE", "cuda")  # elastic_script.py puts its model on the GPU (gloo)
    test_elastic.test_a_restarted_worker_0_joins_prague_again(tmp_path)


@pytest.mark.parametrize("settings", [{}, test_elastic.DILOCO], ids=["allreduce", "diloco"])
def test_a_worker_lost_on_the_gpu_stops_a_synchronous_run_with_one_line(tmp_path: Path, settings: dict,
                                                                      monkeypatch: pytest.MonkeyPatch):
    """The synchronous algorithms' survivors go on on the CPU only: on the GPU the launcher stops
    the run and names the lost worker, whatever it printed before (a warning is not the cause)."""
    monkeypatch.setenv("ELASTIC_DEVICE", "cuda")
    done = test_elastic.launch(tmp_path, 1, 3, "start", settings=settings)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == "distrain: rank 1 failed: killed by SIGKILL"
    assert not list(tmp_path.glob("worker*.pt"))


def test_nccl_takes_a_gpu_per_process_and_more_processes_are_refused_before_any_starts(tmp_path: Path):
    gpus = torch.cuda.device_count()
    done, diffs = launch(gpus, "allreduce", {})
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(diffs) == list(range(gpus)) and max(d["difference"] for d in diffs.values()) <= 1e-6, diffs
    refusal = (f"--backend: nccl needs a GPU for each process: {gpus + 1} processes on this machine, {gpus} GPU(s); "
               "use --backend gloo")
    done, _ = launch(gpus + 1, "allreduce", {})
    assert done.returncode != 0 and refusal in done.stderr
    train = subprocess.run([sys.executable, "-m", "distrain", "train", *QUICK, "--device", "cuda", "--workers",
                            str(gpus + 1), "--run-dir", str(tmp_path / "run")], env=cli_env(uuid.uuid4().hex),
                           capture_output=True, text=True, timeout=120)
    assert train.returncode == 2 and f"distrain: {refusal}" in train.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(300)
def test_distrain_train_streams_int8_diloco_for_a_language_model_on_the_gpu(tmp_path: Path):
    """distrain train as a user runs it on a GPU: a GPT on the local text corpus, 2 workers sharing
    the GPU over gloo, streaming DiLoCo with int8 pseudo-gradients; the model it saves scores on
    the CPU what the GPU's evaluation reported."""
    run_dir, cache = tmp_path / "lm", tmp_path / "cache"
    args = ["--model", "gpt", "--dataset", "text", "--device", "cuda", "--backend", "gloo", "--workers", "2",
            "--algorithm", "diloco", "--sync-every", "4", "--fragments", "2", "--compress", "int8",
            "--context", "32", "--model-width", "32", "--model-depth", "1", "--batch-size", "8", "--epochs", "0.004",
            "--lr", "0.01", "--optimizer", "adam", "--warmup-epochs", "0", "--run-dir", str(run_dir), "--no-progress"]
    result = run_cli(args, timeout=240, DISTRAIN_CACHE=str(cache))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.orphans == []
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_test_loss"] < math.log(256) - 1.0  # it learned the corpus's byte statistics
    model = build_model("gpt", (32,), 256, width=32, depth=1, size="nano")
    model.load_state_dict(torch.load(run_dir / "model.pt", weights_only=True, map_location="cpu"))
    _, val = load_dataset("text", context=32, cache_dir=cache)
    measured = build_task("lm").evaluate(model, val, torch.device("cpu"))
    assert measured["test_loss"] == pytest.approx(summary["final_test_loss"], rel=1e-4)
