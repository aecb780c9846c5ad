"""The worker loop: the same code on one CPU process, local spawn, or torchrun.

Read it top to bottom: set up data, model, optimizer, algorithm; then per step forward,
backward, let the algorithm aggregate, update, let the algorithm average; evaluate every
``--eval-every`` epochs; checkpoint every ``--checkpoint-every`` steps; gather a summary.

The process group must already exist (launchers create it; see ``distrain.launch``)::

    # one machine, 4 workers, spawned by distrain itself
    distrain train --workers 4
    # one machine under torchrun
    torchrun --nproc-per-node 4 -m distrain train
    # two machines, 2 workers each (run on both, --node-rank 0 and 1)
    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 -m distrain train
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from distrain.algorithms import ALGORITHMS
from distrain.algorithms.gossip import GOSSIP_COUNTS
from distrain.comm.transport import Transport, blocked_seconds
from distrain.config import TrainConfig
from distrain.data import (
    batches_of,
    labels_of,
    load_dataset,
    load_shard_dir_test,
    load_worker_shards,
    partition_indices,
)
from distrain.data.sampler import DataPlan, ShardSampler
from distrain.distributed import DistributedOptimizer
from distrain.emulation import NetworkSettings
from distrain.errors import CheckpointError, ConfigError, DataError, Interrupted
from distrain.models import build_model, count_parameters
from distrain.optim.optimizers import build_optimizer
from distrain.optim.schedule import LRSchedule, scaled_lr
from distrain.runtime.checkpoint import (
    MEMBERS_KEY,
    SET_SIZE_KEY,
    SHAPE_KEY,
    CheckpointStore,
    check_compatible,
    epoch_steps,
    planned_steps,
)
from distrain.runtime.faults import (
    FaultWatch,
    NonFinite,
    injected_nan,
    maybe_injected_kill,
    nonfinite_error,
    store_client,
)
from distrain.runtime.files import atomic_write
from distrain.runtime.membership import JOIN_ENV, Membership, RunEnded, enter_run, watch_waits
from distrain.runtime.totals import RunTotals
from distrain.tasks import LossFn, Task, bits_per_byte, build_task, check_task_data
from distrain.train.evaluation import EvalTime, Evaluations
from distrain.train.metrics import (
    MetricsWriter,
    parse_record,
    write_json_atomic,
    write_summary,
)
from distrain.train.resume import (
    BUDGET_DONE_KEY,
    CHANGED_KEY,
    EPOCH_WORKERS_KEY,
    STOPPED_AT_TARGET_KEY,
    already_finished,
    changes_on_resume,
    check_epoch_length,
    check_worker_count,
    describe_extension,
    epoch_workers,
    nothing_left,
    refuse_fresh_over_ended_run,
    resize_setting,
    resume_point,
    rng_state,
    run_target,
    saved_workers,
    set_rng_state,
    shape_settings,
    stopped_at_this_target,
    time_budget,
)

log = logging.getLogger(__name__)

ModelFactory = Callable[[], torch.nn.Module]


def worker_data(cfg: TrainConfig, rank: int, world: int, train_set: Dataset | None,
                test_set: Dataset | None) -> tuple[Dataset, np.ndarray, list[np.ndarray] | None, Dataset]:
    """This worker's view of the data: the training set, its shard's indices, every worker's
    shard (None for shard files: each worker reads its own, all of its set), the test set."""
    d = cfg.data
    check_task_data(d.task_name(), train_set)
    if train_set is None and d.dataset == "shards":
        # Shard files on shared storage: each worker reads only the files it owns.
        own = load_worker_shards(d.data_path, rank, world)
        return own, np.arange(len(own)), None, load_shard_dir_test(d.data_path)
    if train_set is None:
        train_set, test_set = load_dataset(d.dataset, path=d.data_path, num_samples=d.num_samples, seed=cfg.run.seed,
                                           context=d.context, tokenizer=d.tokenizer)
    if test_set is None:
        raise DataError("a test set is required to evaluate the model")
    n = len(train_set)  # type: ignore[arg-type]
    if n == 0:
        raise DataError("the training set is empty")
    if world > n:
        raise ConfigError("--workers", f"must be at most the number of training samples ({n}), got {world}")
    shards = split(cfg, train_set, world)
    return train_set, shards[rank], shards, test_set


def split(cfg: TrainConfig, train_set: Dataset, workers: int) -> list[np.ndarray]:
    """Every worker's shard of ``train_set`` (indices): ``--partition`` iid or dirichlet, seeded."""
    d = cfg.data
    n = len(train_set)  # type: ignore[arg-type]
    labels = labels_of(train_set) if d.partition != "iid" else np.zeros(n, dtype=np.int64)
    return partition_indices(labels, workers, d.partition, alpha=d.dirichlet_alpha, seed=cfg.run.seed)


def lr_schedule(cfg: TrainConfig, workers: int, warmup_steps: int, total_steps: int,
                local_steps: bool | None = None) -> tuple[LRSchedule, int]:
    """The learning-rate schedule for ``workers`` workers, with warm-up and decay, and their
    global batch. The linear scaling rule applies to the samples of one optimizer step: the
    global batch, or one worker's batch where the optimizer steps on each worker's own gradients
    before any averaging (``local_steps``; by default the algorithm's, e.g. DiLoCo's inner steps)."""
    o = cfg.optim
    global_batch = workers * cfg.data.batch_size
    if local_steps is None:
        local_steps = ALGORITHMS[cfg.algo.algorithm].local_steps
    step_batch = cfg.data.batch_size if local_steps else global_batch
    peak = scaled_lr(o.lr, step_batch, o.reference_batch, enabled=o.lr_scaling)
    return LRSchedule(peak_lr=peak, base_lr=min(o.lr, peak), warmup_steps=warmup_steps, total_steps=total_steps,
                      decay=o.lr_decay), global_batch


def control_all_gather(tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    """Gather a small bookkeeping tensor from every member of ``group`` (not training traffic)."""
    outputs = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(outputs, tensor, group=group)
    return outputs


class WorkerData(NamedTuple):
    train_set: Dataset
    test_set: Dataset
    num_classes: int
    shards: list[dict[str, Any]]  # every worker's shard size and label histogram
    steps_per_epoch: int
    total_steps: int
    sampler: ShardSampler


def plan_worker_data(cfg: TrainConfig, rank: int, world: int, train_set: Dataset | None, test_set: Dataset | None,
                     group: Any = None, task: Task | None = None, collective: bool = True) -> WorkerData:
    """This worker's shard and the run's length: ConfigError naming ``--batch-size`` if some
    worker's shard is smaller than one batch.

    Every worker holds the training set and splits it the same way, so each knows every shard
    without a word to the others: a worker lost while the others load their data is then lost
    to the elastic run, not to a collective that no member could recover from. Shard files
    (each worker reads its own) are reported over ``group`` (collective); not ``collective`` (a
    worker joining a running job), every shard is taken to be this one's size."""
    train_set, shard, every, test_set = worker_data(cfg, rank, world, train_set, test_set)
    labelled = task is None or task.labels
    if getattr(train_set, "num_classes", None) is not None and not labelled:  # a vocabulary (text)
        num_classes = int(train_set.num_classes)  # type: ignore[attr-defined]
    elif labelled:
        num_classes = int(max(labels_of(test_set).max(), labels_of(train_set).max())) + 1
    else:  # regression: the model's outputs are the target's values
        target = batches_of(train_set, torch.tensor([0]), classes=False)[1]
        num_classes = int(target[0].numel())
    if every is not None:
        shards = [shard_row(r, train_set, s, num_classes if labelled else 0) for r, s in enumerate(every)]
    elif collective:
        shards = shard_report(train_set, shard, num_classes if labelled else 0, group)
    else:
        shards = [{"rank": r, "size": len(shard), "label_histogram": []} for r in range(world)]
    if min(s["size"] for s in shards) < cfg.data.batch_size:
        small = min(shards, key=lambda s: s["size"])
        raise ConfigError("--batch-size", f"worker {small['rank']}'s shard has {small['size']} samples, fewer than one batch of {cfg.data.batch_size}")
    total_train = sum(s["size"] for s in shards)
    steps_per_epoch = epoch_steps(total_train, world, cfg.data.batch_size)
    total_steps = planned_steps(cfg.run.epochs, steps_per_epoch)
    sampler = ShardSampler(shard, cfg.data.batch_size, cfg.run.seed, rank)
    return WorkerData(train_set, test_set, num_classes, shards, steps_per_epoch, total_steps, sampler)


def shard_row(rank: int, dataset: Dataset, shard: np.ndarray, num_classes: int) -> dict[str, Any]:
    """Worker ``rank``'s shard of ``dataset``: its size and label histogram (``num_classes`` 0:
    no labels, an empty histogram)."""
    labels = labels_of(dataset)[shard] if len(shard) and num_classes else np.zeros(0, dtype=np.int64)
    return {"rank": rank, "size": len(shard),
            "label_histogram": [int(v) for v in np.bincount(labels, minlength=num_classes)[:num_classes]]}


def shard_report(dataset: Dataset, shard: np.ndarray, num_classes: int, group: Any = None) -> list[dict[str, Any]]:
    """Every worker's :func:`shard_row`, gathered where each worker knows only its own (shard
    files)."""
    mine = shard_row(0, dataset, shard, num_classes)
    rows = control_all_gather(torch.tensor([mine["size"], *mine["label_histogram"]], dtype=torch.int64), group)
    return [{"rank": r, "size": int(row[0]), "label_histogram": [int(v) for v in row[1:]]} for r, row in enumerate(rows)]


def train(cfg: TrainConfig, run_dir: str | Path, *, model_fn: ModelFactory | None = None,
          train_set: Dataset | None = None, test_set: Dataset | None = None, loss_fn: LossFn | None = None,
          workers_group: Any = None) -> dict[str, Any] | None:
    """Run the training loop on this worker; returns the summary on rank 0, None elsewhere.

    ``workers_group`` is the group of training workers when the world also holds other
    processes (parameter servers); None when every process is a worker.

    Raises :class:`~distrain.errors.Interrupted` after a SIGTERM / Ctrl-C (every worker
    stopped at the same step and saved a checkpoint), and ``WorkerFailure`` in one line naming
    the step and the cause when a peer is lost or a value is not finite.
    """
    # A worker started again after its loss (--max-restarts) joins the others at a step's end,
    # once its data and model are ready.
    joining = bool(os.environ.get(JOIN_ENV)) and not dist.is_initialized()
    rank = int(os.environ.get("RANK", "0")) if joining else dist.get_rank()
    watch = FaultWatch(rank, world=cfg.cluster.workers if joining else None, timeout=cfg.cluster.timeout)
    task = build_task(cfg.data.task_name(), loss_fn)
    return watch.run(_train, cfg, Path(run_dir), watch, model_fn, train_set, test_set, task, workers_group, joining)


def _train(cfg: TrainConfig, run_dir: Path, watch: FaultWatch, model_fn: ModelFactory | None,
           train_set: Dataset | None, test_set: Dataset | None, task: Task, workers_group: Any,
           joining: bool = False) -> dict[str, Any] | None:
    torch.set_num_threads(cfg.run.threads)
    # world: training workers only; a worker that joins keeps its id as its rank here
    rank, world = (watch.rank, cfg.cluster.workers) if joining else (dist.get_rank(), dist.get_world_size(workers_group))
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.cluster.device == "cuda" else torch.device("cpu")

    # --- data: each worker trains on its own shard ----------------------------------------------
    train_set, test_set, num_classes, shards, steps_per_epoch, total_steps, sampler = plan_worker_data(
        cfg, rank, world, train_set, test_set, workers_group, task, collective=not joining)

    # --- resume: the checkpoint this worker continues from, if any ------------------------------
    servers = cfg.ps.servers if cfg.algo.algorithm == "ps" else 0
    store = CheckpointStore(run_dir, rank, world + servers if joining else dist.get_world_size())  # servers save their shards too
    # a joiner takes live state
    resume_step = (None if joining else
                   resume_point(store, cfg.run.resume, world, cfg.algo.algorithm, warn=rank == 0))
    if resume_step is None and not joining:  # (the launchers check it first; torchrun's workers here)
        refuse_fresh_over_ended_run(run_dir, cfg.run.resume)
    # A worker lost before that checkpoint has no file in it: it starts from a member's, as one
    # that joins a running job takes a member's state.
    source = store.source(resume_step) if resume_step is not None else None
    state = store.load(resume_step, source) if resume_step is not None else None
    # Another number of workers than wrote the checkpoint (--workers, torchrun's WORLD_SIZE): the
    # run goes on as after a change of its members at the checkpoint's step, with the length in
    # steps its first workers planned (an elastic run that lost a worker keeps it too).
    saved_world = saved_workers(state, world) if state is not None else world
    resized = saved_world != world
    first_world = epoch_workers(state, world)
    if joining:  # the members may keep the length their run's first workers planned (a resized resume)
        first_world, recorded = recorded_epochs(run_dir, world)
        if first_world != world and recorded:
            steps_per_epoch = recorded
            total_steps = planned_steps(cfg.run.epochs, steps_per_epoch)
    if state is not None:
        check_compatible(state, model=cfg.model.model, algorithm=cfg.algo.algorithm, shape=shape_settings(cfg))
        check_worker_count(state, cfg.algo.algorithm, world, workers_per_node=cfg.algo.workers_per_node,
                           dataset=cfg.data.dataset, setting=resize_setting(cfg))
        if first_world != world:  # the length its first workers planned: from their split (which may drop
            # other remainders than this world's: 12,800 samples in 3 shards are 12,798)
            planned = sum(len(s) for s in split(cfg, train_set, first_world))
            steps_per_epoch = epoch_steps(planned, first_world, cfg.data.batch_size)
            total_steps = planned_steps(cfg.run.epochs, steps_per_epoch)
        check_epoch_length(state, steps_per_epoch)
        if nothing_left(state, total_steps, time_budget(cfg)) or stopped_at_this_target(state, cfg):  # touch nothing
            return already_finished(run_dir, state) if rank == 0 else None

    # --- model: identical initial parameters on every worker ------------------------------------
    torch.manual_seed(cfg.run.seed)
    sample_shape = tuple(batches_of(train_set, torch.tensor([0]), classes=task.classes)[0].shape[1:])
    if model_fn is not None:
        model = model_fn()
    else:
        model = build_model(cfg.model.model, sample_shape, num_classes, width=cfg.model.model_width,
                            depth=cfg.model.model_depth, size=cfg.model.model_size)
    model.to(device)
    torch.manual_seed(cfg.run.seed + rank)

    # --- optimizer and learning rate: linear scaling rule with warm-up --------------------------
    o = cfg.optim
    schedule, global_batch = lr_schedule(cfg, world, round(o.warmup_epochs * steps_per_epoch), total_steps)
    peak = schedule.peak_lr
    optimizer = build_optimizer(o.optimizer, model.parameters(), lr=peak, momentum=o.momentum, weight_decay=o.weight_decay)
    joined: Membership | None = None
    if joining:
        try:
            joined = enter_run(cfg, stamp=False)  # (the watch's heartbeat stamps from its start)
        except RunEnded as exc:
            log.warning("%s; it leaves", exc)
            return None
        watch.store = store_client()
    # The same object a user's own loop gets from distrain.wrap(): it runs the algorithm around
    # each optimizer step. Every worker built the same model from the same seed: no broadcast.
    opt = DistributedOptimizer(model, optimizer, cfg, total_steps=total_steps, steps_per_epoch=steps_per_epoch,
                               workers_group=workers_group, broadcast=False, heartbeat=False, joined=joined)
    algorithm, transport = opt.algorithm, opt.transport

    # --- resume: the state of every part, and what the earlier segments did ---------------------
    start_step = 0
    totals = RunTotals.from_state(state.get("totals") if state is not None else None)
    resumed: list[dict[str, Any]] = []  # workers back in the run that had been lost before its checkpoint
    if state is not None:
        try:
            model.load_state_dict(state["model"])
        except RuntimeError as exc:  # PyTorch lists every mismatched tensor: one of them is enough
            raise CheckpointError(f"checkpoint of step {state['step']} holds a model of other shapes than this "
                                  f"run's (another --model-width, --model-depth, --model-size or data set?): "
                                  f"{str(exc).strip().splitlines()[-1].strip()}") from None
        optimizer.load_state_dict(state["optimizer"])
        start_step = int(state["step"])  # asynchronous: this worker's own steps (its set's differ)
        if source == rank and not resized:
            algorithm.load_state_dict(state["algorithm"])
            if "rng" in state:
                set_rng_state(state["rng"])
            log.info("worker %d resumed from step %d", rank, start_step)
        else:  # its own error-feedback residuals (and random streams) start afresh
            algorithm.load_state_dict({k: v for k, v in state["algorithm"].items() if k not in algorithm.own_state})
            if source != rank:
                totals = totals.for_another_worker()
            if resized:
                totals = totals.resized(transport.world_size, rank)
                if rank == 0:
                    log.warning("the checkpoint of step %d was written by %d workers; %d go on from it (the rest "
                                "of its epoch dealt out over them%s)", start_step, saved_world, world,
                                ", the learning rate scaled to their global batch" if algorithm.rescales_lr else "")
            else:
                log.warning("worker %d was lost before the checkpoint of step %d; it resumes from worker %d's state",
                            rank, start_step, source)
        opt.resume_at(start_step)  # (workers lost as it resumed were lost at the checkpoint's step)
        before = store.members(resume_step)
        back = [w for w in range(world) if w not in before]
        if resized:
            resumed.append({"event": "resized", "workers_before": saved_world, "members": list(range(world)),
                            "left": [w for w in before if w >= world], "joined": back, "resized_at_step": start_step,
                            "unix_time": time.time(), "recovery_s": 0.0, "from_checkpoint": True})
        elif back:
            resumed.append({"event": "joined", "workers": back, "members": list(range(world)),
                            "joined_at_step": start_step, "unix_time": time.time(), "recovery_s": 0.0,
                            "from_checkpoint": True})
        if rank == 0 and int(state.get("total_steps", total_steps)) != total_steps:
            log.warning(describe_extension(state, schedule))
    # After a change of members: every member's samples (the rest of the epoch it interrupted
    # first), saved with the checkpoints; those back from a checkpoint start on their shard.
    plan = None
    if state is not None and (PLAN_KEY in state or resized):
        plan = (plan_of(cfg, train_set, state[PLAN_KEY]) if PLAN_KEY in state
                else DataPlan.first(split(cfg, train_set, saved_world), cfg.data.batch_size, cfg.run.seed))
        if back or resized:
            plan = plan.changed(list(range(world)), start_step, {}, split(cfg, train_set, world))
        sampler = plan.samplers[rank]

    earlier = totals.offsets(len(opt.peer_traffic()[0]))  # for the metrics lines (peers: the run's, lost ones too)
    if joined is None and opt.changes:  # workers lost as the run started or resumed (wrap() went on without them)
        plan = replan(cfg, opt, train_set, plan, opt.changes, start_step, world)
        sampler, schedule, global_batch = regroup(cfg, opt, train_set, schedule, plan, sampler)
    if joined is not None:  # where the others are: their step, data split and learning rate
        start_step = opt.steps
        if opt.algorithm.common_steps and cfg.data.dataset != "shards":  # the members' plan, from the store
            # (published at its admission's epoch; losses that interrupted the admission follow it)
            at = next(i for i, c in enumerate(opt.changes) if opt.id in c.joined)
            plan = plan_of(cfg, train_set, read_plan(joined, opt.changes[at].epoch))
            plan = replan(cfg, opt, train_set, plan, opt.changes[at + 1 :], start_step, world)
        sampler, schedule, global_batch = regroup(cfg, opt, train_set, schedule, plan, sampler)
    if leads(algorithm, transport) and joined is None:  # (rank 0, or the first survivor of a loss as it started)
        changed = changes_on_resume(run_dir, cfg, start_step) if state is not None else []
        write_json_atomic(run_dir / "config.json", {
            **cfg.to_dict(), "world_size": world, "steps_per_epoch": steps_per_epoch, "total_steps": total_steps,
            EPOCH_WORKERS_KEY: first_world,
            "global_batch": global_batch, "peak_lr": peak, "shards": shards, "resumed_from_step": resume_step,
            "algorithm_info": algorithm.info(), "network_bits_per_s": NetworkSettings.from_config(cfg.network).bits_per_s(),
            "model_parameters": count_parameters(model), **({CHANGED_KEY: changed} if changed else {}),
        })

    def counters(step: int, wall: float | None = None, cpu: float | None = None) -> list[float]:
        """This segment's counters row at ``step`` (see :func:`summarize`); wall and CPU time now
        unless given."""
        done = step - start_step
        sent, received, _ = opt.peer_traffic()
        wall = time.perf_counter() - start - eval_time.seconds(refresh=True) if wall is None else wall
        cpu = time.process_time() - cpu_start if cpu is None else cpu
        return [done, done * cfg.data.batch_size, wall, compute_seconds, exposed_seconds, *sent, *received, cpu]

    def save(step: int, wall: float | None = None, cpu: float | None = None, *, label: int | None = None,
             algorithm_state: dict[str, Any] | None = None, members: list[int] | None = None) -> None:
        """This worker's file of the set of step ``label`` (default ``step``, this worker's
        steps; the final set of an asynchronous run, whose workers end at different steps, has a
        common label); ``members``: the workers that write the set, if not those of ``opt.ids``."""
        # The run's length and counters go with the state: a resumed run checks the first, and
        # its summary.json adds the second to its own.
        members = sorted(opt.ids) if members is None else members
        store.save(step if label is None else label, {
            "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "algorithm": algorithm.state_dict() if algorithm_state is None else algorithm_state,
            "step": step, "model_name": cfg.model.model, "algorithm_name": cfg.algo.algorithm, "world_size": world,
            SHAPE_KEY: shape_settings(cfg),
            "epochs": cfg.run.epochs, "steps_per_epoch": steps_per_epoch, "total_steps": total_steps, "rng": rng_state(),
            SET_SIZE_KEY: store.world_size, **({EPOCH_WORKERS_KEY: first_world} if first_world != world else {}),
            "totals": totals.plus(counters(step, wall, cpu), eval_time.seconds(), evals.time_to_target, records(),
                                  lost(), algorithm.lost_servers, algorithm.returned_servers).state_dict(),
            **({PLAN_KEY: plan.state()} if plan is not None else {}),
            # after a loss the set is written by the members at this step (and any servers)
            **({MEMBERS_KEY: [*members, *range(world, store.world_size)]} if members != list(range(world)) else {}),
            # asynchronous: whether the budget is used up (the set's step does not say)
            **({} if algorithm.synchronous else {BUDGET_DONE_KEY: algorithm_state is not None and stop_at is None}),
            **({STOPPED_AT_TARGET_KEY: run_target(cfg)} if stopped_at_target else {}),
        })

    def records() -> list[dict[str, Any]]:
        """This segment's membership changes, for summary.json (the earlier segments' are in totals)."""
        return [*resumed, *(c.record() for c in opt.changes)]

    def lost() -> dict[int, float]:
        """Workers this segment lost (id -> when declared dead)."""
        return {**algorithm.lost_workers, **{m: c.at for c in opt.changes for m in c.lost}}

    # --- the loop -------------------------------------------------------------------------------
    # a joiner keeps its earlier life's lines up to where it comes back
    metrics = MetricsWriter(run_dir, rank, resume_step=resume_step if joined is None else start_step)
    eval_interval = max(1, round(cfg.run.eval_every * steps_per_epoch))

    def evaluates_after(done: int) -> bool:
        """Whether the workers evaluate together after ``done`` steps of a run that goes on
        (synchronous algorithms; asynchronous ones evaluate only at their end)."""
        return algorithm.synchronous and done % eval_interval == 0

    evals = Evaluations(task, test_set, cfg.run.eval_samples, cfg.run.target_accuracy, cfg.run.target_loss, device)
    totals = retarget(totals, cfg, run_dir, evals, resume_step)
    progress = _progress_bar(cfg, rank, total_steps, start_step)
    compute_seconds = exposed_seconds = busy_before = 0.0
    params = [p for p in model.parameters() if p.requires_grad]
    skip_nonfinite = cfg.run.on_nonfinite == "skip"
    tokens_per_sample = lm_tokens(task, sample_shape)
    stop_at: int | None = None  # after a SIGTERM / Ctrl-C: the step every worker stops at
    stopped_at_target = False  # --stop-at-target: the run ended at the evaluation that reached it
    final_model: torch.nn.Module | None = None  # what the last evaluation measured (the consensus, if decentralized)
    final_time = 0.0  # and when (the run's seconds)
    measured_final = False  # whether this worker measured it (the first of the workers, or a survivor of it)
    changes: list[Any] = list(opt.changes)  # membership changes handled so far (elastic runs)
    for record in [*resumed, *(change.record() for change in changes)]:  # a joiner's own entry
        metrics.write({"step": start_step, **record})

    def follow_changes() -> None:
        """After workers were lost or joined (elastic runs): the new group's objects, the data split
        again, the learning rate scaled, the events in metrics, and where this worker stands (a
        survivor behind one that finished its step or round, or a decentralized one realigned)."""
        nonlocal algorithm, transport, step, sampler, schedule, global_batch, changes, plan
        if len(opt.changes) == len(changes):
            return
        algorithm, transport = opt.algorithm, opt.transport
        step = opt.steps - 1
        if cfg.data.dataset != "shards":  # (shard files: each worker reads its own only)
            plan = replan(cfg, opt, train_set, plan, opt.changes[len(changes):], opt.steps, world)
        sampler, schedule, global_batch = regroup(cfg, opt, train_set, schedule, plan, sampler)
        for change in opt.changes[len(changes):]:
            metrics.write({"step": step + 1, **change.record()})
        changes = list(opt.changes)

    model.train()
    opt.start()  # together: emulated bandwidth traces and asynchronous algorithms' clocks start now
    start, cpu_start = time.perf_counter(), time.process_time()
    eval_time = EvalTime(opt.membership.store if opt.membership is not None else None, algorithm.synchronous)
    # Asynchronous algorithms (AD-PSGD, Prague) decide when a worker stops (its own budget; faster
    # workers take more steps), evaluate only at the end, and give the consensus over time after it.
    step = start_step
    running = algorithm.keep_going(step, total_steps)
    if joined is not None and running and evaluates_after(start_step):
        # The members evaluate after the step they admitted this worker at, over the group with it
        # in it: the consensus (decentralized algorithms) and the target's flags are collective, so
        # it takes part (else each waited for the other, the members there, this worker in its
        # first exchange, until the group's timeout, and they recovered with nobody lost).
        opt.eval_model()
        if cfg.run.stop_at_target and reached_anywhere(opt, False):
            running, stopped_at_target = False, True
    if joined is not None and cfg.run.checkpoint_every and start_step % cfg.run.checkpoint_every == 0:
        save(start_step, 0.0, 0.0)  # the members saved this step with this worker among them
    while running:
        watch.step = step
        maybe_injected_kill(rank, step)  # fault injection for tests (environment variables)
        t0, blocked_at_start = time.perf_counter(), blocked_seconds()
        x, y = batches_of(train_set, sampler.batch(step), classes=task.classes)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        losses = task.losses(model(x), y)
        if injected_nan(rank, step):
            losses = losses * float("nan")
        loss = losses.mean()
        optimizer.zero_grad(set_to_none=False)
        # Non-finite values are caught before anything leaves this worker: the loss before
        # backward (all-reduce sends from gradient hooks), the gradients before after_backward
        # (or, for algorithms that send during backward, by them, bucket by bucket).
        loss_value = loss.item()  # the one read of the loss this step: the check and the metrics line
        finite = math.isfinite(loss_value)
        if not finite and not skip_nonfinite:
            raise nonfinite_error(rank, step, "loss")
        try:
            if finite:
                loss.backward()
            else:
                (sum(p.sum() for p in params) * 0.0).backward()  # skip: zero gradients, still sent
        except NonFinite as exc:
            raise nonfinite_error(rank, step, exc.what) from None
        if not finite:
            losses = torch.zeros_like(losses)
            log.warning("worker %d: non-finite loss at step %d; its gradient is dropped", rank, step)
        lr = schedule.apply(optimizer, algorithm.schedule_step(step))
        # Aggregate, update, average; a non-finite gradient stops here, or is dropped (skip). An
        # emulated slow worker's compute is stretched here; compute time leaves out network waits.
        opt.step(losses=losses.detach())
        follow_changes()
        if opt.skipped:
            finite, losses = False, torch.zeros_like(losses)
        compute_seconds += opt.last_compute_seconds
        exposed = blocked_seconds() - blocked_at_start
        exposed_seconds += exposed
        step_seconds = time.perf_counter() - t0
        if watch.stop.requested.is_set() and stop_at is None:  # SIGTERM / Ctrl-C: stop together, soon
            stop_at = watch.agreed_step(step, algorithm.synchronous)
            algorithm.request_stop()
        running = algorithm.keep_going(step + 1, total_steps)  # asynchronous: the last one waits for the others
        running = running and (stop_at is None or step + 1 < stop_at)

        sent, received, busy = opt.peer_traffic()
        record: dict[str, Any] = {  # see distrain.train.metrics for each field's meaning and unit
            "step": step + 1, "epoch": (step + 1) / steps_per_epoch, "time": earlier.wall + time.perf_counter() - start - eval_time.seconds(),
            "loss": loss_value if finite else float("nan"), "lr": lr, "bytes_sent": earlier.sent + sum(sent),
            "bytes_received": earlier.received + sum(received), "compute_s": opt.last_compute_seconds,
            "step_s": step_seconds, "exposed_comm_s": exposed, "comm_busy_s": busy - busy_before,
            "loss_quantiles": loss_quantiles(losses),
        }
        busy_before = busy
        if not running or evaluates_after(step + 1):
            t_eval, during, measured = time.perf_counter(), running, False
            eval_model = opt.eval_model()  # collective for decentralized algorithms
            follow_changes()  # a loss found there: the survivors' average is what is evaluated
            if not running:
                final_model, final_time = eval_model, record["time"]
            if leads(algorithm, transport):
                measured = True  # the others wait for this evaluation (synchronous algorithms)
                evals.measure(eval_model, record, final=not running)
                measured_final = not running
                if tokens_per_sample is not None and algorithm.synchronous and record["time"] > 0:
                    record["tokens_per_s"] = (step + 1) * global_batch * tokens_per_sample / record["time"]
                if not running:  # the trained (consensus) model, for distrain.fit and the user
                    save_model(run_dir / MODEL_FILE, eval_model)
                if progress is not None:
                    shown = ({"acc": f"{evals.accuracy:.3f}"} if evals.accuracy is not None
                             else {"test_loss": f"{evals.test_loss:.4g}"})
                    progress.set_postfix(loss=f"{record['loss']:.3f}", **shown)
            if running and cfg.run.stop_at_target and reached_anywhere(opt, evals.time_to_target is not None):
                running, stopped_at_target = False, True  # every worker ends after this step
                if leads(algorithm, transport):
                    evals.stopped_at_target(eval_model, record)
                    save_model(run_dir / MODEL_FILE, eval_model)
            eval_time.add(time.perf_counter() - t_eval, during=during, measured=measured)
        if not finite:
            record["skipped"] = True
        record.update(algorithm.metrics())  # after evaluation: includes what eval_model() measured
        metrics.write(record)
        if progress is not None:
            progress.update(1)
        if cfg.run.checkpoint_every and (step + 1) % cfg.run.checkpoint_every == 0:
            save(step + 1)
        step += 1
    opt.end()  # parameter servers: this worker's training is over
    for change in opt.changes[len(changes):]:  # asynchronous gossip: workers that joined while it drained
        metrics.write({"step": step, **change.record()})
    if opt.membership is not None:
        opt.membership.close()  # a worker started again from now on finds the run over
    wall = time.perf_counter() - start - eval_time.seconds(refresh=True)
    cpu = time.process_time() - cpu_start  # every thread of this process: the gossip's and the backend's too
    if progress is not None:
        progress.close()
    # Asynchronous algorithms: the consensus at points during the run (from copies every worker
    # took then), evaluated only now, so that nobody paused for it.
    for point, eval_model in algorithm.consensus_history():  # collective
        if leads(algorithm, transport):
            metrics.write({**point, **evals.snapshot(eval_model, point["time"]), "snapshot": True})
    metrics.close()
    if not algorithm.synchronous:  # (collective) the workers' exact steps; the set's label is the largest
        final = algorithm.final_state()  # type: ignore[attr-defined]
        ctl = algorithm.control_transport() or transport
        finishers = sorted(ctl.global_rank(i) for i in range(ctl.world_size)) if ctl.world_size > 1 else [rank]
        save(step, wall, cpu, label=max(final[GOSSIP_COUNTS][i] for i in finishers), algorithm_state=final,
             members=finishers)
    elif step > start_step and not (cfg.run.checkpoint_every and step % cfg.run.checkpoint_every == 0):
        save(step, wall, cpu)
    opt.close()

    # --- summary: every process's counters (servers too), over every segment, gathered on rank 0 --
    def run_totals() -> RunTotals:
        """Every segment's totals with this one's, as far as they are known now."""
        return totals.plus(counters(step, wall, cpu), eval_time.seconds(), evals.time_to_target, records(), lost(),
                           algorithm.lost_servers, algorithm.returned_servers)

    run = run_totals()
    mine = torch.tensor(run.row, dtype=torch.float64)
    elastic = opt.membership is not None
    rows = [[0.0] * len(mine) for _ in range(world if elastic else transport.world_size)]  # lost: zeros
    control = algorithm.control_transport() or transport  # the survivors, if workers were lost
    if elastic:  # the members' rows, by worker id
        for i, row in enumerate(opt.control_all_gather(mine)):
            rows[opt.ids[i]] = row.tolist()
        algorithm, transport = opt.algorithm, opt.transport  # a loss on the way rebuilt them
    else:
        for i, row in enumerate(control.control_all_gather(mine)):
            rows[control.global_rank(i)] = row.tolist()

    def summary_of_leader() -> dict[str, Any] | None:
        nonlocal measured_final, run
        if not leads(algorithm, transport):
            return None
        if not measured_final and final_model is not None:  # the first worker was lost as the run ended
            evals.measure(final_model, {"time": final_time}, final=True)
            save_model(run_dir / MODEL_FILE, final_model)
            measured_final = True
            run = run_totals()  # its time to target too
        return summarize(cfg, run_dir, rows, world, total_steps, global_batch, evals.accuracy, evals.test_loss,
                        run.time_to_target_s, run.eval_s, resume_step, stop_at is not None,
                        {**run.lost_workers, **lost()}, run.segment_wall_s,  # (and any lost in the gather)
                        {**lm_figures(task, train_set, test_set, evals.test_loss), "model_parameters": count_parameters(model),
                         **{key: {str(s): t for s, t in sorted(servers.items())}
                            for key, servers in (("lost_servers", run.lost_servers),
                                                 ("returned_servers", run.returned_servers)) if servers}},
                        membership=run.changes, stopped_at_target=stopped_at_target,
                        workers_at_end=opt.workers if elastic or opt.joins is not None
                        else world - len(lost() if algorithm.synchronous else algorithm.lost_workers),
                        leader=opt.id if opt.changes else None,
                                        tokens_per_sample=tokens_per_sample)

    summary = summary_of_leader()
    if elastic:
        opt.control_barrier()
    else:
        control.control_barrier()  # nobody leaves (and tears the group down) before the summary exists
    if summary is None and not elastic:  # the first worker was lost after the rows were gathered: the next writes it
        summary = summary_of_leader()
    watch_waits(None)
    if stop_at is not None:
        raise Interrupted(step)
    return summary


def recorded_epochs(run_dir: Path, world: int) -> tuple[int, int | None]:
    """The number of workers whose global batch sets the run's steps per epoch and those steps,
    as the members' config.json records them (``(world, None)`` where it does not say)."""
    try:
        recorded = json.loads((run_dir / "config.json").read_text())
        return int(recorded.get(EPOCH_WORKERS_KEY, world)), int(recorded["steps_per_epoch"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return world, None


def retarget(totals: RunTotals, cfg: TrainConfig, run_dir: Path, evals: Evaluations,
             resume_step: int | None) -> RunTotals:
    """``totals`` judged by this run's target: a run resumed with another ``--target-accuracy``
    or ``--target-loss`` than its earlier segments had takes, as their time to target, the first of
    their evaluations (every worker's metrics up to the checkpoint's step) that meets the new one
    (None: none did), not the time they met the old one. A checkpoint that names no target
    (written before 2026-12-02) keeps its time."""
    target = run_target(cfg)
    if resume_step is None or totals.target is None or totals.target == target:
        return replace(totals, target=target)
    crossed = []
    for path in sorted((run_dir / "metrics").glob("rank*.jsonl")):
        for record in map(parse_record, path.read_text().splitlines()):
            if (record is not None and "test_loss" in record and record.get("step", 0) <= resume_step
                    and evals.reached(record)):
                crossed.append(float(record["time"]))
    log.info("the run's target changed on resume: its time to target is that of its first evaluation meeting the new one")
    return replace(totals, target=target, time_to_target_s=min(crossed, default=None))


def reached_anywhere(opt: DistributedOptimizer, reached: bool) -> bool:
    """Whether any worker's evaluation reached the target (the one that evaluates knows;
    collective: every worker calls it at the same step)."""
    flags = opt.control_all_gather(torch.tensor([1.0 if reached else 0.0], dtype=torch.float64))
    return any(float(f.max()) > 0 for f in flags)


#: The per-sample loss quantiles each metrics line carries (how the batch's losses are spread).
LOSS_QUANTILES = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)


def loss_quantiles(losses: torch.Tensor) -> list[float]:
    """The batch's per-sample losses at :data:`LOSS_QUANTILES`, to 4 significant digits
    (linear interpolation, as ``torch.quantile``).

    Sorted in Python: for a batch of 64 losses 14 us against ``torch.quantile``'s 82 us, CPU
    time every step pays, which counts where workers share a host's cores.
    """
    values = sorted(losses.detach().float().cpu().tolist())
    last = len(values) - 1
    out = []
    for q in LOSS_QUANTILES:
        lo = math.floor(q * last)
        hi = min(lo + 1, last)
        out.append(float(f"{values[lo] + (values[hi] - values[lo]) * (q * last - lo):.4g}"))
    return out


#: A checkpoint's data plan (:class:`~distrain.data.sampler.DataPlan`), once the members changed.
PLAN_KEY = "data_plan"


def replan(cfg: TrainConfig, opt: DistributedOptimizer, train_set: Dataset, plan: DataPlan | None,
           changes: list[Any], step: int, world: int) -> DataPlan:
    """Every member's samples after ``changes`` of the members, the first of them at ``step``.

    Synchronous algorithms: the epoch under way still gives every sample (each survivor keeps
    what its epoch had left, and what a lost worker had left after the steps the model holds of
    it is dealt out over the members, see :class:`~distrain.data.sampler.DataPlan`); then the
    training set is split again over the members. A worker that joins starts on its new shard;
    the members hand it their plan through the run's store. Asynchronous workers (asynchronous
    parameter servers' too), at no common step, start on their new shards at once."""
    if plan is None:
        plan = DataPlan.first(split(cfg, train_set, world), cfg.data.batch_size, cfg.run.seed)
    synchronous = opt.algorithm.common_steps
    for change in changes:
        kept = {w: min(step, opt.algorithm.kept_steps(change.step)) for w in change.lost}
        plan = plan.changed(change.members, step, kept, split(cfg, train_set, len(change.members)), carry=synchronous)
        if change.joined and synchronous and opt.id not in change.joined:
            publish_plan(opt.membership or opt.joins, change.epoch, plan)
    return plan


def plan_of(cfg: TrainConfig, train_set: Dataset, state: torch.Tensor) -> DataPlan:
    """The data plan ``state`` holds (a checkpoint's, or the members' read from the store)."""
    return DataPlan.from_state(state, lambda n: split(cfg, train_set, n), cfg.data.batch_size, cfg.run.seed)


def publish_plan(membership: Membership | None, epoch: int, plan: DataPlan) -> None:
    """Hand the members' data plan at the change of ``epoch`` to the workers it admitted (every
    member writes the same bytes)."""
    if membership is not None:
        membership.store_prefix("data", epoch).set("plan", plan.state().numpy().tobytes())


def read_plan(membership: Membership, epoch: int) -> torch.Tensor:
    """The members' data plan at the change of ``epoch`` that admitted this worker (waits for it
    as long as the store's timeout)."""
    return torch.frombuffer(bytearray(membership.store_prefix("data", epoch).get("plan")), dtype=torch.long)


def regroup(cfg: TrainConfig, opt: DistributedOptimizer, train_set: Dataset, schedule: LRSchedule,
            plan: DataPlan | None = None, sampler: ShardSampler | None = None) -> tuple[ShardSampler, LRSchedule, int]:
    """After an elastic run's members changed: this worker's samples (from ``plan``; without
    one, its shard of the training set split again over the members; shard files: ``sampler``,
    its own files), and the learning rate scaled to the new global batch (linear scaling rule)
    unless the algorithm's averaging already does."""
    if plan is not None:
        sampler = plan.samplers[opt.id]
    elif cfg.data.dataset != "shards" or sampler is None:
        parts = split(cfg, train_set, opt.workers)
        sampler = ShardSampler(parts[opt.ids.index(opt.id)], cfg.data.batch_size, cfg.run.seed, opt.id)
    if opt.algorithm.rescales_lr:
        schedule, global_batch = lr_schedule(cfg, opt.workers, schedule.warmup_steps, schedule.total_steps)
    else:
        global_batch = opt.workers * cfg.data.batch_size
    return sampler, schedule, global_batch


def leads(algorithm: Any, transport: Transport) -> bool:
    """Whether this worker evaluates and writes the summary: rank 0, or the first survivor."""
    return algorithm.leads(transport)


#: The trained model's parameters and buffers in the run directory (the consensus model for
#: decentralized algorithms): a plain state dict, ``torch.load(path, weights_only=True)``.
MODEL_FILE = "model.pt"


def save_model(path: Path, model: torch.nn.Module) -> None:
    """Write ``model``'s state dict to ``path`` atomically (readers never see half a file)."""
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    atomic_write(path, lambda f: torch.save(state, f))


def lm_figures(task: Task, train_set: Dataset, test_set: Dataset, test_loss: float) -> dict[str, Any]:
    """A language model's summary figures: validation loss (nats per token) and bits per byte
    (:func:`~distrain.tasks.bits_per_byte`), and, for text windows, the bits per byte of a
    bigram model of the training bytes on the validation bytes (the floor to beat, the same for
    every tokenizer)."""
    if task.name != "lm":
        return {}
    figures: dict[str, Any] = {"final_val_loss": test_loss, "final_val_bpb": bits_per_byte(test_loss, test_set)}
    if hasattr(train_set, "text") and hasattr(test_set, "text"):
        from distrain.data.text import bigram_bpb

        figures["bigram_val_bpb"] = bigram_bpb(train_set.text, test_set.text)  # type: ignore[attr-defined]
    return figures


def lm_tokens(task: Task, sample_shape: tuple[int, ...]) -> int | None:
    """Training tokens in one sample of a language model (its window), else None."""
    return int(sample_shape[0]) if task.name == "lm" and len(sample_shape) == 1 else None


def summarize(cfg: TrainConfig, run_dir: Path, rows: list[list[float]], world: int, total_steps: int,
              global_batch: int, accuracy: float | None, test_loss: float, time_to_target: float | None,
              eval_seconds: float, resume_step: int | None, interrupted: bool = False,
              lost_workers: dict[int, float] | None = None, segment_wall_s: list[float] | None = None,
              extra: dict[str, Any] | None = None, tokens_per_sample: int | None = None,
              membership: list[dict[str, Any]] | None = None, workers_at_end: int | None = None,
              stopped_at_target: bool = False,
              leader: int | None = None) -> dict[str, Any]:
    """Write summary.json from every process's counters: rows of the workers, then of any servers,
    each ``[steps, samples, wall, compute, exposed comm, *sent per peer, *received per peer, cpu]``
    (see :mod:`distrain.train.metrics` for the meaning of each field). A language model's
    ``tokens_per_sample`` adds ``tokens_per_s``: every worker's training tokens over the wall time.

    A resumed run's rows, times and ``segment_wall_s`` (each segment's training time) cover every
    segment of the run, not only the last; ``resumed_from_step`` is where the last one started.
    """
    # rank 0's, or the first survivor's (lost: zeros); in an elastic run the writer's, a member from
    # the start (a worker that joined has counters of its second life only)
    wall = rows[leader][2] if leader is not None else next((r[2] for r in rows if r[2] > 0), 0.0)
    n = len(rows)
    workers, servers = rows[:world], rows[world:]
    samples = sum(r[1] for r in workers)
    summary = {
        "algorithm": cfg.algo.algorithm, "workers": world, "epochs": cfg.run.epochs,
        # the steps taken: fewer than --epochs plans when the run stopped early (at its target, or
        # on request; asynchronous workers: the furthest one's)
        "steps": int(max(r[0] for r in workers)) if stopped_at_target or interrupted else total_steps,
        "dataset": cfg.data.dataset, "model": cfg.model.model, "global_batch": global_batch,
        "steps_per_worker": [int(r[0]) for r in workers],
        "final_test_accuracy": accuracy, "final_test_loss": test_loss,
        "task": cfg.data.task_name(), "target_accuracy": cfg.run.target_accuracy, "target_loss": cfg.run.target_loss,
        "time_to_target_s": time_to_target,
        "wall_time_s": wall, "eval_time_s": eval_seconds, "samples_per_s": samples / wall if wall > 0 else None,
        "samples_per_s_per_worker": [r[1] / r[2] if r[2] > 0 else None for r in workers],
        "bytes_sent_per_worker": [int(sum(r[5 : 5 + n])) for r in workers],
        "bytes_received_per_worker": [int(sum(r[5 + n : 5 + 2 * n])) for r in workers],
        "bytes_sent_per_server": [int(sum(r[5 : 5 + n])) for r in servers],
        "bytes_received_per_server": [int(sum(r[5 + n : 5 + 2 * n])) for r in servers],
        "bytes_sent_per_peer": [[int(v) for v in r[5 : 5 + n]] for r in rows],
        "compute_s_per_worker": [r[3] for r in workers], "exposed_comm_s_per_worker": [r[4] for r in workers],
        # CPU time of each worker process (all its threads) from the common start to its last
        # step, evaluation included: against wall time it shows whether the host's cores were
        # the limit (workers sharing a machine) rather than the network or a slow peer
        "cpu_s_per_worker": [r[5 + 2 * n] for r in workers],
        # a run stopped and resumed: where its last segment started, how many it had, and each
        # one's training time up to the checkpoint the next one resumed from (they sum to wall_time_s)
        "resumed_from_step": resume_step, "segments": len(segment_wall_s or [wall]),
        "segment_wall_time_s": list(segment_wall_s or [wall]), "run_dir": str(run_dir),
        "interrupted": interrupted,
        # workers lost during an asynchronous run (the others finished without them): when each
        # was declared dead (Unix time)
        "lost_workers": {str(r): t for r, t in sorted((lost_workers or {}).items())},
        # elastic runs: each change of the members (who was lost, who went on, at which step, how
        # long the survivors took to agree and rebuild), and how many workers trained at the end
        "membership": list(membership or []),
        # elastic runs: workers that joined again (started again live, or back from a checkpoint,
        # or added by a resume with more workers): when each last joined (Unix time); a worker
        # in both lists came back after its loss
        "joined_workers": joined_workers(membership or []),
        "workers_at_end": world if workers_at_end is None else workers_at_end,
        # --stop-at-target: the run ended at the evaluation that reached the target ("steps" are
        # the steps it took, fewer than --epochs plans)
        "stopped_at_target": stopped_at_target,
        **(extra or {}),
    }
    if tokens_per_sample is not None:
        summary["tokens_per_s"] = samples * tokens_per_sample / wall if wall > 0 else None
    write_summary(run_dir / "summary.json", summary)
    return summary


def joined_workers(membership: list[dict[str, Any]]) -> dict[str, float]:
    """Worker id -> when it last joined, from the run's membership records."""
    out: dict[int, float] = {}
    for record in membership:
        if record.get("event") == "joined":
            out.update(dict.fromkeys(record["workers"], float(record["unix_time"])))
        elif record.get("event") == "resized":  # resumed with more workers, or a lost one back
            out.update(dict.fromkeys(record["joined"], float(record["unix_time"])))
    return {str(w): t for w, t in sorted(out.items())}


def _progress_bar(cfg: TrainConfig, rank: int, total: int, initial: int) -> Any:
    if rank != 0 or not cfg.run.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="step", desc=f"{cfg.algo.algorithm}",
                dynamic_ncols=True, leave=False)
