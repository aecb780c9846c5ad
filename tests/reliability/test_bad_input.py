"""Every bad input of the reliability issue: exit status 2 and one line naming the setting and
what is allowed, before any worker starts where the input can be checked that early.

Most cases run ``distrain.cli.main`` in this process (validation happens before any worker is
spawned); the ones only a worker can see run the command line as a user does. Cases covered by
tests/e2e/test_cli.py and tests/unit/test_config.py (lr, epochs, batch size, workers <= 0, unknown
algorithm / model / dataset / optimizer, --device cuda without CUDA, a shard smaller than one
batch) are not repeated here.
"""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest

from distrain.cli import main
from tests.reliability.common import QUICK, run_cli

pytestmark = pytest.mark.timeout(120)


def bad(capsys, *args: str) -> str:  # noqa: ANN001
    """Run ``distrain train ARGS``; assert exit 2 and one line on stderr; return that line."""
    try:
        code = main(["train", *QUICK, *args])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("args,setting,allowed", [
    (["--compress", "zip"], "--compress", "none"),
    (["--compress", "topk:0"], "--compress", "(0, 1]"),
    (["--compress", "topk:1.5"], "--compress", "(0, 1]"),
    (["--compress", "topk:nan"], "--compress", "(0, 1]"),
    (["--compress", "group_topk:0.1:group=0"], "--compress", "group"),
    (["--algorithm", "prague", "--workers", "4", "--group-size", "1"], "--group-size", ">= 2"),
    (["--algorithm", "ps", "--servers", "0"], "--servers", "> 0"),
    (["--epochs", "nan"], "--epochs", "> 0"),
    (["--epochs", "-1"], "--epochs", "> 0"),
    (["--lr", "inf"], "--lr", "> 0"),
    (["--batch-size", "-3"], "--batch-size", "> 0"),
    (["--batch-size", "2.5"], "--batch-size", "int"),
    (["--on-nonfinite", "ignore"], "--on-nonfinite", "stop, skip"),
    (["--timeout", "0"], "--timeout", "> 0"),
    (["--peer-timeout", "nan"], "--peer-timeout", "> 0"),
    (["--algorithm", "adpsgd", "--workers", "3", "--topology", "ring"], "--topology", "bipartite"),
    (["--task", "regression"], "--task", "your own data set"),
    (["--task", "ranking"], "--task", "classification, regression"),
    (["--target-loss", "-0.5"], "--target-loss", "> 0"),
    (["--servers", "2"], "--servers", "used only by --algorithm ps"),  # it would change nothing
    (["--algorithm", "dpsgd", "--workers", "2", "--sync-every", "16"], "--sync-every", "--algorithm diloco"),
    (["--slow-worker", "3:2x,last:4x"], "--slow-worker", "names worker 3 twice"),
])
def test_settings_refused_before_any_worker(capsys, args, setting, allowed):
    line = bad(capsys, *args)
    assert setting in line and allowed in line, line


@pytest.mark.parametrize("algorithm", ["dpsgd", "d2", "adpsgd", "prague"])
def test_decentralized_algorithms_need_two_workers(capsys, algorithm):
    line = bad(capsys, "--algorithm", algorithm, "--workers", "1")
    assert "--workers" in line and "2" in line, line


def test_more_workers_than_samples(capsys, tmp_path):
    line = bad(capsys, "--workers", "64", "--num-samples", "40", "--run-dir", str(tmp_path))
    assert "--workers" in line and "at most" in line, line


def _npz(path, **arrays):  # noqa: ANN001, ANN202
    np.savez(path, **arrays)
    return str(path)


@pytest.mark.parametrize("arrays,words", [
    ({"x": np.zeros((10, 3), np.float32)}, "'y'"),
    ({"y": np.zeros(10, np.int64)}, "'x'"),
    ({"x": np.zeros((10, 3), np.float32), "y": np.zeros(9, np.int64)}, "must match"),
    ({"x": np.zeros((0, 3), np.float32), "y": np.zeros(0, np.int64)}, "empty"),
])
def test_bad_npz_files_are_named(capsys, tmp_path, arrays, words):
    path = _npz(tmp_path / "data.npz", **arrays)
    line = bad(capsys, "--dataset", "npz", "--data-path", path, "--workers", "2", "--run-dir", str(tmp_path / "r"))
    assert "data.npz" in line and words in line, line


def test_corrupted_idx_file_is_named(capsys, tmp_path):
    rng = np.random.default_rng(0)
    images, labels = rng.integers(0, 256, (40, 4, 4), dtype=np.uint8), rng.integers(0, 3, 40, dtype=np.uint8)

    def idx(array):  # noqa: ANN001, ANN202
        header = bytes([0, 0, 8, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
        return header + array.tobytes()

    for name, array in [("train-images-idx3-ubyte", images), ("train-labels-idx1-ubyte", labels),
                        ("t10k-images-idx3-ubyte", images[:10]), ("t10k-labels-idx1-ubyte", labels[:10])]:
        (tmp_path / name).write_bytes(idx(array))
    (tmp_path / "train-images-idx3-ubyte").write_bytes(idx(images)[:100])  # truncated
    line = bad(capsys, "--dataset", "idx", "--data-path", str(tmp_path), "--workers", "2", "--run-dir", str(tmp_path / "r"))
    assert "train-images-idx3-ubyte" in line and "truncated" in line.lower(), line


def test_port_in_use(capsys, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = bad(capsys, "--workers", "2", "--master-port", str(port), "--run-dir", str(tmp_path))
    assert "--master-port" in line and str(port) in line, line


def test_master_address_not_of_this_machine(capsys, tmp_path):
    line = bad(capsys, "--workers", "2", "--master-addr", "192.0.2.1", "--run-dir", str(tmp_path))  # TEST-NET-1
    assert "--master-addr" in line and "192.0.2.1" in line, line


@pytest.mark.timeout(90)
def test_unreachable_master_fails_at_the_timeout_not_a_hang(tmp_path):
    """A torchrun-style worker whose master never answers gives up after --timeout seconds."""
    from distrain.launch.common import free_port

    port = free_port()  # nobody listens there
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    run = run_cli([*QUICK, "--timeout", "2", "--run-dir", str(tmp_path)], timeout=80, **env)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert "--master-addr" in lines[-1] and f"127.0.0.1:{port}" in lines[-1], run.stderr
    assert 1.5 <= run.wall <= 2 + 40, run.wall  # the timeout, plus starting Python and torch


def test_malformed_bandwidth_trace_is_named(capsys, tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("time_s,worker,bandwidth\n0,0,100mbit\n1,zero,fast\n")
    line = bad(capsys, "--bandwidth-trace", str(trace), "--workers", "2")
    assert "trace.csv" in line, line


def test_netns_without_root(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # as an ordinary user
    line = bad(capsys, "--emulation", "netns", "--workers", "2", "--run-dir", str(tmp_path))
    assert "--emulation" in line and "root" in line, line


@pytest.mark.timeout(240)
@pytest.mark.parametrize("change,named", [(["--model-width", "16", "--model", "cnn1d"], "cnn1d"),
                                          # the same check on another field: `make test-all`
                                          pytest.param(["--algorithm", "dpsgd"], "dpsgd", marks=pytest.mark.slow)])
def test_checkpoint_of_another_model_or_algorithm(tmp_path, capsys, monkeypatch, change, named):
    """A run resumed with another model or algorithm than its checkpoint's is refused in one
    line by the launcher, before any worker starts."""
    import distrain.launch.local

    run = ["--workers", "2", "--epochs", "1", "--run-dir", str(tmp_path)]
    first = run_cli([*QUICK, *run])
    assert first.returncode == 0, first.stderr

    def no_worker(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("a worker was started")

    monkeypatch.setattr(distrain.launch.local, "_start_all", no_worker)
    line = bad(capsys, *run, "--resume", "auto", *change)
    assert "checkpoint" in line and named in line, line
