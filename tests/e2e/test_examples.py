"""The examples a user copies from: they run as the README says, and the DDP script and its
distrain version differ in at most 10 lines of code."""

from __future__ import annotations

import difflib
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.reliability.common import ROOT, cli_env, kill_tagged, tagged

EXAMPLES = ROOT / "examples"


def code_lines(path: Path) -> list[str]:
    """The file's lines without its docstring, comments and blank lines."""
    text = re.sub(r'^""".*?"""\n', "", path.read_text(), count=1, flags=re.S)
    return [line.split("  #")[0].rstrip() for line in text.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def test_ddp_and_distrain_versions_differ_in_at_most_10_lines():
    plain, ours = code_lines(EXAMPLES / "ddp_plain.py"), code_lines(EXAMPLES / "ddp_to_distrain.py")
    diff = [line for line in difflib.ndiff(plain, ours) if line[:2] in ("- ", "+ ")]
    removed = [line for line in diff if line.startswith("- ")]
    added = [line for line in diff if line.startswith("+ ")]
    assert 0 < len(removed) <= 10 and 0 < len(added) <= 10, diff


def launch(args: list[str], timeout: float = 240) -> str:
    tag = uuid.uuid4().hex
    try:
        done = subprocess.run([sys.executable, "-m", "distrain", "launch", *args], env=cli_env(tag), cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout)
        assert tagged(tag) == []
    finally:
        kill_tagged(tag)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def accuracy_of(stdout: str) -> float:
    return float(re.search(r"\[rank 0\] training accuracy ([0-9.]+)", stdout).group(1))


@pytest.mark.slow  # `make test-all`
def test_ddp_script_and_its_distrain_version_train_alike():
    plain = accuracy_of(launch(["--workers", "2", "examples/ddp_plain.py"]))
    ours = accuracy_of(launch(["--workers", "2", "examples/ddp_to_distrain.py"]))
    assert plain > 0.8  # a task the model learns
    assert ours >= plain - 0.03, (ours, plain)


@pytest.mark.slow  # CI: the edge test above runs the same script on an emulated network
def test_custom_loop_on_an_emulated_network_reports_its_traffic():
    out = launch(["--workers", "2", "--network", "lan", "examples/custom_loop.py", "--epochs", "0.5"])
    lines = re.findall(r"worker (\d): (\d+) steps, .* sent ([0-9.]+) kB/step, test accuracy ([0-9.]+)", out)
    assert sorted(int(w) for w, *_ in lines) == [0, 1], out
    # all-reduce of the model's gradients each step: 2 (n - 1) / n of the float32 parameters
    sys.path.insert(0, str(EXAMPLES))
    try:
        from custom_loop import ResidualMLP
    finally:
        sys.path.pop(0)
    params = sum(p.numel() for p in ResidualMLP(64, 256, 10).parameters())
    for _, steps, sent, accuracy in lines:
        assert int(steps) == round(0.5 * (16384 * 7 // 8) // (2 * 64))  # half an epoch of the shard
        assert abs(float(sent) * 1e3 - params * 4) / (params * 4) < 0.05, (sent, params)
        assert float(accuracy) > 0.5


@pytest.mark.slow  # `make test-all`: the first example test runs the custom loop, test_link_model.py the delays
def test_custom_loop_on_edge_waits_what_the_link_model_predicts_for_its_bytes():
    # edge: 20 Mbit/s, 10 ms. An all-reduce of n workers sends 2 (n - 1) / n of the gradients in
    # 2 (n - 1) messages: the wait per step is the bytes sent at the link's rate plus 2 (n - 1)
    # latencies (this model computes in a few ms against ~0.4 s on the wire: nothing hides it).
    out = launch(["--workers", "4", "--network", "edge", "examples/custom_loop.py", "--epochs", "0.25"])
    lines = re.findall(r"worker (\d): (\d+) steps, ([0-9.]+) ms/step \(compute ([0-9.]+), network wait ([0-9.]+)\), "
                       r"sent ([0-9.]+) kB/step", out)
    assert sorted(int(w) for w, *_ in lines) == [0, 1, 2, 3], out
    for _, _, step_ms, _, wait_ms, sent_kb in lines:
        predicted = float(sent_kb) * 1e3 / (20e6 / 8) + 2 * 3 * 0.010
        assert abs(float(wait_ms) / 1e3 - predicted) / predicted < 0.20, (wait_ms, predicted)
        assert float(step_ms) >= float(wait_ms)
