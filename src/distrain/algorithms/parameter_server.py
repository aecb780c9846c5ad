"""Sharded parameter servers: workers push gradients, servers update their shard, workers pull.

The flat parameter vector is cut into ``--servers`` equal shards (balanced by bytes; a shard may
span several tensors). Each step every worker sends each server the gradient of its shard and
receives the shard's new parameters; the server owns the optimizer state of its shard.

Modes:
    sync: a server waits for all workers' gradients of a step, averages them, takes one
        optimizer step, and answers everyone (equal to all-reduce SGD).
    async: a server applies each push as it arrives (gradient / workers, one optimizer step per
        push) and answers that worker at once, unless the worker is more than
        ``--max-staleness`` pushes ahead of the slowest worker: then its answer waits
        (stale-synchronous parallel). With ``--max-staleness 0`` and plain SGD this is the
        sync result, up to the order of floating-point additions.

With ``--compress`` (other than none) each worker compresses the gradient of each shard, with
error feedback kept per shard, and the server decodes every push to a dense gradient before
summing; pulls stay dense. The density warm-up sends dense pushes; every worker may push a
different ratio at every step (:meth:`~distrain.algorithms.base.Algorithm.compress_ratio`).
With a sparsifier, SGD with momentum and ``--momentum-correction on`` (the default), the workers
apply momentum and weight decay before compressing (Deep Gradient Compression) and the servers
step with plain SGD.

Wire format (tensors only): at start, worker 0 sends each server an int64 header
``[shard_numel, total_steps, steps_per_epoch]`` and the initial shard; each push is an int64
``[clock]`` then the float gradient shard, or with ``--compress`` one message of
:mod:`distrain.compress.pushes` (a header announcing the payload's size, checked by the server
before it allocates); each pull is the float parameter shard.

Example::

    distrain train --algorithm ps --servers 2 --ps-mode async --max-staleness 2
    distrain train --algorithm ps --servers 2 --compress group_topk:0.01
"""

from __future__ import annotations

import logging
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from distrain.algorithms.base import Algorithm, StepContext
from distrain.comm.transport import Handle, Transport
from distrain.compress.base import CompressInfo
from distrain.compress.momentum_correction import MomentumCorrection
from distrain.compress.pushes import PushDecoder, ShardPush, send_message
from distrain.compress.registry import build_compressor
from distrain.compress.warmup import DensityWarmup
from distrain.config import TrainConfig
from distrain.errors import ConfigError, WorkerFailure
from distrain.train.faults import FaultWatch, maybe_injected_kill
from distrain.train.optim import build_optimizer
from distrain.train.schedule import LRSchedule, scaled_lr

log = logging.getLogger(__name__)

HEADER = 3  # shard_numel, total_steps, steps_per_epoch


def worker_momentum(cfg: TrainConfig) -> float:
    """The momentum workers apply before compressing their pushes (momentum correction), or 0.

    Non-zero for a sparsifying ``--compress`` with error feedback, ``--momentum-correction on``
    and SGD with momentum; the servers then run SGD without momentum or weight decay.
    """
    c, o = cfg.compress, cfg.optim
    if c.compress.strip() == "none" or c.momentum_correction != "on" or c.error_feedback != "on":
        return 0.0
    if o.optimizer != "sgd" or o.momentum <= 0:
        return 0.0
    return o.momentum if build_compressor(c.compress, error_feedback=False).ratio is not None else 0.0


def shard_bounds(numel: int, servers: int) -> list[tuple[int, int]]:
    """``servers`` contiguous [lo, hi) ranges of nearly equal size covering ``numel`` elements."""
    base, extra = divmod(numel, servers)
    bounds, lo = [], 0
    for s in range(servers):
        hi = lo + base + (1 if s < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


class ParameterServer(Algorithm):
    """The worker side: push gradient shards, pull parameter shards."""

    name = "ps"
    compresses = True

    @classmethod
    def check_config(cls, cfg: TrainConfig) -> None:
        super().check_config(cfg)
        if cfg.optim.optimizer == "lars":
            raise ConfigError("--optimizer", "lars adapts per layer; the parameter server updates flat shards: use sgd or adam")
        if cfg.ps.ps_mode == "async" and cfg.run.resume not in ("none", ""):
            raise ConfigError("--resume", "resuming is supported for --ps-mode sync only")

    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, transport: Transport) -> None:
        super().setup(model, optimizer, transport)
        self.num_workers = self.config.cluster.workers
        self.servers = [self.num_workers + s for s in range(self.config.ps.servers)]
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        self.grad = torch.zeros_like(self.flat)
        self.bounds = shard_bounds(self.flat.numel(), len(self.servers))
        self.clock = 0
        self._clock_header = torch.zeros(1, dtype=torch.int64)
        c = self.config.compress
        self.push: ShardPush | None = None
        self.ratio, self.momentum = 1.0, 0.0
        if c.compress.strip() != "none":
            compressor = build_compressor(c.compress, error_feedback=c.error_feedback == "on", seed=self.config.run.seed)
            self.momentum = worker_momentum(self.config)
            if self.momentum:
                compressor = MomentumCorrection(compressor.inner, self.momentum)
            self.push = ShardPush(compressor)
            self.density = DensityWarmup(compressor.ratio, c.density_warmup_epochs, c.density_decay_epochs)

    def _push_info(self, ctx: StepContext) -> tuple[CompressInfo, bool]:
        """How this step's pushes are compressed (key 0; set per shard), and whether they are dense."""
        epochs_done = ctx.epoch * ctx.step / (ctx.step + 1)  # ctx.epoch counts the step being finished
        dense = self.density.dense(epochs_done)
        ratio = None if dense else self.compress_ratio(ctx)
        if not dense and (ratio is None or self.push.compressor.ratio is None):
            ratio = self.density.ratio(epochs_done)
        self.ratio = 1.0 if dense or ratio is None else ratio
        return CompressInfo(step=ctx.step, ratio=ratio, worker=self.transport.rank), dense

    def start(self, total_steps: int, steps_per_epoch: int) -> None:
        """Worker 0 tells every server its shard size and the run length, and sends the start values."""
        if self.transport.rank != 0:
            return
        torch.cat([p.detach().reshape(-1) for p in self.params], out=self.flat)  # after any resume
        handles: list[Handle] = []
        for server, (lo, hi) in zip(self.servers, self.bounds, strict=True):
            header = torch.tensor([hi - lo, total_steps, steps_per_epoch], dtype=torch.int64)
            handles += [self.transport.send(header, server), self.transport.send(self.flat[lo:hi].contiguous(), server)]
        for h in handles:
            h.wait()

    def after_backward(self, ctx: StepContext) -> None:
        torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel()) for p in self.params], out=self.grad)
        if self.push is not None:
            info, dense = self._push_info(ctx)
            if self.momentum and self.config.optim.weight_decay:  # the servers' SGD has none
                self.grad.add_(torch.cat([p.detach().reshape(-1) for p in self.params]), alpha=self.config.optim.weight_decay)
        self.clock += 1
        self._clock_header[0] = self.clock
        handles: list[Handle] = []
        for shard, (server, (lo, hi)) in enumerate(zip(self.servers, self.bounds, strict=True)):
            handles.append(self.transport.send(self._clock_header, server))
            if self.push is None:
                handles.append(self.transport.send(self.grad[lo:hi], server))
            else:
                info.key = shard
                handles += send_message(self.transport, self.push.encode(self.grad[lo:hi], info, dense=dense), server)
            handles.append(self.transport.recv(self.flat[lo:hi], server))
        for h in handles:
            h.wait()
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(self.flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    def apply_update(self, ctx: StepContext) -> None:
        """The servers took the optimizer step."""

    def metrics(self) -> dict[str, float]:
        if self.push is None:
            return {}
        adaptive = {} if self.adaptive is None else self.adaptive.metrics(self.transport)
        return {"compress_ratio": self.ratio, **adaptive}

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"clock": self.clock}
        if self.push is not None:
            state["compressor"] = self.push.compressor.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.clock = int(state.get("clock", 0))
        if self.push is not None and "compressor" in state:
            self.push.compressor.load_state_dict(state["compressor"])


class ShardServer:
    """One server process: owns a shard of the parameters and its optimizer state."""

    def __init__(self, cfg: TrainConfig, transport: Transport, run_dir: str | Path) -> None:
        self.cfg = cfg
        self.transport = transport
        self.run_dir = Path(run_dir)
        self.num_workers = cfg.cluster.workers
        self.index = transport.rank - self.num_workers
        header = torch.zeros(HEADER, dtype=torch.int64)
        transport.recv(header, 0).wait()
        numel, self.total_steps, self.steps_per_epoch = (int(v) for v in header)
        if numel <= 0 or numel > 2**34 or self.total_steps <= 0:
            raise WorkerFailure(f"server {self.index}: malformed start header {header.tolist()} from worker 0")
        self.shard = torch.nn.Parameter(torch.empty(numel))
        transport.recv(self.shard.data, 0).wait()
        o = cfg.optim
        peak = scaled_lr(o.lr, self.num_workers * cfg.data.batch_size, o.reference_batch, enabled=o.lr_scaling)
        self.schedule = LRSchedule(peak_lr=peak, base_lr=min(o.lr, peak), warmup_steps=round(o.warmup_epochs * self.steps_per_epoch),
                                   total_steps=self.total_steps, decay=o.lr_decay)
        momentum, weight_decay = o.momentum, o.weight_decay
        if worker_momentum(cfg):  # the workers applied both before compressing
            momentum, weight_decay = 0.0, 0.0
        self.optimizer = build_optimizer(o.optimizer, [self.shard], lr=peak, momentum=momentum, weight_decay=weight_decay)
        self.shard.grad = torch.zeros(numel)
        self.updates = 0
        c = cfg.compress
        self.decoder = (None if c.compress.strip() == "none"
                        else PushDecoder(build_compressor(c.compress, error_feedback=False, seed=cfg.run.seed), numel))

    def _recv_push(self, out: torch.Tensor, worker: int) -> Handle | None:
        """Receive ``worker``'s gradient push into ``out``: a handle to wait for when dense, else
        decoded here (a compressed push's size is known only once its header arrived)."""
        if self.decoder is None:
            return self.transport.recv(out, worker)
        out.copy_(self.decoder.recv(self.transport, worker))
        return None

    def _step(self, grad: torch.Tensor, schedule_step: int) -> None:
        self.shard.grad.copy_(grad)
        self.schedule.apply(self.optimizer, schedule_step)
        self.optimizer.step()
        self.updates += 1

    def run(self, start_step: int = 0, watch: Any = None) -> None:
        self.watch = watch
        if self.cfg.ps.ps_mode == "sync":
            self._run_sync(start_step)
        else:
            self._run_async()

    def _run_sync(self, start_step: int) -> None:
        workers = range(self.num_workers)
        clocks = torch.zeros(self.num_workers, 1, dtype=torch.int64)
        grads = torch.zeros(self.num_workers, self.shard.numel())
        every = self.cfg.run.checkpoint_every
        for step in range(start_step, self.total_steps):
            maybe_injected_kill(self.transport.rank, step)  # fault injection for tests
            if self.watch is not None:
                self.watch.step = step
            handles = [self.transport.recv(clocks[w], w) for w in workers]
            handles += [h for w in workers if (h := self._recv_push(grads[w], w)) is not None]
            for h in handles:
                h.wait()
            if not bool((clocks == step + 1).all()):
                raise WorkerFailure(f"server {self.index}: step {step + 1} expected, workers sent clocks {clocks.view(-1).tolist()}")
            self._step(grads.sum(0).div_(self.num_workers), step)
            for h in [self.transport.send(self.shard.data, w) for w in workers]:
                h.wait()
            if every and (step + 1) % every == 0:
                self.save(step + 1)
            if self.watch is not None and self.watch.stop.requested.is_set():  # SIGTERM: the workers' agreed step
                stop_at = self.watch.agreed_step(step, synchronous=True)
                if step + 1 >= stop_at:
                    if not (every and (step + 1) % every == 0):
                        self.save(step + 1)
                    return
        if not (every and self.total_steps % every == 0):
            self.save(self.total_steps)

    def _run_async(self) -> None:
        """Apply pushes in arrival order; hold back answers to workers too far ahead."""
        n, limit = self.num_workers, self.cfg.ps.max_staleness
        clocks = [0] * n
        waiting: deque[int] = deque()
        header = torch.zeros(1, dtype=torch.int64)
        grad = torch.zeros(self.shard.numel())
        for _ in range(n * self.total_steps):
            worker = self.transport.recv_any(header)
            clock = int(header[0])
            if not (0 <= worker < n) or clock != clocks[worker] + 1:
                raise WorkerFailure(f"server {self.index}: unexpected push (worker {worker}, clock {clock})")
            handle = self._recv_push(grad, worker)
            if handle is not None:
                handle.wait()
            clocks[worker] = clock
            self._step(grad.div_(n), self.updates // n)
            waiting.append(worker)
            slowest = min(clocks)
            for w in [w for w in waiting if clocks[w] - slowest <= limit]:
                waiting.remove(w)
                self.transport.send(self.shard.data, w).wait()
        if waiting:
            raise WorkerFailure(f"server {self.index}: workers {list(waiting)} still waiting at the end")
        self.save(self.total_steps)

    def save(self, step: int) -> None:
        from distrain.train.checkpoint import CheckpointStore

        store = CheckpointStore(self.run_dir, self.transport.rank, self.transport.world_size)
        store.save(step, {"shard": self.shard.data, "optimizer": self.optimizer.state_dict(), "step": step,
                          "model_name": self.cfg.model.model, "algorithm_name": "ps",
                          "world_size": self.transport.world_size})

    def load(self, step: int) -> None:
        from distrain.train.checkpoint import CheckpointStore

        state = CheckpointStore(self.run_dir, self.transport.rank, self.transport.world_size).load(step)
        self.shard.data.copy_(state["shard"])
        self.optimizer.load_state_dict(state["optimizer"])


def serve(cfg: TrainConfig, run_dir: str | Path, control_group: Any = None) -> None:
    """Run one parameter server until the workers' budget is used; then join the final gather."""

    watch = FaultWatch(dist.get_rank(), role="server")
    try:
        _serve(cfg, run_dir, watch)
    except Exception as exc:
        replacement = watch.explain(exc)
        if replacement is exc:
            raise
        raise replacement from exc
    finally:
        watch.close()


def _serve(cfg: TrainConfig, run_dir: str | Path, watch: FaultWatch) -> None:
    from distrain.emulation import Emulation
    from distrain.train.checkpoint import CheckpointStore

    emulation = Emulation.from_config(cfg.network, seed=cfg.run.seed, workers=cfg.cluster.workers)
    transport = Transport(link_model=emulation.link_model)  # servers' links are emulated too
    emulation.start()
    start = time.perf_counter()
    server = ShardServer(cfg, transport, run_dir)
    resume = CheckpointStore(run_dir, transport.rank, transport.world_size).resolve(cfg.run.resume)
    start_step = 0
    if resume is not None:
        server.load(resume)
        start_step = resume
    server.run(start_step, watch)
    wall = time.perf_counter() - start
    # Join the workers' final gather of counters (train.loop), as a row that trained no samples.
    mine = torch.tensor([0, 0, wall, 0.0, transport.stats.comm_seconds, *transport.stats.sent, *transport.stats.received],
                        dtype=torch.float64)
    transport.control_all_gather(mine)
    transport.control_barrier()
