"""Continuing a run from its checkpoint: what must match, what a finished run answers, the RNG.

``--resume auto`` on a run that has already trained all the steps ``--epochs`` asks for trains
nothing and writes nothing: the run's recorded ``summary.json`` is its result.

Extending a run: resumed with a larger ``--epochs``, a run continues to the new length. The
learning-rate schedule is always the one of the current ``--epochs`` (warm-up and decay are
functions of the step and of the run's total steps), so from the resumed step on the run follows
the schedule a run planned for the new length from the start would follow there. For a cosine
decay that is a warm restart: a finished 15-epoch run extended to 20 epochs goes on at the
20-epoch cosine's value at epoch 15 (about 15% of the peak), not at the 0 where its first schedule
ended, and decays to 0 at epoch 20. Its parameters are not those of a 20-epoch run, whose first
15 epochs used the longer schedule. A checkpoint written with another number of steps per epoch
(another ``--batch-size``, ``--workers``, ``--num-samples`` or data set) is refused: its steps
would mean other samples and another schedule.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from distrain.algorithms.gossip import GOSSIP_CLOCK, GOSSIP_COUNTS
from distrain.config import SECTIONS, TrainConfig, flag
from distrain.errors import CheckpointError, ConfigError
from distrain.optim.schedule import LRSchedule
from distrain.report.runs import NOT_CONFIGURATION
from distrain.runtime.checkpoint import WORLD_SIZE_KEY, CheckpointStore

log = logging.getLogger(__name__)


#: Algorithms whose runs can be resumed with another number of workers: every worker holds the
#: same model and optimizer state at a checkpoint, and one group spans them all (flat: not
#: ``--workers-per-node``), so any member's file serves any new worker. DiLoCo's workers hold
#: the same model only at a round's end (after its sync), and the shared parameters and outer
#: state only where a round is one sync of the whole model at a fixed H (one fragment, no
#: overlap, uncompressed: :func:`resize_setting`): its sets saved there serve any number of workers.
RESIZABLE = ("allreduce", "diloco")
#: The checkpoint entry giving the number of workers whose global batch sets the run's steps per
#: epoch (its first workers'); absent: the checkpoint's ``world_size``.
EPOCH_WORKERS_KEY = "epoch_workers"
#: What a resizable algorithm needs, for the refusals
_RESIZABLE_WHEN = "allreduce, flat, and diloco with one fragment, no overlap, no compression and a fixed --sync-every"


#: An asynchronous run's checkpoint entry: True in the set its workers saved once their budget
#: was used up (after the gossip drained), False in the others (periodic, or at a stop). Its
#: workers stand at different steps, so the step of a set does not say whether the run finished.
BUDGET_DONE_KEY = "budget_done"
#: :func:`already_finished` of an asynchronous run: the seconds it trained (its clock at the end)
FINISHED_CLOCK_KEY = "finished_clock_s"


def time_budget(cfg: TrainConfig) -> float | None:
    """The seconds an asynchronous run trains for with ``--budget time`` (None: its budget is in
    steps)."""
    return cfg.gossip.time_budget if cfg.gossip.budget == "time" else None


#: config.json's record of the settings that resumes changed, oldest first:
#: ``[{"from_step": k, "settings": {name: [before, after]}}, ...]``; config.json's settings are
#: the last segment's.
CHANGED_KEY = "changed_on_resume"

#: Settings a resume changes without a record: those that do not change what a run computes, its
#: length (``describe_extension`` says what a longer run does) and its workers (membership events).
UNRECORDED = NOT_CONFIGURATION | {"epochs", "workers"}


def changes_on_resume(run_dir: str | Path, cfg: TrainConfig, step: int) -> list[dict[str, Any]]:
    """The run's :data:`CHANGED_KEY` record with this resume's changes, from ``step``, against the
    settings its config.json holds (each change is also logged); the record as it was if none."""
    path = Path(run_dir) / "config.json"
    try:
        earlier = json.loads(path.read_text())
    except (OSError, ValueError):  # no record of the earlier segment (or an unreadable one): nothing to compare
        return []
    history = list(earlier.get(CHANGED_KEY, []))
    before = {name: value for key, section in earlier.items() if key in SECTIONS and isinstance(section, dict)
              for name, value in section.items()}
    after = {name: value for section in cfg.to_dict().values() for name, value in section.items()}
    changed = {name: [before[name], value] for name, value in after.items()
               if name in before and name not in UNRECORDED and before[name] != value}
    if changed:
        history.append({"from_step": step, "settings": changed})
        log.warning("resumed at step %d with other settings than before: %s (config.json records both)", step,
                    ", ".join(f"{flag(name)} {old!r} -> {new!r}" for name, (old, new) in changed.items()))
    return history


#: Checkpoint entry of a run that ``--stop-at-target`` ended at its target: that target,
#: ``[target_accuracy, target_loss]``. Resumed with ``--stop-at-target`` and the same target, it
#: has nothing left to do.
STOPPED_AT_TARGET_KEY = "stopped_at_target"


def shape_settings(cfg: TrainConfig) -> dict[str, Any]:
    """The settings of ``cfg`` that shape its model and its data's split over the workers, by
    flag (see :data:`~distrain.runtime.checkpoint.SHAPE_KEY`): another ``--seed`` or
    ``--partition`` would deal the samples out anew in the middle of an epoch."""
    d, m = cfg.data, cfg.model
    return {"--dataset": d.dataset, "--model-width": m.model_width, "--model-depth": m.model_depth,
            "--model-size": m.model_size, "--context": d.context, "--tokenizer": d.tokenizer,
            "--seed": cfg.run.seed, "--partition": d.partition, "--dirichlet-alpha": d.dirichlet_alpha}


def run_target(cfg: TrainConfig) -> list[float | None]:
    """The run's target as checkpoints record it: ``[target_accuracy, target_loss]``."""
    return [cfg.run.target_accuracy, cfg.run.target_loss]


def stopped_at_this_target(state: dict[str, Any], cfg: TrainConfig) -> bool:
    """Whether the run that saved ``state`` ended at the target this run stops at (resumed with
    ``--stop-at-target`` and the same target, it would only train past where it stopped)."""
    return cfg.run.stop_at_target and state.get(STOPPED_AT_TARGET_KEY) == run_target(cfg)


def nothing_left(state: dict[str, Any], total_steps: int, time_budget: float | None = None) -> bool:
    """Whether the run that saved ``state`` has trained all that a run of ``total_steps`` steps
    asks for (every worker decides the same from its file of the set). Synchronous runs: the
    step of the set. Asynchronous ones (:data:`BUDGET_DONE_KEY`): their budget was used up, and
    its length has not grown since (``total_steps``, or the seconds of ``--budget time``,
    ``time_budget``, against the run's clock at the end).

    Example::

        if nothing_left(state, total_steps=400):
            ...  # already finished: touch nothing
    """
    if BUDGET_DONE_KEY not in state:
        return int(state["step"]) >= total_steps
    if not state[BUDGET_DONE_KEY]:
        return False
    if time_budget is not None:
        return time_budget <= float(state["algorithm"].get(GOSSIP_CLOCK, 0.0))
    return total_steps <= int(state.get("total_steps", 0))


def saved_workers(state: dict[str, Any], default: int) -> int:
    """How many workers wrote ``state``'s set (``default`` where it does not say)."""
    saved = state.get(WORLD_SIZE_KEY)
    return default if saved is None else int(saved)


def epoch_workers(state: dict[str, Any] | None, world: int) -> int:
    """The number of workers whose global batch sets the run's steps per epoch: its first
    workers' (``world`` for a new run)."""
    if state is None:
        return world
    return int(state.get(EPOCH_WORKERS_KEY, saved_workers(state, world)))


def resize_setting(cfg: Any) -> str:
    """The setting of ``cfg`` (a TrainConfig) that keeps its algorithm from changing the number of
    workers on resume, as a flag (``""``: none): DiLoCo's other than one sync of the whole model,
    uncompressed, at a fixed H.

    Example::

        resize_setting(cfg)   # "--fragments 4" for diloco with four fragments
    """
    if cfg.algo.algorithm != "diloco":
        return ""
    o, spec = cfg.outer, str(cfg.compress.compress).strip()
    if str(o.sync_every) == "auto":
        return "--sync-every auto"
    if o.fragments != 1:
        return f"--fragments {o.fragments}"
    if o.overlap_steps:
        return f"--overlap-steps {o.overlap_steps}"
    if spec != "none":
        return f"--compress {spec}"
    return ""


def at_round_end(state: dict[str, Any]) -> bool:
    """Whether a DiLoCo checkpoint was saved where every worker holds the shared parameters: its
    last inner step synced every fragment and no exchange is pending (a round's end, the run's
    last step, or a stop, which syncs what moved)."""
    algo = state.get("algorithm") or {}
    if "inner_steps" not in algo or "synced_at" not in algo:
        return False
    inner = int(algo["inner_steps"])
    interrupted = algo.get("interrupted")
    return (all(int(s) == inner for s in algo["synced_at"].tolist()) and not algo.get("pending")
            and (interrupted is None or len(interrupted) == 0))


def resume_point(store: CheckpointStore, resume: str, world: int, algorithm: str, *, warn: bool = False) -> int | None:
    """The step of the set a run of ``world`` workers resumes from (see :meth:`CheckpointStore.resolve`): with ``--resume auto``, a DiLoCo run whose newest complete set
    was written by another number of workers in the middle of a round (the workers' models then
    differ) takes the newest complete set that can serve it: one saved at a round's end, or by
    ``world`` workers. None such: the newest, which :func:`check_worker_count` refuses.
    ``warn``: say so in the log when an older set is taken.

    Example::

        step = resume_point(store, "auto", world=2, algorithm="diloco")
    """
    newest = store.resolve(resume)
    if newest is None or algorithm != "diloco" or resume.strip().lower() != "auto":
        return newest
    for step in [s for s in reversed(store.steps()) if s <= newest]:
        try:
            store.resolve(str(step))  # complete and intact
        except CheckpointError:  # resolve("auto") skipped it too
            continue
        state = store.load(step, store.source(step))
        if saved_workers(state, world) == world or at_round_end(state):
            if step != newest and warn:
                log.warning("the newest checkpoint (step %d) was saved in the middle of a DiLoCo round by %d workers; "
                            "%d workers resume from step %d, the newest saved at a round's end", newest,
                            saved_workers(store.load(newest, store.source(newest)), world), world, step)
            return step
    return newest


def check_worker_count(state: dict[str, Any], algorithm: str, world: int, *, workers_per_node: int = 0,
                       dataset: str = "", setting: str = "") -> None:
    """Refuse resuming with ``world`` workers a checkpoint written by another number, unless the
    algorithm can change it (:data:`RESIZABLE`, flat, not ``--dataset shards``: a worker reads
    its own shard files, so the samples a worker had left cannot be dealt to the others; not
    with ``setting``, see :func:`resize_setting`; DiLoCo: a set saved at a round's end).

    Raises:
        CheckpointError: one line with both numbers, the setting that stands in the way and
            which algorithms can change the worker count on resume.

    Example::

        check_worker_count(state, "allreduce", world=3)   # a checkpoint of 4 workers: accepted
    """
    saved = saved_workers(state, world)
    if saved == world:
        return
    if algorithm not in RESIZABLE:
        why = f"--algorithm {algorithm} cannot"
    elif setting:
        why = f"--algorithm {algorithm} with {setting} cannot"
    elif workers_per_node:
        why = "--workers-per-node (hierarchical) cannot"
    elif dataset == "shards":
        why = "--dataset shards (each worker reads its own files) cannot"
    elif algorithm == "diloco" and not at_round_end(state):
        raise CheckpointError(
            f"checkpoint of step {state.get('step')} was written by {saved} workers in the middle of a DiLoCo round "
            f"(their models differ there); this run has {world}: resume with --workers {saved}, or {world} from a set "
            "saved at a round's end (--resume auto takes the newest kept; --checkpoint-every a multiple of "
            "--sync-every saves them)"
        )
    else:
        return
    raise CheckpointError(
        f"checkpoint was written by {saved} workers; this run has {world}, and {why} change the number of "
        f"workers on resume (only {_RESIZABLE_WHEN} can): resume with --workers {saved}"
    )


def check_epoch_length(state: dict[str, Any], steps_per_epoch: int) -> None:
    """Refuse a checkpoint written by a run whose epochs had another number of steps.

    Raises:
        CheckpointError: one line with both numbers and what changes them.

    Example::

        check_epoch_length(state, steps_per_epoch=20)
    """
    saved = state.get("steps_per_epoch")
    if saved is not None and int(saved) != steps_per_epoch:
        raise CheckpointError(
            f"checkpoint was written by a run of {int(saved)} steps per epoch; this run has {steps_per_epoch} "
            "(another --batch-size, --num-samples or data set): resume with the ones it was written with"
        )


def refuse_fresh_over_ended_run(run_dir: str | Path, resume: str) -> None:
    """``--resume auto`` found no checkpoint set to go on from (none saved, or every one
    damaged): where ``run_dir`` holds a run that ended (its ``summary.json``), starting afresh
    would replace that run's results, so refuse in one line. A run that died before it wrote a
    summary (and before its first checkpoint) starts again, as a restarted job expects."""
    if resume.strip().lower() != "auto" or not (Path(run_dir) / "summary.json").exists():
        return
    raise ConfigError("--resume", f"{str(run_dir)!r} holds a run that ended (summary.json) but no complete, intact "
                      "checkpoint to go on from, and starting afresh would replace it; keep it and pick another "
                      "--run-dir, or replace it with --overwrite (without --resume)")


def already_finished(run_dir: str | Path, state: dict[str, Any]) -> dict[str, Any]:
    """The result of a run with nothing left to train: its ``summary.json`` as recorded (read,
    never written), with ``"already_finished": True`` and the step and epochs it has done.

    Example::

        result = already_finished("runs/x", state)   # state: the checkpoint resumed from
        print(finished_message(result, epochs=15))
    """
    run_dir = Path(run_dir)
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):  # stopped between its last checkpoint and its summary
        summary = None
    step, per_epoch = int(state["step"]), int(state.get("steps_per_epoch") or 0)
    clock = {}
    if BUDGET_DONE_KEY in state:  # asynchronous: its workers' own steps differ; the furthest one's
        step = max([step, *map(int, state["algorithm"].get(GOSSIP_COUNTS, []))])
        clock = {FINISHED_CLOCK_KEY: float(state["algorithm"].get(GOSSIP_CLOCK, 0.0))}
    return {**(summary if isinstance(summary, dict) else {}), "already_finished": True, "finished_step": step,
            "finished_epochs": step / per_epoch if per_epoch else None, "run_dir": str(run_dir), **clock}


def finished_message(result: dict[str, Any], epochs: float, time_budget: float | None = None) -> str:
    """One line telling the user a resumed run had nothing left to do (see :func:`already_finished`);
    ``time_budget``: the run's ``--time-budget`` when it trains for a time (``--budget time``)."""
    done = result.get("finished_epochs")
    trained = f"{result['finished_step']} steps" + (f" ({done:g} epoch{'s' if done != 1 else ''})" if done is not None else "")
    if result.get(STOPPED_AT_TARGET_KEY):  # the summary's field of the same name
        return (f"run {result['run_dir']} stopped at its target after {trained} (--stop-at-target); nothing to do "
                "(without --stop-at-target, or with another target, it trains further)")
    if time_budget is not None and FINISHED_CLOCK_KEY in result:
        return (f"run {result['run_dir']} has already trained {trained} in {result[FINISHED_CLOCK_KEY]:.1f} s, all that "
                f"--time-budget {time_budget:g} asks for; nothing to do (a larger --time-budget trains further)")
    return (f"run {result['run_dir']} has already trained {trained}, all that --epochs {epochs:g} asks for; "
            "nothing to do (a larger --epochs trains further)")


def rng_state() -> dict[str, torch.Tensor]:
    """The random number generators' state of this process (torch's CPU one, and CUDA's in use),
    for a checkpoint: a resumed run draws what the uninterrupted run would have drawn (dropout,
    a user's random augmentation)."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def describe_extension(state: dict[str, Any], schedule: LRSchedule) -> str:
    """One line on a run resumed with another length: where the learning rate goes on from.

    Example::

        log.warning(describe_extension(state, schedule))
        # "run planned for 300 steps goes on from step 300 to 400: ... (0 -> 0.0586 at step 300)"
    """
    step, planned = int(state["step"]), int(state["total_steps"])
    before = replace(schedule, total_steps=planned)
    return (f"run planned for {planned} steps goes on from step {step} to {schedule.total_steps}: the learning rate "
            f"follows the {schedule.total_steps}-step schedule from here "
            f"({before.lr_at(step):.4g} -> {schedule.lr_at(step):.4g} at step {step})")
