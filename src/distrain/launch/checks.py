"""What every launcher checks before any worker starts: the data fits the workers and the
batch, and a resumed run's checkpoint exists, is intact and was written by this job (or the run
is already finished)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from distrain.config import TrainConfig
from distrain.errors import ConfigError, DataError
from distrain.tasks import check_task_data


def preflight(cfg: TrainConfig, train_set: Any = None) -> None:
    """Check what can be checked before any worker starts; warms the data cache on the way."""
    from distrain.data import labels_of, load_dataset, partition_indices

    check_task_data(cfg.data.task_name(), train_set)
    if train_set is None and cfg.data.dataset == "shards":
        return  # workers read their own shard files; they check them
    if train_set is None:
        d = cfg.data
        train_set, _ = load_dataset(d.dataset, path=d.data_path, num_samples=d.num_samples, seed=cfg.run.seed,
                                    context=d.context, tokenizer=d.tokenizer)
    n, world = len(train_set), cfg.cluster.workers
    if n == 0:
        raise DataError("the training set is empty")
    if world > n:
        raise ConfigError("--workers", f"must be at most the number of training samples ({n}), got {world}")
    labels = labels_of(train_set) if cfg.data.partition != "iid" else [0] * n
    parts = partition_indices(labels, world, cfg.data.partition, alpha=cfg.data.dirichlet_alpha, seed=cfg.run.seed)
    smallest = min(range(world), key=lambda r: len(parts[r]))
    if len(parts[smallest]) < cfg.data.batch_size:
        raise ConfigError("--batch-size", f"worker {smallest}'s shard has {len(parts[smallest])} samples, fewer than one batch of {cfg.data.batch_size}")


def check_resume(cfg: TrainConfig, run_dir: Path, nprocs: int) -> dict[str, Any] | None:
    """The checkpoint --resume points at exists, is intact, and was written by this model and
    algorithm, and by this number of workers unless the algorithm can change it (rank 0's file,
    or its first member's, stands for the set); returns its state, or None when the run starts
    afresh (refused where that would replace a run that ended: ``refuse_fresh_over_ended_run``)."""
    from distrain.runtime.checkpoint import CheckpointStore, check_compatible
    from distrain.train.resume import (
        check_worker_count,
        refuse_fresh_over_ended_run,
        resize_setting,
        resume_point,
        shape_settings,
    )

    store = CheckpointStore(run_dir, 0, nprocs)
    step = resume_point(store, cfg.run.resume, cfg.cluster.workers, cfg.algo.algorithm)
    if step is None:
        refuse_fresh_over_ended_run(run_dir, cfg.run.resume)
        return None
    state = store.load(step, store.source(step))
    check_compatible(state, model=cfg.model.model, algorithm=cfg.algo.algorithm, shape=shape_settings(cfg))
    check_worker_count(state, cfg.algo.algorithm, cfg.cluster.workers, workers_per_node=cfg.algo.workers_per_node,
                       dataset=cfg.data.dataset, setting=resize_setting(cfg))
    return state


def finished_before_start(cfg: TrainConfig, run_dir: Path, nprocs: int) -> dict[str, Any] | None:
    """The recorded result of a run resumed with nothing left to train (no worker need start;
    see :func:`distrain.train.resume.already_finished`), else None."""
    from distrain.errors import CheckpointError
    from distrain.runtime.checkpoint import CheckpointStore, finished_for, planned_steps
    from distrain.train.resume import (
        BUDGET_DONE_KEY,
        already_finished,
        nothing_left,
        stopped_at_this_target,
        time_budget,
    )

    state = check_resume(cfg, run_dir, nprocs)
    if state is None:
        return None
    if BUDGET_DONE_KEY in state:  # asynchronous: whether its budget was used up (the workers decide alike)
        total = planned_steps(cfg.run.epochs, int(state["steps_per_epoch"]))
        done = nothing_left(state, total, time_budget(cfg))
    else:
        done = finished_for(state, cfg.run.epochs)
    if done or stopped_at_this_target(state, cfg):
        return already_finished(run_dir, state)
    if cfg.algo.algorithm == "ps" and cfg.ps.ps_mode == "async":
        store = CheckpointStore(run_dir, 0, nprocs)
        step = int(state["step"])
        if any(r not in store.members(step) for r in range(cfg.cluster.workers, nprocs)):
            raise CheckpointError(f"checkpoint of step {step} was saved while asynchronous servers held a lost server's "
                                  "parameters, which they cannot resume from; name an earlier set with --resume STEP")
    return None
