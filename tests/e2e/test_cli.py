"""The command line as a user types it: real processes, real exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

TIMEOUT = 240


def distrain(*args: str, cwd=None, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "distrain", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env={**os.environ, "PYTHONUNBUFFERED": "1"})


QUICK = ["--dataset", "synthetic", "--num-samples", "1200", "--model", "mlp", "--model-width", "32",
         "--epochs", "1", "--batch-size", "16", "--no-progress"]


@pytest.mark.timeout(TIMEOUT + 10)
def test_train_two_workers_writes_run_directory(tmp_path):
    run = tmp_path / "run"
    out = distrain("train", "--workers", "2", "--run-dir", str(run), *QUICK)
    assert out.returncode == 0, out.stderr
    assert "final test accuracy" in out.stdout and str(run) in out.stdout
    summary = json.loads((run / "summary.json").read_text())
    config = json.loads((run / "config.json").read_text())
    assert summary["workers"] == 2 and summary["algorithm"] == "allreduce"
    # The reported accuracy is the final model's: rebuild it from rank 0's last checkpoint and
    # evaluate it on the same held-out split here.
    import torch

    from distrain.data import load_dataset
    from distrain.models import build_model
    from distrain.runtime.checkpoint import load_checkpoint
    from distrain.tasks import Classification

    _, test_set = load_dataset("synthetic", num_samples=1200, seed=0)
    model = build_model("mlp", test_set.input_shape, test_set.num_classes, width=32)
    state = load_checkpoint(run / "checkpoints" / f"step-{summary['steps']:08d}" / "rank-0000.pt")
    model.load_state_dict(state["model"])
    measured = Classification().evaluate(model, test_set, torch.device("cpu"))
    accuracy, loss = measured["test_accuracy"], measured["test_loss"]
    assert summary["final_test_accuracy"] == pytest.approx(accuracy, abs=1e-9)
    assert summary["final_test_loss"] == pytest.approx(loss, rel=1e-5)
    assert accuracy > 0.5  # ten classes: a model that learned nothing scores about 0.1
    assert len(summary["bytes_sent_per_worker"]) == 2 and min(summary["bytes_sent_per_worker"]) > 0
    assert sum(s["size"] for s in config["shards"]) == 960 and len(config["shards"]) == 2
    for rank in range(2):
        lines = (run / "metrics" / f"rank{rank}.jsonl").read_text().splitlines()
        assert len(lines) == summary["steps"]
        last = json.loads(lines[-1])
        assert last["bytes_sent"] == summary["bytes_sent_per_worker"][rank]
    assert (run / "checkpoints" / f"step-{summary['steps']:08d}" / "rank-0001.pt").exists()


@pytest.mark.timeout(TIMEOUT + 10)
def test_torchrun_two_processes(tmp_path):
    run = tmp_path / "tr"
    from distrain.launch.common import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "distrain", "train", "--run-dir", str(run), *QUICK]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["workers"] == 2
    assert (run / "metrics" / "rank1.jsonl").exists()


@pytest.mark.parametrize("args,flag", [
    (["--lr", "-1"], "--lr"),
    (["--lr", "nan"], "--lr"),
    (["--lr", "abc"], "--lr"),
    (["--epochs", "0"], "--epochs"),
    (["--batch-size", "0"], "--batch-size"),
    (["--workers", "0"], "--workers"),
    (["--algorithm", "nope"], "--algorithm"),
    (["--model", "nope"], "--model"),
    (["--dataset", "nope"], "--dataset"),
    (["--dataset", "npz"], "--data-path"),
    (["--optimizer", "sgdx"], "--optimizer"),
    (["--partition", "weird"], "--partition"),
    (["--device", "cuda"], "--device"),
    (["--batch-size", "100000"], "--batch-size"),
])
def test_bad_values_exit_2_with_one_line_naming_the_flag(tmp_path, capsys, args, flag):
    """In this process (the checks run before any worker starts); the test below types one."""
    from distrain.cli import main

    if args == ["--device", "cuda"]:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    try:
        code = main(["train", "--run-dir", str(tmp_path / "r"), *QUICK, *args])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, lines)
    assert flag in lines[0]
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("args,flag", [(["--lr", "abc"], "--lr"), (["--batch-size", "100000"], "--batch-size")])
def test_a_bad_value_typed_exits_2_with_one_line(tmp_path, args, flag):
    """As a user types it: an argparse error and one found once the data is loaded."""
    out = distrain("train", "--run-dir", str(tmp_path / "r"), *QUICK, *args, timeout=120)
    assert out.returncode == 2, (out.returncode, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0], out.stderr


def test_help_documents_every_flag():
    from distrain.config import flag, leaf_fields

    out = distrain("train", "--help", timeout=60)
    assert out.returncode == 0
    for _, field, _ in leaf_fields():
        assert flag(field.name) in out.stdout, field.name
