"""A resumed run reaches the same parameters as an uninterrupted one, and reports the whole run."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from distrain.errors import CheckpointError, WorkerFailure
from distrain.launch import launch_local
from distrain.launch.common import free_port
from distrain.models import build_model
from distrain.runtime.checkpoint import CHECKSUM_KEY, CheckpointStore, content_digest
from distrain.train.metrics import read_metrics
from tests.conftest import small_config
from tests.reliability.common import cli_env, kill_tagged, run_cli, tagged


def _keep_only(run_dir: Path, step: int) -> None:
    """Pretend the run died right after the checkpoint of ``step``: delete every other set."""
    for step_dir in (run_dir / "checkpoints").iterdir():
        if step_dir.name != f"step-{step:08d}":
            shutil.rmtree(step_dir)


def _assert_same_parameters(want_dir: Path, got_dir: Path, step: int, workers: int, nprocs: int) -> None:
    for rank in range(workers):
        want = CheckpointStore(want_dir, rank, nprocs).load(step)["model"]
        got = CheckpointStore(got_dir, rank, nprocs).load(step)["model"]
        for name, tensor in want.items():
            torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=f"rank {rank} {name}")


def _snapshot(run_dir: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(run_dir)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("algorithm,servers", [
    ("allreduce", 0),
    ("ps", 1),  # servers checkpoint their shards and counters (wrap()'s state path: test_ps_state.py)
])
def test_resume_matches_uninterrupted_run(tmp_path, algorithm, servers):
    """Sync all-reduce, and sync parameter server (whose server restores its optimizer state):
    same parameters, and a summary.json that counts the whole run, not only the resumed part."""
    full = tmp_path / "full"
    settings = {"workers": 2, "epochs": 2, "checkpoint_every": 7, "lr_decay": "cosine", "warmup_epochs": 0.5,
                "algorithm": algorithm, "servers": max(servers, 1)}
    nprocs = 2 + servers
    summary = launch_local(small_config(str(full), **settings))
    total = summary["steps"]
    assert total % 7 != 0  # the final checkpoint is an extra one, after the periodic ones
    periodic = min(CheckpointStore(full, 0, nprocs).steps())  # the oldest set pruning kept
    assert 0 < periodic < total

    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    _keep_only(cut, periodic)
    earlier = CheckpointStore(cut, 0, nprocs).load(periodic).get("totals", {})
    resumed = launch_local(small_config(str(cut), resume="auto", **settings))
    assert resumed["resumed_from_step"] == periodic
    _assert_same_parameters(full, cut, total, 2, nprocs)

    # Every byte and sample of the run is counted once, over both segments; a parameter server
    # run's worker 0 sends the server its start header again (shard size, run length, steps per
    # epoch, and whether an optimizer state follows: none, the server has its own checkpoint) and
    # the start values when it resumes.
    numel = sum(t.numel() for t in CheckpointStore(full, 0, nprocs).load(total)["model"].values())
    again = 0 if algorithm == "allreduce" else 4 * 8 + numel * 4
    for key in ("steps_per_worker", "bytes_received_per_worker", "bytes_sent_per_server"):
        assert resumed[key] == summary[key], key
    sent, received = summary["bytes_sent_per_worker"], summary["bytes_received_per_server"]
    assert resumed["bytes_sent_per_worker"] == [sent[0] + again, *sent[1:]]
    assert resumed["bytes_received_per_server"] == [r + again for r in received]
    assert resumed["samples_per_s"] * resumed["wall_time_s"] == pytest.approx(total * 2 * 16)
    assert (summary["segments"], resumed["segments"]) == (1, 2)
    assert resumed["segment_wall_time_s"][0] == earlier.get("segment_wall_s", [None])[0] > 0
    assert resumed["wall_time_s"] == pytest.approx(sum(resumed["segment_wall_time_s"]))
    assert resumed["final_test_accuracy"] == summary["final_test_accuracy"]
    # The metrics lines of the steps after the checkpoint were written again, once.
    lines = read_metrics(cut, 0)
    assert [r["step"] for r in lines] == list(range(1, total + 1))
    assert lines[-1]["bytes_sent"] == read_metrics(full, 0)[-1]["bytes_sent"] + again


def _losing_server_1_at_step_10(run_dir: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """A run of two workers and two servers whose server 1 (rank 3) is killed at step 10."""
    os.environ["DISTRAIN_INJECT_KILL"] = "3:10"
    try:
        return launch_local(small_config(str(run_dir), **settings))
    finally:
        del os.environ["DISTRAIN_INJECT_KILL"]


@pytest.mark.timeout(240)
def test_a_run_whose_lost_server_was_taken_over_resumes_from_the_sets_saved_after_the_loss(tmp_path, caplog):
    """ps, two servers; server 1 killed as round 10 begins: server 0 takes its parameters over and
    saves them with its own shard, with their optimizer state, in the sets that follow (server 1
    writes none, and the sets name the others only). A run resumed from such a set gives each
    server its own shard and momentum back from server 0's file: it ends on the parameters of the
    run that was never stopped, bit for bit, and its summary keeps the lost server."""
    settings = {"workers": 2, "epochs": 2, "checkpoint_every": 7, "algorithm": "ps", "servers": 2, "min_workers": 1,
                "momentum": 0.9}
    full = tmp_path / "full"
    with caplog.at_level(logging.WARNING, logger="distrain.launch.local"):
        summary = _losing_server_1_at_step_10(full, settings)
    assert "server 1 (rank 3) was killed by SIGKILL; the workers and the other servers finished without it" in caplog.text
    total = summary["steps"]
    assert list(summary["lost_servers"]) == ["1"]
    store = CheckpointStore(full, 0, 4)
    point = min(step for step in store.steps() if 10 < step < total)  # the oldest set kept from after the loss
    assert store.members(point) == [0, 1, 2]
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    _keep_only(cut, point)
    resumed = launch_local(small_config(str(cut), resume="auto", **settings))
    assert resumed["resumed_from_step"] == point and resumed["steps_per_worker"] == summary["steps_per_worker"]
    assert resumed["lost_servers"] == summary["lost_servers"]  # the first segment's loss is kept
    _assert_same_parameters(full, cut, total, 2, 4)


def test_checkpoint_of_a_real_run_loads_with_plain_torch_load(tmp_path):
    """One worker in this process: a checkpoint is an ordinary weights-only torch file whose
    digest catches a flipped byte of the parameters."""
    summary = launch_local(small_config(str(tmp_path / "run"), workers=1, epochs=1))
    path = CheckpointStore(tmp_path / "run", 0, 1).rank_file(summary["steps"])
    plain = torch.load(path, weights_only=True)
    digest = plain.pop(CHECKSUM_KEY)
    assert digest == content_digest(plain)
    assert plain["step"] == summary["steps"] and plain["model_name"] == "mlp"
    model = build_model("mlp", (32,), 10, width=32, depth=2)
    model.load_state_dict(plain["model"])  # every tensor there, in its shape

    weights = next(t for t in plain["model"].values() if t.dim() == 2)
    data = bytearray(path.read_bytes())
    at = data.find(weights.numpy().tobytes())
    assert at > 0
    data[at + 5] ^= 0x01  # one bit of one weight
    path.write_bytes(bytes(data))
    store = CheckpointStore(tmp_path / "run", 0, 1)
    assert store.latest_complete() is None  # the only set is damaged: nothing to resume from
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        store.load(summary["steps"])


# --- asynchronous gossip: each worker goes on from its own file -----------------------------------


def _mean_model(run_dir: Path, step: int, workers: int) -> dict[str, torch.Tensor]:
    """The average of the workers' models in ``step``'s set: the consensus there."""
    files = [CheckpointStore(run_dir, rank, workers).load(step)["model"] for rank in range(workers)]
    return {name: sum(f[name].double() for f in files) / workers for name in files[0]}


def _complete(store: CheckpointStore, step: int) -> bool:
    try:
        return store.resolve(str(step)) == step
    except CheckpointError:
        return False


def _training_steps(run_dir: Path, rank: int) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir, rank) if "loss" in r and not r.get("snapshot")]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("algorithm", ["adpsgd", pytest.param("prague", marks=pytest.mark.slow)])
def test_an_asynchronous_run_goes_on_from_each_workers_own_file(tmp_path, algorithm):
    """Asynchronous workers save at their own steps, each at its own time. A run resumed from a
    set goes on with every worker from its own file: its own step count (its metrics go on from
    the next step, none written twice or missing), the others' progress for the global budget,
    and its model. With a learning rate of 1e-12 the resumed run only averages, which keeps the
    workers' mean: it must end on the mean of the models of the set it resumed from."""
    settings = {"algorithm": algorithm, "workers": 4, "epochs": 1, "checkpoint_every": 4}
    full = tmp_path / "full"
    first = launch_local(small_config(str(full), **settings))
    total = first["steps"]
    store = CheckpointStore(full, 0, 4)
    end = store.latest_complete()
    point = min(s for s in store.steps() if s < end and _complete(store, s))  # a periodic set pruning kept
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    _keep_only(cut, point)  # the run died after every worker had saved that step (before its summary)
    (cut / "summary.json").unlink()
    assert CheckpointStore(cut, 0, 4).latest_complete() == point
    want = _mean_model(cut, point, 4)

    resumed = launch_local(small_config(str(cut), resume="auto", **{**settings, "lr": 1e-12}))
    assert resumed["resumed_from_step"] == point and resumed["segments"] == 2
    assert sum(resumed["steps_per_worker"]) >= 4 * total  # the global budget: counted from the set's steps on
    end = CheckpointStore(cut, 0, 4).latest_complete()
    state = CheckpointStore(cut, 0, 4).load(end)
    assert state["budget_done"] is True and end == max(state["algorithm"]["gossip_counts"])
    assert state["algorithm"]["gossip_counts"] == resumed["steps_per_worker"]
    got = _mean_model(cut, end, 4)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-6, msg=name)
    for rank in range(4):
        assert _training_steps(cut, rank) == list(range(1, resumed["steps_per_worker"][rank] + 1)), rank


# `make test-all`: asynchronous servers resuming stay in CI through the run whose lost server was taken over
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_asynchronous_parameter_servers_resume_from_the_set_every_worker_had_pushed(tmp_path):
    """Asynchronous servers save a set once every worker has pushed its step (each worker saves
    its own file there as it finishes that step). With --max-staleness 0 nobody is ahead then,
    so the set is the synchronous run's, the round's momentum included: resumed from it, the
    run ends on the uninterrupted run's parameters (to the order in which pushes were added)."""
    settings = {"workers": 2, "epochs": 2, "checkpoint_every": 7, "algorithm": "ps", "servers": 2,
                "ps_mode": "async", "max_staleness": 0, "momentum": 0.9}
    full = tmp_path / "full"
    summary = launch_local(small_config(str(full), **settings))
    total = summary["steps"]
    store = CheckpointStore(full, 0, 4)
    point = min(s for s in store.steps() if s < total and _complete(store, s))
    assert 0 < point and CheckpointStore(full, 2, 4).load(point)["step"] == point  # a server's file too
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    _keep_only(cut, point)
    (cut / "summary.json").unlink()
    resumed = launch_local(small_config(str(cut), resume="auto", **settings))
    assert resumed["resumed_from_step"] == point and resumed["steps_per_worker"] == [total, total]
    for rank in range(4):  # the workers' models and the servers' shards
        want, got = (CheckpointStore(d, rank, 4).load(total) for d in (full, cut))
        for name, tensor in (want["model"] if rank < 2 else {"shard": want["shard"]}).items():
            torch.testing.assert_close((got["model"] if rank < 2 else got)[name], tensor, rtol=0, atol=1e-5,
                                       msg=f"rank {rank} {name}")


@pytest.mark.slow  # a server lost, then a refusal: CI resumes asynchronous servers in the test above
@pytest.mark.timeout(240)
def test_asynchronous_servers_that_took_a_lost_server_over_refuse_to_resume_from_the_sets_after_it(tmp_path):
    """The asynchronous servers do not save the pieces they take over from a lost server with
    their state: they save no set while they hold them but the last (so that a finished run,
    resumed, still says so), and a resume from it is refused in one line before anything starts."""
    settings = {"workers": 2, "epochs": 2, "checkpoint_every": 7, "algorithm": "ps", "servers": 2,
                "ps_mode": "async", "max_staleness": 0, "min_workers": 1}
    run = tmp_path / "run"
    total = _losing_server_1_at_step_10(run, settings)["steps"]
    store = CheckpointStore(run, 0, 4)
    assert store.latest_complete() == total and store.members(total) == [0, 1, 2]
    assert not any(10 < s < total and _complete(store, s) for s in store.steps())  # none while the pieces are held
    again = launch_local(small_config(str(run), resume="auto", **settings))
    assert again["already_finished"] is True
    with pytest.raises(CheckpointError, match="held a lost server's parameters"):
        launch_local(small_config(str(run), resume="auto", **{**settings, "epochs": 3}))
    launch_local(small_config(str(run), resume="7", **{**settings, "epochs": 3}))  # a set from before the loss


@pytest.mark.slow  # three 4-worker runs: test_an_asynchronous_run_goes_on_... resumes adpsgd in CI
@pytest.mark.timeout(240)
def test_a_finished_asynchronous_run_resumed_changes_nothing_and_extends_with_more_epochs(tmp_path):
    """The workers of an asynchronous run end at different steps; the set they save at the end
    says the budget was used up, so resuming with the same --epochs touches nothing (whichever
    worker is the slowest), and a larger --epochs goes on from every worker's own last step."""
    run = tmp_path / "run"
    settings = {"algorithm": "adpsgd", "workers": 4, "epochs": 1, "slow_worker": "0:3x"}
    first = launch_local(small_config(str(run), **settings))
    assert first["steps_per_worker"][0] < first["steps"]  # the slow worker 0 did not reach the run's length
    before = _snapshot(run)
    again = launch_local(small_config(str(run), resume="auto", **settings))
    assert again["already_finished"] is True and again["finished_step"] == max(first["steps_per_worker"])
    assert _snapshot(run) == before

    longer = launch_local(small_config(str(run), resume="auto", **{**settings, "epochs": 2}))
    assert longer.get("already_finished") is None and longer["segments"] == 2
    assert sum(longer["steps_per_worker"]) >= 4 * longer["steps"] == 8 * first["steps"]
    assert all(b > a for a, b in zip(first["steps_per_worker"], longer["steps_per_worker"], strict=True))
    for rank in range(4):
        assert _training_steps(run, rank) == list(range(1, longer["steps_per_worker"][rank] + 1)), rank


# --- a finished run, resumed ---------------------------------------------------------------------

QUICK_TWO = ["--workers", "2", "--dataset", "synthetic", "--num-samples", "1200", "--model", "mlp",
             "--model-width", "32", "--batch-size", "16", "--lr", "0.05", "--warmup-epochs", "0",
             "--no-progress", "--timeout", "60"]


@pytest.mark.timeout(240)
def test_finished_run_resumed_changes_nothing_and_extends_with_more_epochs(tmp_path):
    run = tmp_path / "run"
    settings = {"workers": 2, "epochs": 1, "lr_decay": "cosine"}
    first = launch_local(small_config(str(run), **settings))
    assert first["final_test_accuracy"] is not None
    before = _snapshot(run)

    # As a user types it: one line, exit 0, and the run directory exactly as it was.
    again = run_cli([*QUICK_TWO, "--epochs", "1", "--lr-decay", "cosine", "--run-dir", str(run), "--resume", "auto"])
    assert again.returncode == 0, again.stderr
    assert again.stderr == "" and again.orphans == []
    lines = again.stdout.strip().splitlines()
    assert len(lines) == 1 and "already trained 30 steps (1 epoch)" in lines[0], again.stdout
    assert _snapshot(run) == before
    # From Python: the recorded result, unchanged.
    result = launch_local(small_config(str(run), resume="auto", **settings))
    assert result["already_finished"] is True
    assert result["final_test_accuracy"] == first["final_test_accuracy"]
    assert _snapshot(run) == before

    # More epochs: the run goes on from its last step, and its summary covers both parts.
    longer = launch_local(small_config(str(run), resume="auto", **{**settings, "epochs": 2}))
    assert longer.get("already_finished") is None
    assert longer["resumed_from_step"] == first["steps"] == 30
    assert longer["steps"] == 60 and longer["steps_per_worker"] == [60, 60]
    assert longer["segments"] == 2 and longer["final_test_accuracy"] is not None
    assert longer["bytes_sent_per_worker"] == [2 * b for b in first["bytes_sent_per_worker"]]
    assert longer["segment_wall_time_s"][0] == first["wall_time_s"]
    state = CheckpointStore(run, 0, 2).load(60)
    assert (state["step"], state["total_steps"], state["epochs"]) == (60, 60, 2)
    lrs = [r["lr"] for r in read_metrics(run, 0)]
    assert lrs[29] < 0.01 * lrs[0] and lrs[30] > 10 * lrs[29]  # the 2-epoch cosine's value at step 30


def test_finished_single_worker_run_resumed_in_process(tmp_path):
    """One worker trains in this process: the loop itself finds nothing left to train."""
    run = tmp_path / "run"
    first = launch_local(small_config(str(run), workers=1, epochs=1))
    before = _snapshot(run)
    result = launch_local(small_config(str(run), workers=1, epochs=1, resume="auto"))
    assert result["already_finished"] is True and result["finished_step"] == first["steps"]
    assert result["final_test_accuracy"] == first["final_test_accuracy"]
    assert _snapshot(run) == before


@pytest.mark.slow  # two torchrun jobs: about 30 s on 2 busy cores
@pytest.mark.timeout(300)
@pytest.mark.parametrize("algorithm", ["allreduce", "ps"])
def test_finished_run_resumed_under_torchrun_changes_nothing(tmp_path, algorithm):
    run = tmp_path / "run"
    args = [*QUICK_TWO, "--epochs", "1", "--algorithm", algorithm, "--run-dir", str(run)]
    nprocs = "3" if algorithm == "ps" else "2"
    tag = uuid.uuid4().hex

    def torchrun(*extra: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", nprocs, "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m", "distrain", "train", *args, *extra]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=cli_env(tag))

    try:
        first = torchrun()
        assert first.returncode == 0, first.stderr[-3000:]
        before = _snapshot(run)
        again = torchrun("--resume", "auto")
        orphans = tagged(tag)
    finally:
        kill_tagged(tag)
    assert again.returncode == 0, again.stderr[-3000:]
    assert orphans == []
    lines = again.stdout.strip().splitlines()
    assert len(lines) == 1 and "already trained" in lines[0], again.stdout
    assert "Traceback" not in again.stderr
    assert _snapshot(run) == before


# --- four workers: where a gradient sits in a bucket, and every synchronous algorithm -----------


@pytest.mark.timeout(240)
@pytest.mark.slow  # `make test-all`: test_resume_matches_uninterrupted_run resumes all-reduce in CI
def test_four_worker_allreduce_resumes_bitwise(tmp_path):
    """gloo adds 3 or more workers' values in an order set by where a value sits in the bucket:
    the resumed run must use the buckets the first step regrouped (a CNN's gradients are not
    ready in reverse parameter order), or it drifts from the uninterrupted run. Resumed mid-epoch,
    during the warm-up (step 10); the slow matrix below covers more points and algorithms."""
    full = tmp_path / "full"
    settings = {"workers": 4, "epochs": 2, "model": "cnn1d", "lr": 0.2, "lr_decay": "cosine", "warmup_epochs": 1,
                "checkpoint_every": 10}
    summary = launch_local(small_config(str(full), **settings))
    total = summary["steps"]
    assert CheckpointStore(full, 0, 4).steps() == [10, 20, total] and total == 30
    order = CheckpointStore(full, 0, 4).load(10)["algorithm"]["bucket_order"].tolist()
    assert order != sorted(order, reverse=True)  # the first step did regroup the buckets
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    _keep_only(cut, 10)
    resumed = launch_local(small_config(str(cut), resume="auto", **settings))
    assert resumed["resumed_from_step"] == 10
    assert resumed["bytes_sent_per_worker"] == summary["bytes_sent_per_worker"]
    _assert_same_parameters(full, cut, total, 4, 4)


def dropout_mlp() -> torch.nn.Module:
    """A model that draws random numbers every step (spawned workers import it from here)."""
    return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 10))


#: Every synchronous algorithm, and compressors with error feedback; 4 workers, a CNN.
MATRIX: dict[str, dict[str, Any]] = {
    "allreduce": {},
    "allreduce-own-ring": {"ring": "own"},
    "hierarchical": {"workers_per_node": 2},
    "ps-sync": {"algorithm": "ps", "servers": 2},
    "dpsgd": {"algorithm": "dpsgd"},
    "d2": {"algorithm": "d2"},
    "group-topk": {"compress": "group_topk:0.1"},
    "qsgd": {"compress": "qsgd"},
    "ps-group-topk": {"algorithm": "ps", "compress": "group_topk:0.1"},
    "dropout": {"model": "mlp"},  # the random number generators' state
}


@pytest.mark.slow  # 9 runs of 4 workers per case: about a minute each on 2 busy cores
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", sorted(MATRIX))
def test_four_workers_resume_bitwise_at_every_point(tmp_path, case):
    """Killed (DISTRAIN_INJECT_KILL) right after the checkpoint of step 1 (the first step, which
    regroups the all-reduce buckets), 5 (during the learning-rate warm-up), 11 (mid-epoch, just
    after the warm-up) and 20 (mid-way through the second epoch), then resumed: the
    parameters are those of the run that was never interrupted, bit for bit."""
    settings = {"workers": 4, "epochs": 2, "model": "cnn1d", "lr_decay": "cosine", "warmup_epochs": 0.5,
                **MATRIX[case]}
    model_fn = dropout_mlp if case == "dropout" else None
    nprocs = 4 + (settings.get("servers", 1) if settings.get("algorithm") == "ps" else 0)
    full = launch_local(small_config(str(tmp_path / "full"), **settings), model_fn=model_fn)
    total = full["steps"]
    for point in (1, 5, 11, 20):
        cut = tmp_path / f"cut{point}"
        cfg = small_config(str(cut), checkpoint_every=point, min_workers=4, **settings)  # a loss stops the run
        os.environ["DISTRAIN_INJECT_KILL"] = f"1:{point}"  # worker 1 dies as step `point` starts
        try:
            with pytest.raises(WorkerFailure):
                launch_local(cfg, model_fn=model_fn)
        finally:
            del os.environ["DISTRAIN_INJECT_KILL"]
        resumed = launch_local(small_config(str(cut), checkpoint_every=point, resume="auto", **settings),
                               model_fn=model_fn)
        assert resumed["resumed_from_step"] == point
        assert resumed["steps_per_worker"] == full["steps_per_worker"]
        _assert_same_parameters(tmp_path / "full", cut, total, 4, nprocs)
        assert json.loads((cut / "summary.json").read_text())["segments"] == 2
