"""A language model as a user trains it: distrain train --model gpt --dataset text."""

from __future__ import annotations

import json
import math

import pytest
import torch

from distrain.cli import main
from distrain.data import load_dataset
from distrain.models import build_model
from distrain.tasks import build_task
from distrain.train.metrics import read_metrics
from tests.reliability.common import run_cli


@pytest.mark.timeout(240)
def test_a_gpt_trains_on_the_local_text_corpus(tmp_path, capsys):
    run_dir = tmp_path / "lm"
    args = ["--model", "gpt", "--dataset", "text", "--workers", "2", "--context", "32", "--model-width", "32",
            "--model-depth", "1", "--batch-size", "8", "--epochs", "0.004", "--eval-every", "0.003", "--lr", "0.01",
            "--eval-samples", "40",
            "--optimizer", "adam", "--warmup-epochs", "0", "--run-dir", str(run_dir), "--no-progress"]
    result = run_cli(args, timeout=200, DISTRAIN_CACHE=str(tmp_path / "cache"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.orphans == []
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["task"] == "lm" and summary["final_test_accuracy"] is None
    assert summary["final_test_loss"] < math.log(256) - 1.0  # it learned the corpus's byte statistics
    evals = [m for m in read_metrics(run_dir) if "test_loss" in m]
    assert len(evals) == 2  # one during the run (on 40 validation windows), the final one (on all of them)
    final = evals[-1]
    assert final["test_bpb"] == pytest.approx(final["test_loss"] / math.log(2))
    assert "final test loss" in result.stdout
    # tokens per second: every worker's windows of 32 tokens, over the training time
    assert summary["tokens_per_s"] == pytest.approx(summary["samples_per_s"] * 32)
    assert f"tokens/s              {summary['tokens_per_s']:.0f}" in result.stdout
    assert final["tokens_per_s"] == pytest.approx(final["step"] * 2 * 8 * 32 / final["time"])
    config = json.loads((run_dir / "config.json").read_text())
    assert config["model"]["model"] == "gpt" and config["data"]["context"] == 32
    # the trained model is in the run directory and scores on the validation text what the summary says
    model = build_model("gpt", (32,), 256, width=32, depth=1, size="nano")
    model.load_state_dict(torch.load(run_dir / "model.pt", weights_only=True))
    assert config["model_parameters"] == sum(p.numel() for p in model.parameters())
    _, val = load_dataset("text", context=32, cache_dir=tmp_path / "cache")
    measured = build_task("lm").evaluate(model, val, torch.device("cpu"))
    assert measured["test_loss"] == pytest.approx(summary["final_test_loss"], rel=1e-5)  # --eval-samples: all at the end
    assert summary["final_val_bpb"] == pytest.approx(summary["final_val_loss"] / math.log(2))
    assert 2.0 < summary["bigram_val_bpb"] < 5.0 and "bigram model" in result.stdout
    # distrain sample continues a prompt with the trained model
    assert main(["sample", str(run_dir), "--prompt", "def ", "--tokens", "40", "--temperature", "0"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("def ") and len(printed.rstrip("\n")) > 4
