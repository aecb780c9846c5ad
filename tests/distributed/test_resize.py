"""A run resumed with another number of workers goes on as after a change of its members at the
checkpoint's step: every new worker starts from the checkpoint's model and optimizer state, the
step count goes on, the rest of the interrupted epoch is dealt out over the new workers (every
sample once), and the learning rate is the one of the new global batch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from distrain.data import batches_of, labels_of, load_dataset
from distrain.data.sampler import ShardSampler
from distrain.errors import CheckpointError
from distrain.launch import launch_local
from distrain.models import build_model
from distrain.optim.optimizers import build_optimizer
from distrain.runtime.checkpoint import CheckpointStore
from distrain.train.loop import PLAN_KEY, plan_of, split
from distrain.train.resume import check_worker_count, epoch_workers
from tests.conftest import small_config
from tests.reliability.common import cli_env, kill_tagged, tagged

pytestmark = pytest.mark.timeout(240)


def _keep_only(run_dir: Path, step: int) -> None:
    """Pretend the run died right after the checkpoint of ``step``: delete every other set and
    the summary."""
    (run_dir / "summary.json").unlink()
    for step_dir in (run_dir / "checkpoints").iterdir():
        if step_dir.name != f"step-{step:08d}":
            shutil.rmtree(step_dir)


def test_resume_with_fewer_workers_is_the_checkpoint_stepped_with_the_new_workers_gradients(tmp_path):
    """3 workers checkpoint step 14 of 40 (20 steps an epoch, shards of 320); resumed with 2. The
    2 workers' parameters at step 40 are those of the checkpoint's model and optimizer stepped in
    this test with the average of the 2 workers' gradients on their batches at the learning rate
    of a global batch of 32; the batches of the first steps after the resume are exactly what the
    3 workers' epoch had left (every sample of the epoch once); the summary records the change."""
    run_dir = tmp_path / "run"
    first = small_config(str(run_dir), workers=3, epochs=2, checkpoint_every=14)
    launch_local(first)
    _keep_only(run_dir, 14)
    checkpoint = CheckpointStore(run_dir, 0, 3).load(14)
    assert checkpoint["step"] == 14 and checkpoint["steps_per_epoch"] == 20 and checkpoint["world_size"] == 3

    cfg = small_config(str(run_dir), workers=2, epochs=2, checkpoint_every=7, resume="auto")
    summary = launch_local(cfg)
    assert summary["steps"] == 40 and summary["resumed_from_step"] == 14  # the 3 workers' length in steps
    assert summary["workers"] == 2 and summary["workers_at_end"] == 2 and summary["global_batch"] == 32
    [change] = summary["membership"]
    assert change["event"] == "resized" and change["workers_before"] == 3 and change["members"] == [0, 1]
    assert change["left"] == [2] and change["joined"] == [] and change["resized_at_step"] == 14
    assert summary["steps_per_worker"] == [40, 40] and summary["segments"] == 2
    ends = [CheckpointStore(run_dir, r, 2).load(40) for r in range(2)]

    # Every sample of the interrupted epoch once: what each of the 3 workers took of its shard
    # before step 14, and what the 2 workers take from step 14 until the epoch's samples run out.
    train_set, _ = load_dataset("synthetic", num_samples=cfg.data.num_samples, seed=cfg.run.seed)
    n = len(train_set)
    parts = split(first, train_set, 3)
    assert all(len(p) == 320 for p in parts)
    taken = [torch.cat([ShardSampler(parts[r], 16, cfg.run.seed, r).batch(s) for s in range(14)]) for r in range(3)]
    plan = plan_of(cfg, train_set, ends[0][PLAN_KEY])
    assert plan.members == [0, 1] and torch.equal(plan.state(), ends[1][PLAN_KEY])
    left = sum(len(p) for p in parts) - 3 * 14 * 16  # 288 samples, 144 for each new worker: 9 steps
    assert [len(plan.samplers[w].carry) for w in (0, 1)] == [left // 2, left // 2]
    rest = [torch.cat([plan.samplers[w].batch(s) for s in range(14, 14 + left // 32)]) for w in (0, 1)]
    epoch = torch.cat([*taken, *rest])
    assert torch.equal(torch.sort(epoch).values, torch.arange(n)), "every sample of the epoch once"

    # The reference: the checkpoint's model and optimizer, stepped here with the new workers' gradients.
    torch.set_num_threads(cfg.run.threads)
    sample_shape = tuple(batches_of(train_set, torch.tensor([0]))[0].shape[1:])
    num_classes = int(labels_of(train_set).max()) + 1
    model = build_model("mlp", sample_shape, num_classes, width=32, depth=2)
    model.load_state_dict(checkpoint["model"])
    o = cfg.optim
    lr = o.lr * 32 / o.reference_batch  # linear scaling rule for the 2 workers' global batch
    optimizer = build_optimizer(o.optimizer, model.parameters(), lr=lr, momentum=o.momentum,
                                weight_decay=o.weight_decay)
    optimizer.load_state_dict(checkpoint["optimizer"])
    params = list(model.parameters())
    for step in range(14, 40):
        grads = []
        for w in (0, 1):
            x, y = batches_of(train_set, plan.samplers[w].batch(step))
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y, reduction="none").mean().backward()
            grads.append([p.grad.clone() for p in params])
        for p, g0, g1 in zip(params, *grads, strict=True):
            p.grad = g0 * 0.5 + g1 * 0.5
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
    for end in ends:
        for name, tensor in model.state_dict().items():
            torch.testing.assert_close(end["model"][name], tensor, rtol=0, atol=1e-6, msg=name)

    lines = [json.loads(line) for line in (run_dir / "metrics" / "rank0.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "loss" in line]
    assert [line["step"] for line in steps] == list(range(1, 41))
    assert [line["lr"] for line in steps] == pytest.approx([o.lr * 48 / o.reference_batch] * 14 + [lr] * 26)
    assert [(line["event"], line["step"]) for line in lines if "event" in line] == [("resized", 14)]


def test_an_algorithm_that_cannot_change_the_worker_count_is_refused_before_any_worker_starts(tmp_path):
    """A D-PSGD checkpoint set of 3 workers resumed with 2: one line naming --workers and the
    algorithms that can, exit 2, and the run directory untouched."""
    run_dir = tmp_path / "run"
    for rank in range(3):
        CheckpointStore(run_dir, rank, 3).save(6, {
            "model": {}, "step": 6, "model_name": "mlp", "algorithm_name": "dpsgd", "world_size": 3,
            "set_size": 3, "epochs": 1, "steps_per_epoch": 20, "total_steps": 20})
    files = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    tag = uuid.uuid4().hex
    try:
        done = subprocess.run(
            [sys.executable, "-m", "distrain", "train", "--dataset", "synthetic", "--num-samples", "1200",
             "--model", "mlp", "--algorithm", "dpsgd", "--workers", "2", "--resume", "auto", "--no-progress",
             "--run-dir", str(run_dir)], env=cli_env(tag), capture_output=True, text=True, timeout=120)
        assert tagged(tag) == []
    finally:
        kill_tagged(tag)
    assert done.returncode == 2, done.stderr
    [line] = [line for line in done.stderr.splitlines() if line.strip()]
    assert "checkpoint was written by 3 workers; this run has 2" in line
    assert "--algorithm dpsgd cannot change the number of workers on resume (only allreduce" in line
    assert "resume with --workers 3" in line
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == files


def test_which_runs_can_change_the_number_of_workers() -> None:
    """Flat all-reduce can; hierarchical all-reduce, shard files and every other algorithm cannot;
    the same number always can. The run's epochs stay those of its first workers."""
    state = {"world_size": 4}
    check_worker_count(state, "allreduce", 3)
    check_worker_count(state, "allreduce", 6)
    for algorithm in ("dpsgd", "d2", "diloco", "ps", "adpsgd", "prague"):
        check_worker_count(state, algorithm, 4)
        with pytest.raises(CheckpointError, match=f"--algorithm {algorithm} cannot change the number of workers"):
            check_worker_count(state, algorithm, 3)
    with pytest.raises(CheckpointError, match="--workers-per-node"):
        check_worker_count(state, "allreduce", 2, workers_per_node=2)
    with pytest.raises(CheckpointError, match="--dataset shards"):
        check_worker_count(state, "allreduce", 2, dataset="shards")
    assert epoch_workers(None, 3) == 3 and epoch_workers(state, 3) == 4
    assert epoch_workers({"world_size": 3, "epoch_workers": 4}, 2) == 4
