"""Helpers for fault tests: run the CLI as a user does, inject faults, look for orphans."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: A quick job: synthetic data, a small MLP, short timeouts (steps per epoch: 1200 / (4 * 16) ~ 18).
QUICK = ["--dataset", "synthetic", "--num-samples", "2400", "--model", "mlp", "--model-width", "32",
         "--model-depth", "2", "--batch-size", "16", "--lr", "0.05", "--warmup-epochs", "0", "--lr-decay", "none",
         "--no-progress", "--timeout", "20", "--peer-timeout", "5"]


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    wall: float
    orphans: list[int]  # processes of the run still alive once the launcher exited


def cli_env(tag: str, **extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "DISTRAIN_TEST_TAG": tag, **extra}
    return env


def start_cli(args: list[str], tag: str, **extra_env: str) -> subprocess.Popen:
    """``python -m distrain train ARGS`` in its own session (so a signal can reach its group)."""
    return subprocess.Popen([sys.executable, "-m", "distrain", "train", *args], env=cli_env(tag, **extra_env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def run_cli(args: list[str], timeout: float = 180, **extra_env: str) -> Result:
    tag = uuid.uuid4().hex
    t0 = time.monotonic()
    proc = start_cli(args, tag, **extra_env)
    try:
        out, err = proc.communicate(timeout=timeout)
        wall = time.monotonic() - t0
        orphans = tagged(tag)
    finally:
        proc.kill()
        kill_tagged(tag)
    return Result(proc.returncode, out, err, wall, orphans)


def run_launch(args: list[str], timeout: float = 120, **extra_env: str) -> subprocess.CompletedProcess:
    """``python -m distrain launch ARGS`` as a user runs it; its output, once it has left nothing
    running (whatever it left is reaped either way)."""
    tag = uuid.uuid4().hex
    try:
        done = subprocess.run([sys.executable, "-m", "distrain", "launch", *args], env=cli_env(tag, **extra_env),
                              capture_output=True, text=True, timeout=timeout)
        assert tagged(tag) == []
    finally:
        kill_tagged(tag)
    return done


def tagged(tag: str) -> list[int]:
    """Processes still alive whose environment carries ``tag`` (orphans of a test run)."""
    pids = []
    needle = f"DISTRAIN_TEST_TAG={tag}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def kill_tagged(tag: str) -> None:
    """Reap whatever a failed test left behind (never needed when the code under test is right)."""
    import signal

    for pid in tagged(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def injected_at(mark: Path) -> float:
    """When an injected fault happened (Unix time), from its DISTRAIN_INJECT_MARK file."""
    return float(mark.read_text().split()[0])


def injected_pid(mark: Path) -> int:
    """The process an injected fault hit, from its DISTRAIN_INJECT_MARK file."""
    return int(mark.read_text().split()[1])


def wait_for(condition, timeout: float, what: str, interval: float = 0.05) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def run_losing_worker(run_dir: Path, args: list[str], rank: int, step: int = 30) -> tuple[Result, dict]:
    """Run ``distrain train args`` with worker ``rank`` SIGKILLed at ``step``; check what every
    such run must show (success, no orphans, that rank alone lost, found within 15 s, no steps of
    its own counted) and return the run and its summary."""
    import json

    mark = run_dir.parent / f"{run_dir.name}-killed-at"
    run = run_cli([*args, "--run-dir", str(run_dir)], DISTRAIN_INJECT_KILL=f"{rank}:{step}", DISTRAIN_INJECT_MARK=str(mark))
    assert run.returncode == 0, run.stderr
    assert run.orphans == []
    summary = json.loads((run_dir / "summary.json").read_text())
    assert list(summary["lost_workers"]) == [str(rank)]
    detection = summary["lost_workers"][str(rank)] - injected_at(mark)
    assert detection <= 15, detection
    assert summary["steps_per_worker"][rank] == 0
    return run, summary
