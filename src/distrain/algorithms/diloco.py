"""DiLoCo: local steps with an outer optimizer (Douillard et al. 2023), and its streaming form.

Each worker takes ``--sync-every H`` steps with its own (inner) optimizer on its own shard, then
the workers average their pseudo-gradients, ``delta = start - local`` (how far each moved from
the parameters the period started from), through the Transport (so emulation and byte counts
apply), and an outer optimizer steps the shared parameters with the averaged delta as its
gradient. Every worker then starts the next period from the new shared parameters; the inner
optimizer keeps its state across periods. Communication is one all-reduce of the model every H
steps instead of every step.

Outer optimizers (``--outer-optimizer``, ``--outer-lr``, ``--outer-momentum``):
    nesterov: SGD with Nesterov momentum, ``buf = mu * buf + delta``, ``start -= lr * (delta +
        mu * buf)``; the paper's choice (lr 0.7, momentum 0.9).
    sgd: heavy-ball SGD, ``buf = mu * buf + delta``, ``start -= lr * buf``; with lr 1 and
        momentum 0 the shared parameters become the workers' average (local SGD, model
        averaging), and with H = 1 and plain inner SGD that is all-reduce SGD.

Streaming (Douillard et al. 2025, ``--fragments F``, ``--overlap-steps T``): the parameters are
cut into F fragments of consecutive tensors of similar size; fragment i syncs when the inner step
count is ``(i + 1) * H // F`` modulo H, so every parameter syncs once per period while the
network carries one fragment at a time (peak bandwidth about F times lower). With T > 0 a
fragment's exchange overlaps the next T inner steps; its outer step is applied T steps after the
sync, and the result is merged into the fragment as the worker has it then:
``local = w * shared + (1 - w) * local`` (``--merge-weight w``). By default w = 1: the fragment
takes the shared parameters, as with T = 0 (and as torchft's ``fragment_update_alpha = 0``), so
the replicas agree after every merge. The paper's w = 0.5 keeps half of each worker's own
fragment, so the replicas never agree: on the GPT micro over a LAN (4 workers, 256 steps of
Adam, H = 64, 4 fragments, T = 4, plain averaging) it ended 0.08 to 0.42 nats above w = 1 on
seeds 0, 1 and 2 (``benchmarks/BENCHMARKS.md``).

``--sync-every auto`` lets the run choose H: at every sync the workers measure how long the last
exchange took (the emulated link's delay where the link model times it, else its measured time)
and how long an inner step computed, each proposes ``ceil(sync / (overhead * step))`` within
``--sync-every-min`` and ``--sync-every-max`` (``--comm-overhead``: 0.1, syncing costs a tenth of
the compute), and all take the mean of the proposals (one all-reduce of a number), so that H
follows the network as a bandwidth trace changes it. The first period is ``--sync-every-min``
steps; every period's H is in the metrics (``sync_every``, ``sync_seconds``). It needs
``--fragments 1``.

With ``--compress`` the pseudo-gradient is compressed before it is exchanged (``int8`` and
``int4`` block quantization, ``fp16``/``bf16``, ``topk``/``group_topk``/``randomk``, ``qsgd``,
``sparseloco``: chunked top-k with 2-bit values), with error feedback (``--error-feedback on``,
the default): what a worker's pseudo-gradient lost to compression is added to its next one (its
residual kept in CPU memory; ``sparseloco:R:decay=D`` decays it, which SparseLoCo pairs with
``--outer-optimizer sgd --outer-lr 1 --outer-momentum 0``). Summable payloads are all-reduced, sparse ones go
through the sparse ring (``--sparse-collective``), the others are gathered and summed after
decoding. A compressed exchange completes at the sync step (only a dense one overlaps the inner
steps); its outer step is still applied T steps later.

The shared parameters and the outer momentum are kept in CPU memory (float32), whatever the
model's device. The evaluated model (:meth:`DiLoCo.eval_model`) holds the shared parameters. The
last step of a run, and :meth:`DiLoCo.end` after a stop between syncs, sync whatever has moved
since its last sync and apply every pending exchange, so the final model includes every step.

Elastic runs (``--min-workers`` below ``--workers``; every configuration): the survivors of a
lost worker find it gone at an exchange and do that exchange again among themselves, each sending what it sent before (a compressed one
compressed again from its residuals as the sync began), and a worker started again joins at a
round's end with the shared parameters, the outer momentum, a member's inner optimizer state and
the sum of any exchange still in flight; its parameters start from the shared ones.

It runs with :class:`DiLoCoSettings`, which :mod:`distrain.assemble` makes from the flags.

Example::

    distrain train --algorithm diloco --sync-every 32 --outer-lr 0.7 --outer-momentum 0.9
    distrain train --algorithm diloco --sync-every 64 --fragments 4 --overlap-steps 2 --compress int4
    distrain train --algorithm diloco --compress sparseloco:0.02:decay=0.95 --outer-optimizer sgd --outer-lr 1 --outer-momentum 0
    opt = distrain.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-4), algorithm="diloco",
                        sync_every=64)
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from distrain.algorithms.base import Algorithm, RunFacts, StepContext, clone_state, copy_module
from distrain.comm.transport import Handle, Transport
from distrain.compress.base import CompressInfo
from distrain.compress.collective import allreduce_compressed
from distrain.compress.settings import CompressionSettings

log = logging.getLogger(__name__)

#: ``--sync-every auto`` (the value ``distrain.config.AUTO``; the algorithms do not import the config)
AUTO = "auto"


def propose_sync_every(sync_seconds: float | None, step_seconds: float | None, overhead: float, low: int, high: int,
                       *, current: int) -> int:
    """The H at which an exchange of ``sync_seconds`` costs ``overhead`` of the compute of H
    steps of ``step_seconds`` each: ``ceil(sync / (overhead * step))``, within [low, high];
    ``current`` while either time is unknown.

        >>> propose_sync_every(0.5, 0.01, 0.1, 4, 512, current=4)   # 0.5 s against 1 ms of a step's 10 ms
        500
    """
    if not sync_seconds or not step_seconds or step_seconds <= 0:
        return current
    return min(high, max(low, math.ceil(sync_seconds / (overhead * step_seconds))))


def fragment_bounds(sizes: list[int], fragments: int) -> list[tuple[int, int]]:
    """Cut consecutive tensors of ``sizes`` into at most ``fragments`` groups of similar total
    size; returns each group's ``[lo, hi)`` range in the flat vector (every element in one)."""
    total = sum(sizes)
    bounds, lo, offset, index = [], 0, 0, 1
    for size in sizes:
        offset += size
        if index < fragments and offset >= total * index / fragments and offset > lo:
            bounds.append((lo, offset))
            lo, index = offset, index + 1
    if offset > lo or not bounds:
        bounds.append((lo, offset))
    return bounds


def sync_offsets(sync_every: int, fragments: int) -> list[int]:
    """When each of ``fragments`` fragments syncs: the inner step count modulo ``sync_every``
    (fragment i at ``(i + 1) * H // F``, the last at the period's end, 0)."""
    return [((i + 1) * sync_every // fragments) % sync_every for i in range(fragments)]


@dataclass(frozen=True, kw_only=True)
class DiLoCoSettings:
    """What DiLoCo runs with."""

    #: inner steps between syncs (H), or :data:`AUTO`: H follows the measured step and sync times
    sync_every: int | str
    #: with :data:`AUTO`: the share of compute time syncing may cost, and the bounds of H (the
    #: first period's H is the smallest)
    comm_overhead: float
    sync_every_min: int
    sync_every_max: int
    #: the optimizer of the shared parameters: ``nesterov`` or ``sgd``; its learning rate and momentum
    outer_optimizer: str
    outer_lr: float
    outer_momentum: float
    #: streaming: fragments synced each at its own step of the period, inner steps their exchange
    #: overlaps, and the synced fragment's weight when merged after an overlap
    fragments: int
    overlap_steps: int
    merge_weight: float
    #: how the pseudo-gradient is compressed (``none``: sent dense)
    compression: CompressionSettings
    run: RunFacts


@dataclass
class _Pending:
    """A fragment's exchange in flight: applied at inner step ``due``."""

    fragment: int
    due: int
    delta: torch.Tensor  # the summed pseudo-gradient (complete once ``handle`` is waited for)
    handle: Handle | None
    count: int  # the workers whose pseudo-gradients the sum holds (its mean divides by them)
    #: elastic runs, a dense exchange: this worker's own pseudo-gradient as it was sent (the
    #: sum overwrites ``delta`` in place), which a redo over the survivors sends again
    own: torch.Tensor | None = None
    #: a lost peer interrupted it: ``delta`` holds ``own`` again, to be exchanged over the survivors
    lost: bool = False


class DiLoCo(Algorithm):
    """H inner steps per worker, then an outer step on the averaged pseudo-gradient."""

    name = "diloco"
    replicated = False  # the workers' models part between syncs
    compresses = True  # the pseudo-gradient
    local_steps = True  # the inner optimizer's learning rate is scaled for the local batch
    rescales_lr = False  # ... so it does not change with the members
    # Elastic: an exchange a lost peer interrupted is redone over the survivors with their own
    # pseudo-gradients as they were sent (the inner steps are local; with --overlap-steps the
    # worker has stepped on since), compressed from the compressor's state as the sync began, and
    # a worker that joins enters at a round's end (with empty residuals of its own) holding the
    # shared parameters and any exchange still to be applied. With --sync-every auto, the
    # survivors then agree on the next period's H among themselves (once the redone exchange is
    # applied: --overlap-steps on), and a joiner takes the members' H and next sync (entering
    # with an exchange in flight, it takes part in the agreement that follows its apply).
    elastic = True
    redo_needs_gradients = False
    redo_when_behind = True
    settings: DiLoCoSettings

    @classmethod
    def survives(cls, settings: DiLoCoSettings) -> bool:
        r = settings.run
        return r.device == "cpu" and 1 < r.workers and r.min_workers < r.workers

    def state_before_step(self) -> dict[str, Any] | None:
        """With a compressor: the state with its compressor's as the interrupted sync began
        (compressing the pseudo-gradient moved the error-feedback residuals; the redo compresses
        the same pseudo-gradient again)."""
        return None if self._before is None else {**self.state_dict(), "compressor": self._before}

    def __init__(self, settings: DiLoCoSettings) -> None:
        super().__init__(settings, settings.compression)
        s = settings
        #: ``--sync-every auto``: H follows the measured step and sync times (see :meth:`_next_period`)
        self.auto = s.sync_every == AUTO
        self.sync_every = int(s.sync_every_min) if self.auto else int(s.sync_every)
        self.comm_overhead = float(s.comm_overhead)
        self.h_min, self.h_max = int(s.sync_every_min), int(s.sync_every_max)
        self.next_sync = self.sync_every  # auto: the inner step of the next sync
        self._sync_seconds: float | None = None  # how long the last completed exchange took
        self._step_seconds: float | None = None  # compute seconds per inner step of the last period
        self._recorded_at_sync = 0  # transport.stats.recorded when the pending exchange started
        self._proposed: int | None = None  # this worker's proposal for H at the last sync
        self._choose_h = False  # auto: a period's sync is applied and the next H not agreed yet
        #: the inner step count of the sync before the last one (the round a lost worker's
        #: progress died in began there, see :meth:`kept_steps`)
        self.previous_sync = 0
        self.nesterov = s.outer_optimizer == "nesterov"
        self.outer_lr, self.outer_momentum = float(s.outer_lr), float(s.outer_momentum)
        self.fragments_wanted, self.overlap = int(s.fragments), int(s.overlap_steps)
        self.merge_weight = float(s.merge_weight) if self.overlap else 1.0
        self.inner_steps = 0  # inner steps taken since the run started
        self.outer_steps = 0  # fragment syncs applied
        self.total_steps: int | None = None
        self._eval: torch.nn.Module | None = None
        self._last_delta_norm = 0.0
        self._pending: list[_Pending] = []
        self._resumed = False  # load_state_dict restored the periods' starts
        self._compute_since_sync = 0.0  # compute seconds of the inner steps since the last sync
        self._last_ratio = 0.0  # the adaptive policy's last ratio for a round
        self._interrupted: list[int] = []  # fragments whose exchange a lost peer interrupted (elastic)
        self._before: dict[str, Any] | None = None  # see state_before_step

    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, transport: Transport) -> None:
        super().setup(model, optimizer, transport)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.bounds = fragment_bounds([p.numel() for p in self.params], self.fragments_wanted)
        count = len(self.bounds)
        #: when fragment i syncs: the inner step count modulo H
        self.offsets = sync_offsets(self.sync_every, count)
        #: the inner step count at each fragment's last sync
        self.synced_at = [0] * count
        #: the shared parameters each fragment's period started from (CPU, float32)
        self.shared = self._flat().to("cpu", torch.float32, copy=True)
        #: the outer optimizer's momentum (CPU); a fragment's part is set at its first outer step
        self.buffer = torch.zeros_like(self.shared)
        self.has_buffer = [False] * count
        c = self.settings.compression
        #: the pseudo-gradient's compressor (with error feedback when lossy and asked for), or None
        self.compressor = c.compressor(self.settings.run.seed, residual_device="cpu") if c.enabled else None

    def _flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def _fragment_views(self, fragment: int) -> list[tuple[torch.nn.Parameter, int, int]]:
        """(parameter, lo, hi) in the flat vector for the parameters inside ``fragment``."""
        lo, hi = self.bounds[fragment]
        out, offset = [], 0
        for p in self.params:
            if lo <= offset < hi:
                out.append((p, offset, offset + p.numel()))
            offset += p.numel()
        return out

    def _local(self, fragment: int) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p, _, _ in self._fragment_views(fragment)])

    def start(self, total_steps: int, steps_per_epoch: int) -> None:
        self.total_steps = total_steps
        if not self._resumed:  # parameters loaded after setup (a pretrained model, say) start the first period
            self.shared.copy_(self._flat())

    def after_update(self, ctx: StepContext) -> None:
        self._exchange_again()  # a loss found outside a step (or a checkpoint saved after one)
        self.inner_steps += 1
        self._compute_since_sync += ctx.compute_seconds
        if self.adaptive is not None:
            self.adaptive.observe_losses(ctx.per_sample_losses)
        last = self.inner_steps == self.total_steps
        for i, offset in enumerate(self.offsets):
            due = self.inner_steps >= self.next_sync if self.auto else self.inner_steps % self.sync_every == offset
            if due or (last and self.inner_steps > self.synced_at[i]):
                if self.auto and due:
                    self._period_ends()
                self._start_sync(i)
        if self._apply_due(flush=last) and self.auto and not last:
            self._next_period()

    def _period_ends(self) -> None:
        """``--sync-every auto``, as a sync starts: this period's compute per step, and the next
        sync one period of the current H on until the exchange's own duration chooses it."""
        steps = max(1, self.inner_steps - max(self.synced_at))
        self._step_seconds = self._compute_since_sync / steps
        self.next_sync = self.inner_steps + self.sync_every

    def _next_period(self) -> None:
        """``--sync-every auto``, once a sync's exchange has completed: the workers agree on the
        next period's H from that exchange's duration and the compute per step of the period it
        ended, so that syncing costs about ``--comm-overhead`` of the compute (bounded by
        ``--sync-every-min/max``); the period runs from the sync's start. A change of the link
        thus shows in the period that follows the first exchange over it. Every worker proposes
        its H and they take the mean (one all-reduce of a number), so all agree."""
        assert self.transport is not None
        self._choose_h = True  # until the workers agree (a loss on the way leaves it owed to the redo)
        wanted = propose_sync_every(self._sync_seconds, self._step_seconds, self.comm_overhead, self.h_min, self.h_max,
                                    current=self.sync_every)
        self._proposed = wanted
        proposals = torch.tensor([float(wanted)], dtype=torch.float64)
        self.transport.all_reduce(proposals).wait()
        agreed = min(self.h_max, max(self.h_min, round(float(proposals[0]) / self.transport.world_size)))
        if agreed != self.sync_every:
            log.info("diloco: H %d -> %d (last sync %.3f s, %.4f s of compute a step)", self.sync_every, agreed,
                     self._sync_seconds or 0.0, self._step_seconds)
        self.sync_every = agreed
        self.next_sync = max(self.synced_at) + agreed
        self._choose_h = False

    def _start_sync(self, fragment: int) -> None:
        """Start averaging ``fragment``'s pseudo-gradient; its outer step is applied when due."""
        assert self.transport is not None
        lo, hi = self.bounds[fragment]
        local = self._local(fragment)
        delta = self.shared[lo:hi].to(local.device, local.dtype) - local
        handle = None
        self._recorded_at_sync = self.transport.stats.recorded  # auto times the exchange's messages
        if self.synced_at[fragment] != self.inner_steps:  # (not a redo of this step's sync)
            self.previous_sync = self.synced_at[fragment]
        own = None
        if self.compressor is None:
            own = delta.clone() if self.keep_local else None  # elastic: what a redo sends again
            try:
                handle = self.transport.all_reduce(delta)
            except Exception:
                self._interrupted.append(fragment)  # begun again over the survivors (elastic runs)
                raise
        else:
            info = CompressInfo(step=self.inner_steps, key=fragment, ratio=self._round_ratio(fragment),
                                worker=self.transport.rank)
            if self.keep_local:  # elastic: what a redo of this sync compresses from
                self._before = clone_state(self.compressor.state_dict())
            try:
                delta = allreduce_compressed(self.transport, self.compressor, delta, info,
                                             sparse_collective=self.settings.compression.sparse_collective)
            except Exception:
                self._interrupted.append(fragment)  # redone over the survivors (elastic runs)
                if self._before is not None:  # ... from the residuals as the sync began
                    self.compressor.load_state_dict(clone_state(self._before))
                raise
        self._pending.append(_Pending(fragment, self.inner_steps + self.overlap, delta, handle,
                                      self.transport.world_size, own))
        self.synced_at[fragment] = self.inner_steps
        self._compute_since_sync = 0.0

    def _round_ratio(self, fragment: int) -> float | None:
        """With ``--compress adaptive``: the fragment's ratio for this round, the policy's choice
        with a budget of one per-step ratio for every inner step since the fragment's last sync
        (so a round sends what per-step group top-k at the same ratio would over those steps);
        its spare bandwidth is measured against the compute time since the last choice."""
        if self.adaptive is None:
            return None
        steps = max(1, self.inner_steps - self.synced_at[fragment])
        ratio = self.adaptive.choose(None, self.transport, compute_seconds=self._compute_since_sync, scale=steps)
        self._last_ratio = ratio
        return ratio

    def _apply_due(self, flush: bool = False) -> bool:
        """Apply the exchanges due by now (all of them with ``flush``), in the order they began;
        whether there were any."""
        applied = False
        while self._pending and (flush or self._pending[0].due <= self.inner_steps):
            self._apply(self._pending.pop(0))
            applied = True
        return applied

    def _apply(self, pending: _Pending) -> None:
        """The outer step of one fragment, and its merge into this worker's parameters."""
        assert self.transport is not None
        if pending.handle is not None:
            try:
                pending.handle.wait()
            except Exception:
                self._pending.insert(0, pending)  # redone over the survivors (elastic runs)
                self._exchanges_lost()
                raise
            pending.handle, pending.own = None, None
        if self.auto:
            self._sync_seconds = self._exchange_seconds()
        i = pending.fragment
        lo, hi = self.bounds[i]
        delta = pending.delta.div(pending.count).to("cpu", torch.float32)
        self._last_delta_norm = float(delta.norm())
        mu, buffer = self.outer_momentum, self.buffer[lo:hi]
        if mu > 0:
            if self.has_buffer[i]:
                buffer.mul_(mu).add_(delta)
            else:
                buffer.copy_(delta)
                self.has_buffer[i] = True
            step = delta.add(buffer, alpha=mu) if self.nesterov else buffer
        else:
            step = delta
        self.shared[lo:hi].add_(step, alpha=-self.outer_lr)
        w = self.merge_weight
        with torch.no_grad():
            for p, a, b in self._fragment_views(i):
                shared = self.shared[a:b].view_as(p).to(p.device, p.dtype)
                if w >= 1.0:
                    p.copy_(shared)
                else:
                    p.mul_(1.0 - w).add_(shared, alpha=w)
        self.outer_steps += 1

    def _exchange_seconds(self) -> float:
        """How long the exchange started at the last sync took: the emulated link's delay of its
        messages where the link model times them, else their measured time (start to completion)."""
        assert self.transport is not None
        return sum(e.delay for e in self.transport.stats.since(self._recorded_at_sync))

    def _exchanges_lost(self) -> None:
        """A lost peer broke the group: every dense exchange still in flight on it is to be
        redone over the survivors from this worker's own pseudo-gradient as it was sent (elastic
        runs keep it; otherwise the loss stands)."""
        flying = [p for p in self._pending if p.handle is not None]
        if any(p.own is None for p in flying):
            return
        for p in flying:
            p.delta, p.handle, p.lost = p.own.clone(), None, True

    def _exchange_again(self) -> None:
        """Exchange again, over the current group, every exchange a lost peer interrupted (a
        rebuild's :meth:`state_dict` kept them); each is applied at its step as before."""
        assert self.transport is not None
        for p in self._pending:
            if p.lost:
                self._recorded_at_sync = self.transport.stats.recorded
                p.handle, p.count, p.lost = self.transport.all_reduce(p.delta), self.transport.world_size, False

    def redo(self, ctx: StepContext) -> None:
        """Over the survivors: the exchanges a lost peer interrupted, with this worker's
        pseudo-gradients as they were sent (a compressed one compressed again from the residuals
        as its sync began: the parameters have not moved since), and the outer steps due."""
        interrupted, self._interrupted = self._interrupted, []
        self._exchange_again()
        for fragment in interrupted:
            self._start_sync(fragment)
        applied = self._apply_due(flush=self.inner_steps == self.total_steps)
        if self._choose_h or (applied and self.auto and self.inner_steps != self.total_steps):
            self._next_period()  # the period's end: the survivors choose the next H

    def admission_step(self, proposed: int) -> int:
        """A worker joins at a round's end, where every member holds the shared parameters. With
        ``--sync-every auto`` the rounds after the current one are not known yet: one that
        ``proposed`` passes is taken at the current H (:meth:`before_admission` ends the round
        there if H changes before it)."""
        if self.overlap:  # (see _first_wait)
            proposed = max(proposed, self._first_wait())
        if not self.auto:
            return -(-proposed // self.sync_every) * self.sync_every
        if proposed <= self.next_sync:
            return self.next_sync
        return self.next_sync + -(-(proposed - self.next_sync) // self.sync_every) * self.sync_every

    def _first_wait(self) -> int:
        """With ``--overlap-steps`` T: the first step at which every member still has to look
        for joiners, from this worker's (the proposer's) step. A member waits for a sync's
        exchange only T steps after the sync, so one ahead of this worker may have passed the
        next sync, and looked for joiners at its end, before this worker began it; none passes
        that sync + T. (Without an overlap a member waits within the sync's own step.)"""
        steps = self.inner_steps
        if self.auto:
            sync = self.next_sync if self.next_sync > steps else steps + 1
        else:
            sync = min(steps + 1 + (offset - steps - 1) % self.sync_every for offset in self.offsets)
        return sync + self.overlap

    def before_admission(self) -> None:
        """``--sync-every auto``, at the step the members agreed to admit joiners: if it is not a
        round's end (H changed since the agreement), the members sync there, ending the round
        early, so the joiners enter holding the shared parameters as at any round's end
        (collective: every member is at that step)."""
        if self.inner_steps > max(self.synced_at):
            log.info("diloco: the round ends at step %d, where workers join", self.inner_steps)
            self._period_ends()
            for i in range(len(self.bounds)):
                self._start_sync(i)
            if self._apply_due(flush=True) and self.auto:
                self._next_period()

    @property
    def admission_every(self) -> int:
        """Joiners enter at a round's end only: the members look for them four times a round,
        so one that asks in the first three quarters of a round enters at its end (looking once
        a round let it wait up to two, and short runs ended first: bench_churn's restart case
        failed 8 of 20 against 4 when looking every step)."""
        return max(1, (self.h_min if self.auto else self.sync_every) // 4)  # auto: the same all run long

    def kept_steps(self, lost_at: int) -> int:
        """A worker lost in a round (found in the step after ``lost_at`` steps: at the exchange
        begun there, or at the wait, ``--overlap-steps`` T later, of the one begun T steps before)
        leaves only the rounds whose exchange had completed in the shared parameters: those up to
        the last sync at most ``lost_at - T`` (syncs are more than T steps apart). Streaming, each
        fragment holds the steps up to its own such sync: the fewest over the fragments counts
        (the others learned from some of the later steps' samples too)."""
        if not self.auto:
            h, last = self.sync_every, lost_at - self.overlap
            offsets = getattr(self, "offsets", None) or sync_offsets(h, self.fragments_wanted)  # (before setup)
            return max(0, min((last - offset) // h * h + offset if last >= offset else 0 for offset in offsets))
        # auto: the last sync's exchange completed before the loss unless it was found there
        # (at the sync, also one the members end a round early with to admit joiners, at lost_at;
        # at its wait, T steps on, in step lost_at + 1)
        last = max(self.synced_at)
        return last if last + max(self.overlap, 1) <= lost_at else self.previous_sync

    def replica_state(self) -> list[torch.Tensor]:
        """The shared parameters, the outer momentum, the counters and the exchanges still to be
        applied (each fragment's at most: ``--overlap-steps`` is shorter than the steps between
        two syncs), as fixed shapes: their sums in one vector shaped as the parameters, and per
        fragment its step due (-1: none), the workers it sums and whether it is to be redone."""
        interrupted = torch.zeros(len(self.bounds), dtype=torch.int64)
        interrupted[self._interrupted] = 1
        counters = torch.tensor([self.inner_steps, self.outer_steps, *self.synced_at], dtype=torch.int64)
        periods = torch.tensor([self.sync_every, self.next_sync, self.previous_sync, int(self._choose_h)],
                               dtype=torch.int64)
        sums = torch.zeros_like(self.shared)
        pending = torch.tensor([[-1, 0, 0]] * len(self.bounds), dtype=torch.int64)
        for p in self.state_dict()["pending"]:  # (waited for: complete, or to be redone)
            lo, hi = self.bounds[p["fragment"]]
            sums[lo:hi] = p["delta"]
            pending[p["fragment"]] = torch.tensor([p["due"], p["count"], int(p["lost"])])
        return [self.shared, self.buffer, torch.tensor(self.has_buffer, dtype=torch.int64), counters, interrupted,
                periods, sums, pending]

    def load_replica_state(self, tensors: list[torch.Tensor]) -> None:
        # shared and buffer were broadcast in place
        _, _, has_buffer, counters, interrupted, periods, sums, pending = tensors
        self.has_buffer = [bool(v) for v in has_buffer.tolist()]
        self.inner_steps, self.outer_steps = int(counters[0]), int(counters[1])
        self.synced_at = [int(v) for v in counters[2:].tolist()]
        self._interrupted = [i for i, v in enumerate(interrupted.tolist()) if v]
        sync_every, self.next_sync, self.previous_sync, choose_h = (int(v) for v in periods.tolist())
        self.sync_every, self._choose_h = sync_every, bool(choose_h)
        device = self.params[0].device if self.params else torch.device("cpu")
        flying = sorted((due, i, count, bool(lost)) for i, (due, count, lost) in enumerate(pending.tolist()) if due >= 0)
        self._pending = []
        for due, i, count, lost in flying:
            lo, hi = self.bounds[i]
            delta = sums[lo:hi].to(device, self.params[0].dtype)
            self._pending.append(_Pending(i, due, delta, None, count, delta.clone() if lost else None, lost))
        self._resumed = True

    def entered(self) -> None:
        """A worker that joined holds a member's state: its parameters start from the shared ones
        (the member's are part-way through the fragments' rounds: its pseudo-gradients are to
        hold this worker's own steps only)."""
        assert self.model is not None
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(self.shared[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    def end(self) -> None:
        """A stop between syncs (SIGTERM, or a user loop that ends mid-period): sync what moved
        since its last sync and apply every pending exchange, so the final model holds every step
        (collective: every worker ends at the same step)."""
        self._interrupted = []  # (elastic: a sync a lost peer interrupted is begun again below)
        self._exchange_again()
        for i in range(len(self.bounds)):
            if self.inner_steps > self.synced_at[i]:
                self._start_sync(i)
        self._apply_due(flush=True)

    def eval_model(self) -> torch.nn.Module:
        """A copy of the model holding the shared parameters (buffers from this worker's model)."""
        assert self.model is not None
        if self._eval is None:
            self._eval = copy_module(self.model)
        else:
            self._eval.load_state_dict(self.model.state_dict())  # buffers (e.g. batch-norm statistics)
        offset = 0
        with torch.no_grad():
            for p in (q for q in self._eval.parameters() if q.requires_grad):
                p.copy_(self.shared[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        return self._eval

    def metrics(self) -> dict[str, float]:
        out = {"outer_steps": self.outer_steps, "pseudo_gradient_norm": self._last_delta_norm}
        if self.auto:  # the current H, and what the last sync measured and proposed
            out["sync_every"] = self.sync_every
            for key, value in (("sync_seconds", self._sync_seconds), ("step_seconds", self._step_seconds),
                               ("sync_every_proposed", self._proposed)):
                if value is not None:
                    out[key] = value
        if self.adaptive is not None:
            out.update(self.adaptive.metrics(), compress_ratio=self._last_ratio)
        return out

    def info(self) -> dict[str, Any]:
        return {"sync_every": AUTO if self.auto else self.sync_every, "outer_optimizer": "nesterov" if self.nesterov else "sgd",
                "outer_lr": self.outer_lr, "outer_momentum": self.outer_momentum,
                "fragments": [hi - lo for lo, hi in self.bounds], "fragment_sync_offsets": self.offsets,
                "overlap_steps": self.overlap, "merge_weight": self.merge_weight,
                "compress": self.compressor.spec() if self.compressor is not None else "none"}

    def state_dict(self) -> dict[str, Any]:
        """The periods' starts, the outer momentum, the sync bookkeeping and any exchange still
        to be applied (waited for here: its sum is saved, applied at its step after a resume)."""
        for pending in self._pending:
            if pending.handle is not None:
                try:
                    pending.handle.wait()
                except Exception:  # a lost peer (a rebuild's state): exchanged again over the survivors
                    self._exchanges_lost()
                    if pending.handle is not None:
                        raise
                    continue
                pending.handle, pending.own = None, None  # (complete: nothing to send again)
        state: dict[str, Any] = {
            "shared": self.shared.clone(), "buffer": self.buffer.clone(),
            "has_buffer": torch.tensor(self.has_buffer, dtype=torch.bool), "inner_steps": self.inner_steps,
            "synced_at": torch.tensor(self.synced_at, dtype=torch.int64), "outer_steps": self.outer_steps,
            "sync_every": self.sync_every, "next_sync": self.next_sync, "previous_sync": self.previous_sync,
            "choose_h": self._choose_h,
            "pending": [{"fragment": p.fragment, "due": p.due, "delta": p.delta.detach().cpu().clone(),
                         "count": p.count, "lost": p.lost,
                         **({"own": p.own.detach().cpu().clone()} if p.own is not None else {})}
                        for p in self._pending],
            "interrupted": torch.tensor(self._interrupted, dtype=torch.int64),
        }
        if self.compressor is not None:
            state["compressor"] = self.compressor.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.shared.copy_(state["shared"])
        self.buffer.copy_(state["buffer"])
        self.has_buffer = [bool(v) for v in state["has_buffer"].tolist()]
        self.synced_at = [int(v) for v in state["synced_at"].tolist()]
        self.inner_steps, self.outer_steps = int(state["inner_steps"]), int(state["outer_steps"])
        if self.auto and "next_sync" in state:
            self.sync_every, self.next_sync = int(state["sync_every"]), int(state["next_sync"])
        self.previous_sync = int(state.get("previous_sync", max(0, max(self.synced_at) - self.sync_every)))
        self._choose_h = bool(state.get("choose_h", False))
        device = self.params[0].device if self.params else torch.device("cpu")
        world = self.transport.world_size if self.transport is not None else self.settings.run.workers
        self._pending = [_Pending(int(p["fragment"]), int(p["due"]), p["delta"].to(device), None,
                                  int(p.get("count", world)), p["own"].to(device) if "own" in p else None,
                                  bool(p.get("lost", False)))
                         for p in state.get("pending", [])]
        self._interrupted = [int(v) for v in state.get("interrupted", torch.zeros(0)).tolist()]
        if self.compressor is not None and "compressor" in state:
            self.compressor.load_state_dict(state["compressor"])
        self._resumed = True

    def close(self) -> None:
        self._eval = None
