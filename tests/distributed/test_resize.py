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
from distrain.launch.checks import check_resume
from distrain.models import build_model
from distrain.optim.optimizers import build_optimizer
from distrain.runtime.checkpoint import CheckpointStore, epoch_steps
from distrain.train.loop import PLAN_KEY, plan_of, split
from distrain.train.resume import at_round_end, check_worker_count, epoch_workers, resize_setting
from tests.conftest import small_config
from tests.reliability.common import cli_env, kill_tagged, tagged

pytestmark = pytest.mark.timeout(240)


def _keep_only(run_dir: Path, *steps: int) -> None:
    """Pretend the run died right after the checkpoint of the last of ``steps``: delete every
    other set and the summary."""
    (run_dir / "summary.json").unlink()
    for step_dir in (run_dir / "checkpoints").iterdir():
        if step_dir.name not in {f"step-{step:08d}" for step in steps}:
            shutil.rmtree(step_dir)


def _check_resized(summary: dict, at: int) -> None:
    """The summary of a 3 workers' run of 40 steps resumed with 2 at step ``at``."""
    assert summary["steps"] == 40 and summary["resumed_from_step"] == at  # the 3 workers' length in steps
    assert summary["workers"] == 2 and summary["workers_at_end"] == 2
    [change] = summary["membership"]
    assert change["event"] == "resized" and change["workers_before"] == 3 and change["members"] == [0, 1]
    assert change["left"] == [2] and change["joined"] == [] and change["resized_at_step"] == at
    assert summary["steps_per_worker"] == [40, 40] and summary["segments"] == 2


def _check_epoch_once(first, cfg, ends: list[dict], begun: int, at: int):  # noqa: ANN001, ANN202
    """Every sample of the epoch interrupted at step ``at`` (begun at step ``begun``) once: what
    each of the 3 workers took of its shard before ``at``, and what the 2 workers take from ``at``
    until the epoch's samples run out. Returns the training set, the 3 workers' shards and the
    plan the 2 workers saved."""
    train_set, _ = load_dataset("synthetic", num_samples=cfg.data.num_samples, seed=cfg.run.seed)
    parts = split(first, train_set, 3)
    taken = [torch.cat([ShardSampler(parts[r], 16, cfg.run.seed, r).batch(s) for s in range(begun, at)])
             for r in range(3)]
    plan = plan_of(cfg, train_set, ends[0][PLAN_KEY])
    assert plan.members == [0, 1] and torch.equal(plan.state(), ends[1][PLAN_KEY])
    left = sum(len(p) for p in parts) - 3 * (at - begun) * 16  # dealt out evenly over the 2 new workers
    assert [len(plan.samplers[w].carry) for w in (0, 1)] == [left // 2, left // 2]
    rest = [torch.cat([plan.samplers[w].batch(s) for s in range(at, at + left // 32)]) for w in (0, 1)]
    epoch = torch.cat([*taken, *rest])
    assert torch.equal(torch.sort(epoch).values, torch.arange(len(train_set))), "every sample of the epoch once"
    return train_set, parts, plan


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
    _check_resized(summary, 14)
    assert summary["global_batch"] == 32
    ends = [CheckpointStore(run_dir, r, 2).load(40) for r in range(2)]

    # Every sample of the interrupted epoch once (the 3 workers' first 14 steps; 288 samples left,
    # 144 for each new worker: 9 steps).
    train_set, parts, plan = _check_epoch_once(first, cfg, ends, 0, 14)
    assert all(len(p) == 320 for p in parts)

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


def test_resume_with_more_workers_keeps_the_length_its_first_workers_planned(tmp_path):
    """800 training samples make 25 steps an epoch for 2 workers of batch 16; split in 3 shards they
    are 798. Resumed with 3, the run keeps the 2 workers' 25 steps (it was refused as if another
    --batch-size had been given)."""
    run_dir = tmp_path / "run"
    first = small_config(str(run_dir), workers=2, num_samples=1000, checkpoint_every=10)
    launch_local(first)
    _keep_only(run_dir, 10)
    train_set, _ = load_dataset("synthetic", num_samples=1000, seed=first.run.seed)
    planned = epoch_steps(sum(len(p) for p in split(first, train_set, 2)), 2, 16)
    assert sum(len(p) for p in split(first, train_set, 3)) < len(train_set) and planned == 25  # the case
    summary = launch_local(small_config(str(run_dir), workers=3, num_samples=1000, resume="auto"))
    assert summary["steps"] == planned and summary["resumed_from_step"] == 10
    assert summary["workers"] == 3 and summary["steps_per_worker"] == [planned, planned, planned - 10]  # (2 joined at 10)


def test_diloco_resumed_with_fewer_workers_from_a_round_end_is_the_checkpoint_stepped_in_rounds_of_the_new_workers(tmp_path):
    """3 DiLoCo workers (H 4) save every 7 steps of 40 (20 an epoch); the run dies after step 35,
    in the middle of a round, with the sets of steps 28 (a round's end) and 35 kept. Resumed with
    2 workers and --resume auto, it goes on from step 28: the newest set saved at a round's end
    (the mid-round one alone, or named, is refused in one line). The 2 workers' parameters at
    step 40 are those of the checkpoint's shared parameters and outer momentum after three rounds
    computed here: each worker's 4 inner steps from the checkpoint's model with its own file's
    inner optimizer (the learning rate of one worker's batch, as before), then the outer Nesterov
    step on their averaged pseudo-gradients. The rest of the interrupted epoch is dealt out over
    the 2 workers (every sample once) and the summary records the change."""
    run_dir = tmp_path / "run"
    diloco = {"algorithm": "diloco", "sync_every": 4}
    first = small_config(str(run_dir), workers=3, epochs=2, checkpoint_every=7, **diloco)
    launch_local(first)
    _keep_only(run_dir, 28, 35)
    checkpoints = [CheckpointStore(run_dir, 0, 3).load(28, r) for r in range(3)]
    assert at_round_end(checkpoints[0]) and not at_round_end(CheckpointStore(run_dir, 0, 3).load(35))
    shared = checkpoints[0]["algorithm"]["shared"]
    for checkpoint in checkpoints:  # a round's end: every worker holds the shared parameters
        assert torch.equal(torch.cat([t.reshape(-1) for t in checkpoint["model"].values()]), shared)

    cfg = small_config(str(run_dir), workers=2, epochs=2, checkpoint_every=7, resume="auto", **diloco)
    with pytest.raises(CheckpointError, match="written by 3 workers in the middle of a DiLoCo round .* resume with "
                                              "--workers 3, or 2 from a set saved at a round's end"):
        check_resume(small_config(str(run_dir), workers=2, resume="35", **diloco), run_dir, 2)
    (run_dir / "checkpoints" / "step-00000028").rename(tmp_path / "aside")
    with pytest.raises(CheckpointError, match="middle of a DiLoCo round"):  # no set of a round's end kept
        check_resume(cfg, run_dir, 2)
    (tmp_path / "aside").rename(run_dir / "checkpoints" / "step-00000028")
    assert check_resume(cfg, run_dir, 2)["step"] == 28

    summary = launch_local(cfg)
    _check_resized(summary, 28)
    ends = [CheckpointStore(run_dir, r, 2).load(40) for r in range(2)]

    # Every sample of the interrupted epoch (steps 20 to 39 of the 3 workers) once: 576 samples
    # left, 288 for each new worker: 18 steps.
    train_set, _, plan = _check_epoch_once(first, cfg, ends, 20, 28)

    # The reference: three rounds of the 2 workers from the checkpoint, computed here.
    torch.set_num_threads(cfg.run.threads)
    sample_shape = tuple(batches_of(train_set, torch.tensor([0]))[0].shape[1:])
    num_classes = int(labels_of(train_set).max()) + 1
    o, outer = cfg.optim, cfg.outer
    lr = o.lr * 16 / o.reference_batch  # inner steps: one worker's batch, whatever the number of workers
    models, optimizers = [], []
    for w in (0, 1):
        model = build_model("mlp", sample_shape, num_classes, width=32, depth=2)
        model.load_state_dict(checkpoints[w]["model"])
        optimizer = build_optimizer(o.optimizer, model.parameters(), lr=lr, momentum=o.momentum,
                                    weight_decay=o.weight_decay)
        optimizer.load_state_dict(checkpoints[w]["optimizer"])
        models.append(model)
        optimizers.append(optimizer)
    shared, buffer = shared.clone(), checkpoints[0]["algorithm"]["buffer"].clone()
    assert bool(checkpoints[0]["algorithm"]["has_buffer"].all())
    mu = outer.outer_momentum
    for start in (28, 32, 36):
        for model, optimizer, w in zip(models, optimizers, (0, 1), strict=True):
            for step in range(start, start + 4):
                x, y = batches_of(train_set, plan.samplers[w].batch(step))
                model.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y, reduction="none").mean().backward()
                for group in optimizer.param_groups:
                    group["lr"] = lr
                optimizer.step()
        deltas = [shared - torch.cat([p.detach().reshape(-1) for p in model.parameters()]) for model in models]
        delta = (deltas[0] + deltas[1]) / 2
        buffer = buffer * mu + delta
        shared = shared - outer.outer_lr * (delta + mu * buffer)
        for model in models:
            torch.nn.utils.vector_to_parameters(shared.clone(), model.parameters())  # (takes views)
    for end in ends:
        torch.testing.assert_close(end["algorithm"]["shared"], shared, rtol=0, atol=1e-6)
        torch.testing.assert_close(torch.cat([t.reshape(-1) for t in end["model"].values()]), shared, rtol=0, atol=1e-6)

    lines = [json.loads(line) for line in (run_dir / "metrics" / "rank0.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "loss" in line]
    assert [line["step"] for line in steps] == list(range(1, 41))
    assert [line["lr"] for line in steps] == pytest.approx([lr] * 40)
    assert [(line["event"], line["step"]) for line in lines if "event" in line] == [("resized", 28)]


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
    """Flat all-reduce can; DiLoCo can from a set saved at a round's end, in its elastic
    configuration (one fragment, no overlap, no compression, a fixed H); hierarchical
    all-reduce, shard files and every other algorithm cannot; the same number always can. The
    run's epochs stay those of its first workers."""
    state = {"world_size": 4}
    check_worker_count(state, "allreduce", 3)
    check_worker_count(state, "allreduce", 6)
    synced = {"inner_steps": 8, "synced_at": torch.tensor([8]), "pending": [],
              "interrupted": torch.zeros(0, dtype=torch.int64)}
    round_end = {"world_size": 4, "step": 8, "algorithm": synced}
    check_worker_count(round_end, "diloco", 3)
    check_worker_count(round_end, "diloco", 6, setting=resize_setting(small_config("unused", algorithm="diloco")))
    with pytest.raises(CheckpointError, match="step 10 was written by 4 workers in the middle of a DiLoCo round"):
        check_worker_count({**round_end, "step": 10, "algorithm": {**synced, "inner_steps": 10}}, "diloco", 3)
    for settings, flag in [({"sync_every": "auto"}, "--sync-every auto"), ({"fragments": 2}, "--fragments 2"),
                           ({"fragments": 2, "overlap_steps": 1}, "--fragments 2"),
                           ({"overlap_steps": 1}, "--overlap-steps 1"), ({"compress": "int8"}, "--compress int8")]:
        setting = resize_setting(small_config("unused", algorithm="diloco", **settings))
        assert setting == flag
        check_worker_count(round_end, "diloco", 4, setting=setting)
        with pytest.raises(CheckpointError, match=f"--algorithm diloco with {flag} cannot change the number of "
                                                  "workers on resume .*diloco with one fragment, no overlap"):
            check_worker_count(round_end, "diloco", 3, setting=setting)
    for algorithm in ("dpsgd", "d2", "ps", "adpsgd", "prague"):
        check_worker_count(state, algorithm, 4)
        with pytest.raises(CheckpointError, match=f"--algorithm {algorithm} cannot change the number of workers"):
            check_worker_count(state, algorithm, 3)
    with pytest.raises(CheckpointError, match="--workers-per-node"):
        check_worker_count(state, "allreduce", 2, workers_per_node=2)
    with pytest.raises(CheckpointError, match="--dataset shards"):
        check_worker_count(state, "allreduce", 2, dataset="shards")
    assert epoch_workers(None, 3) == 3 and epoch_workers(state, 3) == 4
    assert epoch_workers({"world_size": 3, "epoch_workers": 4}, 2) == 4
