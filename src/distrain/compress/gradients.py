"""Compressed gradient averaging for data-parallel training: what ``--compress`` does each step.

Per step, after backward:

1. every gradient is copied into one flat vector: first the tensors of two or more dimensions
   (weights), then the one-dimensional ones (biases, normalisation scales);
2. with momentum correction the optimizer's momentum is applied here, per worker, before
   compression (see :mod:`~distrain.compress.momentum_correction`);
3. during the density warm-up the whole vector is all-reduced densely; afterwards the weights
   part is compensated (error feedback), compressed and summed through the collective the
   compressor calls for, while the one-dimensional part, a small fraction of the parameters that
   sparsification would starve, is summed densely (as PyTorch's PowerSGD hook does): with a
   sparsifier it rides in the same sparse collective, every one of its elements kept, so a step
   pays one collective's rounds of latency, not two;
4. the sum is divided by the number of workers and copied back into the gradients.

With ``--compress adaptive:...`` the algorithm's :class:`~distrain.compress.adaptive.AdaptivePolicy`
picks the ratio of step 3 on each worker (``average(ratio=...)``; the sparse ring takes a different
k on every worker), and the exchange carries every worker's congestion: one value per worker rides
with the dense one-dimensional part, so each worker knows the slowest link of the step, which
paces a synchronous all-reduce.
"""

from __future__ import annotations

import logging
import warnings

import torch

from distrain.comm.ring import ring_all_reduce
from distrain.comm.sparse_ring import SPARSE_COLLECTIVES, sparse_allgather_allreduce
from distrain.comm.transport import Transport
from distrain.compress.adaptive import AdaptivePolicy
from distrain.compress.base import CompressInfo, Compressor
from distrain.compress.collective import allreduce_compressed
from distrain.compress.error_feedback import ErrorFeedback
from distrain.compress.momentum_correction import MomentumCorrection
from distrain.compress.settings import CompressionSettings
from distrain.compress.warmup import DensityWarmup

log = logging.getLogger(__name__)

WEIGHTS, ONE_DIM = 0, 1  # memory keys of the two parts of the flat vector


def sgd_momentum(optimizer: torch.optim.Optimizer) -> tuple[float, float] | None:
    """(momentum, weight decay) of a plain heavy-ball SGD optimizer, which momentum correction can
    take over: ``torch.optim.SGD`` with one momentum in (0, 1), no Nesterov, no dampening and one
    weight decay across its parameter groups; None for any other optimizer."""
    groups = optimizer.param_groups
    if not isinstance(optimizer, torch.optim.SGD) or not groups:
        return None
    momentum = {g["momentum"] for g in groups}
    decay = {g["weight_decay"] for g in groups}
    plain = all(not g.get("nesterov") and not g.get("dampening") for g in groups)
    if len(momentum) != 1 or len(decay) != 1 or not plain or not 0 < next(iter(momentum)) < 1:
        return None
    return float(next(iter(momentum))), float(next(iter(decay)))


#: The key, in each parameter group of an optimizer whose momentum and weight decay were taken
#: out, of the (momentum, weight decay) taken: taking them again (an algorithm built again over
#: the survivors of a lost worker, a run resumed from a checkpoint of that optimizer) gives them.
TAKEN = "distrain_taken_momentum"


def take_momentum(optimizer: torch.optim.Optimizer) -> tuple[float, float]:
    """Move momentum and weight decay out of a plain SGD optimizer: returns (momentum, weight decay).

    Returns (0, 0) and leaves the optimizer alone unless :func:`sgd_momentum` accepts it, or the
    values an earlier call took out of it.
    """
    groups = optimizer.param_groups
    if groups and all(TAKEN in g for g in groups):
        return tuple(groups[0][TAKEN])  # type: ignore[return-value]
    taken = sgd_momentum(optimizer)
    if taken is None:
        return 0.0, 0.0
    for g in groups:
        g["momentum"], g["weight_decay"], g[TAKEN] = 0.0, 0.0, list(taken)
    return taken


class GradientCompression:
    """Averages a model's gradients over all workers through a compressor.

    Args:
        compressor: e.g. from :func:`build_compressor`; a sparsifier wrapped in
            :class:`MomentumCorrection` gets the optimizer's momentum applied here.
        params: the parameters whose ``.grad`` are averaged.
        density: the density warm-up schedule.
        sparse_collective: ``"ring"`` or ``"allgather"`` for sparse payloads.
        own_ring: dense all-reduces over our point-to-point ring instead of the backend's.
        weight_decay: folded into the gradient here when the optimizer's was taken out.
        policy: the adaptive policy whose congestion each step's exchange shares with the other
            workers (set by the algorithm, which asks it for the ratio); None without one.

    Example::

        compression = GradientCompression.from_settings(settings, params, optimizer, seed=0)
        loss.backward()
        compression.average(transport, step=step, epochs_done=step / steps_per_epoch)
        optimizer.step()
    """

    def __init__(self, compressor: Compressor, params: list[torch.nn.Parameter], density: DensityWarmup,
                 *, sparse_collective: str = "ring", own_ring: bool = False, weight_decay: float = 0.0,
                 policy: AdaptivePolicy | None = None) -> None:
        self.compressor = compressor
        weights = [p for p in params if p.dim() > 1]
        self.params = weights + [p for p in params if p.dim() <= 1]
        self.sizes = [p.numel() for p in self.params]
        self.split = sum(p.numel() for p in weights)
        like = params[0] if params else torch.empty(0)
        self.flat = torch.empty(sum(self.sizes), dtype=like.dtype, device=like.device)
        self.density = density
        self.sparse_collective = sparse_collective
        self.own_ring = own_ring
        self.weight_decay = weight_decay
        self.policy = policy
        self.ratio = 1.0
        self.step_bytes_sent = 0

    @classmethod
    def from_settings(cls, settings: CompressionSettings, params: list[torch.nn.Parameter],
                      optimizer: torch.optim.Optimizer, *, seed: int, own_ring: bool = False) -> GradientCompression | None:
        """Build from an algorithm's compression settings; None for ``--compress none``.

        ``seed`` is the run's. With momentum correction a sparsifier takes the momentum and weight
        decay out of a plain SGD ``optimizer``."""
        if not settings.enabled:
            return None
        compressor = settings.compressor(seed)
        weight_decay = 0.0
        if settings.momentum_correction and isinstance(compressor, ErrorFeedback) and compressor.ratio is not None:
            momentum, weight_decay = take_momentum(optimizer)
            if momentum > 0:
                compressor = MomentumCorrection(compressor.inner, momentum, masking=settings.momentum_masking)
            else:
                log.info("momentum correction needs SGD with momentum; %s keeps its optimizer as is", compressor.name)
        if compressor.name == "adaptive" and settings.sparse_collective == "allgather":
            warnings.warn("--compress adaptive with --sparse-collective allgather: messages are padded to the "
                          "largest worker's k and timed at the slowest link's pace; --sparse-collective ring "
                          "lets each worker's ratio and link count", stacklevel=2)
        return cls(compressor, params, settings.warmup(compressor.ratio), sparse_collective=settings.sparse_collective,
                   own_ring=own_ring, weight_decay=weight_decay)

    def _gather(self) -> None:
        grads = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=self.flat.dtype,
                 device=self.flat.device) for p in self.params]
        torch.cat(grads, out=self.flat)
        if self.weight_decay:
            self.flat.add_(torch.cat([p.detach().reshape(-1) for p in self.params]), alpha=self.weight_decay)

    def _scatter(self) -> None:
        for p, chunk in zip(self.params, self.flat.split(self.sizes), strict=True):
            if p.grad is None:
                p.grad = chunk.view_as(p).clone()
            else:
                p.grad.copy_(chunk.view_as(p))

    def _dense_all_reduce(self, transport: Transport, tensor: torch.Tensor) -> None:
        if not tensor.numel():
            return
        if self.own_ring:
            ring_all_reduce(transport, tensor)
        else:
            transport.all_reduce(tensor).wait()

    def _sparse_with_dense_tail(self, transport: Transport, info: CompressInfo,
                                extra: torch.Tensor | None = None, *, same_size: bool = False) -> torch.Tensor:
        """Sum the compressed weights part, the whole one-dimensional part and ``extra`` (dense
        values appended after the gradient: the adaptive policy's shared slots) in one sparse
        collective; returns the sum of ``extra`` (empty if None). ``same_size``: every worker
        compresses with the same ratio, so the all-gather needs no exchange of sizes."""
        if self.sparse_collective not in SPARSE_COLLECTIVES:
            raise ValueError(f"sparse_collective must be one of {sorted(SPARSE_COLLECTIVES)}, got {self.sparse_collective!r}")
        extra = self.flat.new_zeros(0) if extra is None else extra
        numel = self.flat.numel() + extra.numel()
        (indices, values), _ = self.compressor.compress(self.flat[: self.split], info)
        tail = torch.arange(self.split, numel, dtype=indices.dtype, device=indices.device)
        indices = torch.cat([indices, tail])
        values = torch.cat([values.to(self.flat.dtype), self.flat[self.split :], extra.to(self.flat.dtype)])
        if self.sparse_collective == "allgather":
            total = sparse_allgather_allreduce(transport, indices, values, numel, same_size=same_size)
        else:
            total = SPARSE_COLLECTIVES[self.sparse_collective](transport, indices, values, numel)
        self.flat.copy_(total[: self.flat.numel()])
        return total[self.flat.numel() :]

    def average(self, transport: Transport, *, step: int, epochs_done: float, ratio: float | None = None) -> None:
        """Replace every parameter's gradient with the (compressed) average over all workers.

        Args:
            transport: this worker's transport.
            step: the training step (seeds, error-feedback bookkeeping).
            epochs_done: training progress, for the density warm-up.
            ratio: this worker's kept ratio for this step, replacing the warm-up schedule's once
                the dense warm-up is over (adaptive compression); workers may differ.
        """
        sent_before = transport.stats.bytes_sent
        self._gather()
        weights, one_dim = self.flat[: self.split], self.flat[self.split :]
        mc = self.compressor if isinstance(self.compressor, MomentumCorrection) else None
        if mc is not None:
            one_dim.copy_(mc.accumulate(one_dim, ONE_DIM))
        if self.density.dense(epochs_done):
            if mc is not None:
                weights.copy_(mc.accumulate(weights, WEIGHTS))
            self._dense_all_reduce(transport, self.flat)
            self.ratio = 1.0
        else:
            per_worker = ratio is not None and self.compressor.ratio is not None
            if not per_worker:
                ratio = self.density.ratio(epochs_done)
            info = CompressInfo(step=step, key=WEIGHTS, ratio=ratio, worker=transport.rank)
            dense = not per_worker and self._dense_is_cheaper(ratio, transport.world_size)
            if dense:
                self._dense_step(transport, weights, mc)
            elif weights.numel() and one_dim.numel() and self.compressor.sparse:
                shared = None if self.policy is None else self._shared_slots(transport)
                # the schedule's ratio is the same on every worker; a per-worker one may not be
                summed = self._sparse_with_dense_tail(transport, info, shared, same_size=not per_worker)
                if self.policy is not None:
                    self.policy.observe_cluster(summed.tolist())
            else:
                if weights.numel():
                    weights.copy_(allreduce_compressed(transport, self.compressor, weights, info,
                                                       sparse_collective=self.sparse_collective, own_ring=self.own_ring))
                if self.policy is None:
                    self._dense_all_reduce(transport, one_dim)
                else:
                    self._share_and_all_reduce(transport, one_dim)
            if dense:
                self.ratio = 1.0
            else:
                self.ratio = ratio if ratio is not None else self.compressor.wire_bytes(self.split) / max(1, self.flat.element_size() * self.split)
        self.flat.div_(transport.world_size)
        self._scatter()
        self.step_bytes_sent = transport.stats.bytes_sent - sent_before

    def _shared_slots(self, transport: Transport) -> torch.Tensor:
        """One slot per worker, this worker's holding its policy's congestion: summed over
        workers, every worker gets every worker's."""
        assert self.policy is not None
        shared = torch.zeros(transport.world_size, dtype=self.flat.dtype, device=self.flat.device)
        shared[transport.rank] = self.policy.shared_value()
        return shared

    def _share_and_all_reduce(self, transport: Transport, one_dim: torch.Tensor) -> None:
        """All-reduce ``one_dim`` with one more slot per worker (see :meth:`_shared_slots`), in
        the exchange that happens anyway."""
        assert self.policy is not None
        both = torch.cat([one_dim, self._shared_slots(transport)])
        self._dense_all_reduce(transport, both)
        one_dim.copy_(both[: one_dim.numel()])
        self.policy.observe_cluster(both[one_dim.numel():].tolist())

    def _dense_is_cheaper(self, ratio: float | None, world: int) -> bool:
        """The dense fallback: with the sparse all-gather every worker receives every other's
        (index, value) pairs, (n - 1) k of them, while a ring all-reduce moves 2 (n - 1) / n of the
        dense vector; at a kept ratio of 1 / n or more (a density warm-up's first steps, say) the
        dense step costs no more bytes and holds nothing back. (The sparse ring switches each
        chunk to dense by itself once the sum fills in.)"""
        return (self.compressor.sparse and self.sparse_collective == "allgather" and ratio is not None
                and world > 1 and ratio * world >= 1)

    def _dense_step(self, transport: Transport, weights: torch.Tensor, mc: MomentumCorrection | None) -> None:
        """Send everything: the weights' gradient (their velocity, with momentum correction)
        plus what error feedback held back, which is then empty; nothing is masked."""
        sent = mc.accumulate(weights, WEIGHTS) if mc is not None else weights
        if isinstance(self.compressor, ErrorFeedback):
            sent = self.compressor.compensate(sent, WEIGHTS)
            self.compressor.residuals.pop(WEIGHTS, None)
        weights.copy_(sent)
        self._dense_all_reduce(transport, self.flat)

    def metrics(self) -> dict[str, float]:
        """For metrics.jsonl: the ratio of the last step, its bytes, and the policy's signals."""
        out = {"compress_ratio": self.ratio, "step_bytes_sent": self.step_bytes_sent}
        if self.policy is not None:
            out.update(self.policy.metrics())
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = self.compressor.state_dict()
        if self.policy is not None:
            state.update({f"adaptive.{k}": v for k, v in self.policy.state_dict().items()})
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if self.policy is not None:
            self.policy.load_state_dict({k.split(".", 1)[1]: v for k, v in state.items() if k.startswith("adaptive.")})
        self.compressor.load_state_dict({k: v for k, v in state.items() if not k.startswith("adaptive.")})
