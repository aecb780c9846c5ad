"""The shared worker of the baselines: PyTorch's DDP and torchft in distrain's harness.

Most baselines ("peers") are plain ``torch.nn.parallel.DistributedDataParallel`` plus at most a
communication hook and an after-step action, all PyTorch public APIs; the torchft peers train the
bare model and synchronise inside ``optimizer.step()`` (:mod:`distrain.baselines.torchft_peers`).
This worker gives every peer the same data shards, model, initial parameters, learning-rate
schedule, evaluation points, emulated network and run-directory format (``config.json``,
``metrics/rank<r>.jsonl``, ``summary.json``) as ``distrain train``, so ``distrain compare`` and
``distrain report`` treat them alike.

Traffic is counted and delayed by :mod:`distrain.baselines.wire` (DDP's and torchft's gloo
collectives cannot go through the Transport). Compute slowdown (``--slow-worker``) stretches each
step's forward and backward time as in the distrain loop; the last bucket's hook call marks the
end of backward.

Example::

    from distrain.baselines import run_baseline
    summary = run_baseline("ddp-powersgd:2", cfg)   # cfg: a validated TrainConfig
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import logging
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from distrain.baselines.wire import WireMeter
from distrain.comm.group import check_device, close_group, init_group
from distrain.config import TrainConfig
from distrain.data.batches import batches_of
from distrain.emulation import Emulation, NetworkSettings
from distrain.errors import ConfigError, DataError, DistrainError
from distrain.launch.common import (
    configure_worker_logging,
    default_run_dir,
    enter_worker,
    exit_now,
    free_port,
)
from distrain.models import build_model, count_parameters
from distrain.optim.optimizers import build_optimizer
from distrain.runtime.forkserver import worker_context
from distrain.runtime.process import EXIT_BAD_INPUT
from distrain.tasks import build_task
from distrain.train.evaluation import Evaluations
from distrain.train.loop import lm_figures, lm_tokens, lr_schedule, plan_worker_data, summarize
from distrain.train.metrics import MetricsWriter, write_json_atomic

log = logging.getLogger(__name__)


class Peer:
    """One baseline: how DDP communicates (a comm hook) and what follows each optimizer step.

    Subclasses set ``name`` and override :meth:`register` (and :meth:`after_step`,
    :meth:`eval_model`, :meth:`metrics` where they do more than DDP does). A peer with
    ``uses_ddp = False`` trains the bare model, and :meth:`serve` runs what it needs beside its
    workers (torchft's lighthouse).

    Args:
        option: the text after the name in the spec (``ddp-powersgd:2`` -> ``"2"``), or None.
    """

    name = "peer"
    #: What the option means, for error messages (None: the peer takes no option).
    option_help: str | None = None
    #: Whether the worker wraps the model in DDP (False: the peer communicates on its own).
    uses_ddp = True
    #: Whether the optimizer steps on each worker's own gradients, the models averaged later
    #: (the linear scaling rule then applies to one worker's batch, as for distrain's diloco).
    local_steps = False

    def __init__(self, option: str | None = None) -> None:
        if option is not None and self.option_help is None:
            raise ConfigError("--baselines", f"{self.name} takes no option, got {self.name}:{option}")
        self.option = option
        self.meter: WireMeter | None = None

    def check_available(self) -> None:
        """Refuse a baseline this installation cannot run at all (a missing package), before any
        run of a grid starts (ConfigError naming ``--baselines``)."""

    def check_config(self, cfg: TrainConfig) -> None:
        """Refuse settings this baseline cannot honour (ConfigError naming the flag)."""

    def serve(self, cfg: TrainConfig, run_dir: Path) -> contextlib.AbstractContextManager[None]:
        """What the launcher runs beside the workers while they train (nothing for DDP); entered
        before any worker starts, so what it sets on the peer reaches every worker."""
        return contextlib.nullcontext()

    def register(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, meter: WireMeter, cfg: TrainConfig,
                 steps_per_epoch: int, total_steps: int) -> None:
        """Register the communication hook on ``model`` (DDP) or ``optimizer``; ``meter`` counts
        and delays its traffic."""
        self.meter = meter

    def after_step(self, model: torch.nn.Module) -> None:
        """After each ``optimizer.step()`` (model averaging)."""

    def eval_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model to evaluate; every worker calls this at evaluation points (may be collective)."""
        return model.module if isinstance(model, DDP) else model

    def metrics(self) -> dict[str, float]:
        """Extra numbers for this step's metrics line."""
        return {}

    def info(self) -> dict[str, Any]:
        """Facts about the setup for config.json."""
        return {"baseline": self.name, "option": self.option}

    def summary_fields(self) -> dict[str, Any]:
        """Keys this peer adds to summary.json (none for DDP)."""
        return {}

    def close(self) -> None:
        """After the run, or when it fails: release what :meth:`register` opened."""


def check_peer_config(peer: Peer, cfg: TrainConfig) -> None:
    """What no baseline supports, then the peer's own checks."""
    if cfg.network.emulation == "netns":
        raise ConfigError("--emulation", "the baselines run with the in-process link model only; use --emulation model")
    if cfg.compress.compress != "none":
        raise ConfigError("--compress", f"{peer.name} brings its own communication; run it with --compress none")
    if cfg.run.resume != "none":
        raise ConfigError("--resume", f"{peer.name} does not checkpoint or resume; use --resume none")
    if cfg.cluster.device == "cuda" and cfg.network.network != "none":
        raise ConfigError("--network", "emulated networks for the DDP baselines are CPU (gloo) only")
    if peer.uses_ddp:
        ddp_buckets(cfg)
    peer.check_config(cfg)


def ddp_buckets(cfg: TrainConfig) -> dict[str, Any]:
    """DDP's bucket arguments for ``--bucket-mb`` and ``--first-bucket-mb``: the buckets
    distrain's allreduce makes (DDP gives every bucket ``bucket_cap_mb`` once it is passed)."""
    cap, first = cfg.algo.bucket_mb, cfg.algo.first_bucket_mb
    if not first or first >= cap:
        return {"bucket_cap_mb": cap}
    if "bucket_cap_mb_list" not in inspect.signature(DDP.__init__).parameters:
        raise ConfigError("--first-bucket-mb", f"the DDP baselines need a torch whose DistributedDataParallel takes "
                          f"bucket_cap_mb_list (this is {torch.__version__}); use 0")
    return {"bucket_cap_mb_list": [first, cap]}


def train_peer(cfg: TrainConfig, run_dir: str | Path, peer: Peer) -> dict[str, Any] | None:
    """Run one worker of ``peer`` (the default process group must exist); the summary on rank 0.

    With DDP the default group carries the training traffic; a peer that communicates on its
    own uses it only for the start barrier and the summary's rows."""
    run_dir = Path(run_dir)
    torch.set_num_threads(cfg.run.threads)
    rank, world = dist.get_rank(), dist.get_world_size()
    emulation = Emulation.from_config(cfg.network, seed=cfg.run.seed)
    meter = WireMeter(world, rank, emulation.link_model)
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.cluster.device == "cuda" else torch.device("cpu")

    # --- data and model exactly as in distrain.train.loop -----------------------------------
    task = build_task(cfg.data.task_name())
    train_set, test_set, num_classes, shards, steps_per_epoch, total_steps, sampler = plan_worker_data(
        cfg, rank, world, None, None, task=task)
    torch.manual_seed(cfg.run.seed)
    sample_shape = tuple(batches_of(train_set, torch.tensor([0]), classes=task.classes)[0].shape[1:])
    module = build_model(cfg.model.model, sample_shape, num_classes, width=cfg.model.model_width,
                         depth=cfg.model.model_depth, size=cfg.model.model_size).to(device)
    torch.manual_seed(cfg.run.seed + rank)
    model = DDP(module, **ddp_buckets(cfg)) if peer.uses_ddp else module

    o = cfg.optim
    schedule, global_batch = lr_schedule(cfg, world, round(o.warmup_epochs * steps_per_epoch), total_steps,
                                         local_steps=peer.local_steps)
    peak = schedule.peak_lr
    optimizer = build_optimizer(o.optimizer, module.parameters(), lr=peak, momentum=o.momentum, weight_decay=o.weight_decay)
    peer.register(model, optimizer, meter, cfg, steps_per_epoch, total_steps)
    out_cfg = copy.deepcopy(cfg)
    out_cfg.algo.algorithm = peer_label(peer)  # what summary.json and config.json call this run
    if rank == 0:
        write_json_atomic(run_dir / "config.json", {
            **out_cfg.to_dict(), "world_size": world, "steps_per_epoch": steps_per_epoch, "total_steps": total_steps,
            "global_batch": global_batch, "peak_lr": peak, "shards": shards, "resumed_from_step": None,
            "algorithm_info": peer.info(), "network_bits_per_s": NetworkSettings.from_config(cfg.network).bits_per_s(),
        })

    # --- the loop -----------------------------------------------------------------------------
    metrics = MetricsWriter(run_dir, rank)
    eval_interval = max(1, round(cfg.run.eval_every * steps_per_epoch))
    evals = Evaluations(task, test_set, cfg.run.eval_samples, cfg.run.target_accuracy, cfg.run.target_loss, device)
    eval_seconds = compute_seconds = exposed_seconds = busy_before = 0.0
    model.train()
    dist.barrier()
    emulation.start()  # t = 0 of bandwidth traces; meter.link_model is the emulation's
    start, cpu_start = time.perf_counter(), time.process_time()
    steps_done, stopped_at_target = 0, False
    for step in range(total_steps):
        t0 = time.perf_counter()
        x, y = batches_of(train_set, sampler.batch(step), classes=task.classes)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=False)
        loss = task.losses(model(x), y).mean()
        meter.backward_done = 0.0
        loss.backward()  # DDP all-reduces gradient buckets through the hook, overlapping backward
        t_backward = time.perf_counter()
        ready = meter.backward_done or t_backward
        waited = t_backward - ready  # DDP waits for its last buckets inside backward: exposed communication
        compute = ready - t0
        emulation.after_compute(compute)  # a slow worker takes factor x as long
        compute *= emulation.compute.factor
        compute_seconds += compute
        t_update = time.perf_counter()
        lr = schedule.apply(optimizer, step)
        optimizer.step()
        peer.after_step(model)
        exposed = waited + time.perf_counter() - t_update
        exposed_seconds += exposed

        record: dict[str, Any] = {
            "step": step + 1, "epoch": (step + 1) / steps_per_epoch, "time": time.perf_counter() - start - eval_seconds,
            "loss": loss.item(), "lr": lr, "bytes_sent": meter.bytes_sent, "bytes_received": meter.bytes_received,
            "compute_s": compute, "exposed_comm_s": exposed, "comm_busy_s": meter.comm_seconds - busy_before,
        }
        busy_before = meter.comm_seconds
        if (step + 1) % eval_interval == 0 or step + 1 == total_steps:
            t_eval = time.perf_counter()
            eval_model = peer.eval_model(model)
            if rank == 0:
                evals.measure(eval_model, record, final=step + 1 == total_steps)
            if cfg.run.stop_at_target and step + 1 < total_steps:  # rank 0 tells everyone whether it reached it
                reached = torch.tensor([0.0 if evals.time_to_target is None else 1.0], dtype=torch.float64)
                dist.broadcast(reached, src=0)
                if reached.item() > 0:
                    stopped_at_target = True
                    if rank == 0:
                        evals.stopped_at_target(eval_model, record)
            eval_seconds += time.perf_counter() - t_eval
        record.update(peer.metrics())
        metrics.write(record)
        steps_done = step + 1
        if stopped_at_target:
            break
    wall = time.perf_counter() - start - eval_seconds
    metrics.close()
    meter.close()

    mine = torch.tensor([steps_done, steps_done * cfg.data.batch_size, wall, compute_seconds, exposed_seconds,
                         *meter.sent, *meter.received, time.process_time() - cpu_start], dtype=torch.float64)
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine)
    summary = summarize(out_cfg, run_dir, [r.tolist() for r in rows], world, total_steps, global_batch, evals.accuracy,
                        evals.test_loss, evals.time_to_target, eval_seconds, None, stopped_at_target=stopped_at_target,
                        extra={**lm_figures(task, train_set, test_set, evals.test_loss),
                               "model_parameters": count_parameters(module), **peer.summary_fields()},
                        tokens_per_sample=lm_tokens(task, sample_shape)) if rank == 0 else None
    dist.barrier()  # nobody tears the group down before the summary exists
    return summary


def peer_label(peer: Peer) -> str:
    """``name`` or ``name:option``: the spec the peer was selected with."""
    return peer.name if peer.option is None else f"{peer.name}:{peer.option}"


def _worker(rank: int, world: int, cfg: TrainConfig, init_method: str, run_dir: str, peer: Peer, launcher: int,
            environ: dict[str, str]) -> None:
    enter_worker(launcher, environ)  # as distrain's own workers: nobody outlives the launcher
    configure_worker_logging(rank)
    code = 0
    try:
        init_group(cfg, rank, world, init_method)
        train_peer(cfg, run_dir, peer)
    except (ConfigError, DataError) as exc:
        if rank == 0:
            print(f"distrain: {exc}", file=sys.stderr)
        code = EXIT_BAD_INPUT
    except KeyboardInterrupt:
        code = 130
    except DistrainError as exc:
        print(f"distrain: worker {rank}: {exc}", file=sys.stderr)
        code = 1
    except Exception:
        print(f"distrain: worker {rank} failed:\n{traceback.format_exc()}", file=sys.stderr)
        code = 1
    finally:
        peer.close()
        close_group()
    exit_now(code)  # not sys.exit: gloo's threads can abort interpreter teardown after a good run


def launch_peer(cfg: TrainConfig, peer: Peer) -> dict[str, Any]:
    """Run ``peer`` with ``cfg.cluster.workers`` local processes on loopback; returns the summary."""
    from distrain.launch.checks import preflight
    from distrain.launch.local import _stop, _supervise  # the same supervision as distrain train

    check_device(cfg)
    check_peer_config(peer, cfg)
    if cfg.run.checkpoint_every:
        warnings.warn(f"{peer.name} does not checkpoint; --checkpoint-every is ignored", stacklevel=2)
    run_dir = default_run_dir(cfg, time.time())
    run_dir.mkdir(parents=True, exist_ok=True)
    preflight(cfg)
    addr = cfg.cluster.master_addr
    port = cfg.cluster.master_port or free_port(addr)
    ctx = worker_context()
    with peer.serve(cfg, run_dir):
        procs = [ctx.Process(target=_worker, name=f"distrain-{peer.name}-{rank}",
                             args=(rank, cfg.cluster.workers, cfg, f"tcp://{addr}:{port}", str(run_dir), peer, os.getpid(),
                                   dict(os.environ)))
                 for rank in range(cfg.cluster.workers)]
        try:
            for p in procs:
                p.start()
            _supervise(procs, grace=min(cfg.cluster.timeout, 30.0), run_dir=run_dir, nworkers=cfg.cluster.workers)
        except BaseException:
            _stop(procs)
            raise
    return json.loads((run_dir / "summary.json").read_text())
