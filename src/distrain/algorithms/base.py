"""The Algorithm interface: the hooks the worker loop calls around each step, and the run's
facts every algorithm's settings hold (:class:`RunFacts`)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from distrain.comm.transport import Transport
from distrain.compress.adaptive import AdaptivePolicy
from distrain.compress.registry import policy_from_spec
from distrain.compress.settings import CompressionSettings
from distrain.compress.warmup import DensityWarmup


@dataclass(frozen=True, kw_only=True)
class RunFacts:
    """What an algorithm knows of the run it works in, apart from its own hyperparameters (made
    by :mod:`distrain.assemble`, like the settings that hold it)."""

    #: training workers (parameter servers not counted)
    workers: int
    #: elastic runs: the survivors of a lost worker go on while at least this many remain
    min_workers: int
    #: seconds any collective or wait for a peer may take
    timeout: float
    #: where the model is: ``cpu`` or ``cuda``
    device: str
    #: the run's seed, the same on every worker (compressors that draw, gossip partners)
    seed: int


@dataclass
class StepContext:
    """What the loop knows about the current step, handed to every algorithm hook."""

    step: int
    epoch: float
    batch_size: int
    per_sample_losses: torch.Tensor | None = None
    compute_seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


#: The hook tables of a module that a copy for evaluation must not carry (a hook is usually a bound
#: method of whatever drives training: copying it would copy that, transports and threads included).
HOOK_TABLES = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks")


def copy_module(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model``'s modules, parameters and buffers, without its hooks."""
    memo: dict[int, Any] = {}
    for module in model.modules():
        for name in HOOK_TABLES:
            table = getattr(module, name, None)
            if table is not None:
                memo[id(table)] = type(table)()
    return copy.deepcopy(model, memo)


def clone_state(state: dict[str, Any]) -> dict[str, Any]:
    """A copy of a flat state dict that later in-place changes of its tensors leave alone."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in state.items()}


class FlatParams:
    """The trainable parameters of a model seen as one vector (copied in and out): a model on
    the GPU is read into a CPU vector with one copy across."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.sizes = [p.numel() for p in params]
        self.numel = sum(self.sizes)
        self.dtype = params[0].dtype if params else torch.float32

    def read(self, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            out = torch.empty(self.numel, dtype=self.dtype)
        if self.params:
            parts = [p.detach().reshape(-1) for p in self.params]
            if parts[0].device == out.device:
                torch.cat(parts, out=out)
            else:
                out.copy_(torch.cat(parts))
        return out

    @torch.no_grad()
    def write(self, flat: torch.Tensor) -> None:
        for p, chunk in zip(self.params, flat.split(self.sizes), strict=True):
            p.copy_(chunk.view_as(p))


class Algorithm:
    """One instance per worker; composes the Transport (and later a Compressor). It takes its own
    settings dataclass (``settings``), never the run's whole configuration: :mod:`distrain.assemble`
    makes the settings from the flags.

    The loop calls, per step: backward, ``after_backward`` (gradient aggregation),
    ``apply_update`` (the optimizer step, unless a server owns it), ``after_update`` (model
    averaging). ``eval_model`` gives the model to evaluate (the consensus for decentralized
    algorithms); it may be collective, so every worker calls it.
    """

    name: str = "base"
    #: True when every worker holds the same model after each step (synchronous data parallel).
    replicated: bool = True
    #: True when the algorithm sends its traffic through ``--compress`` (others ignore it).
    compresses: bool = False
    #: False when workers never wait for one another (AD-PSGD, Prague): each runs to its own
    #: budget (``keep_going``), the loop evaluates only once training is over, and the consensus
    #: over time comes from ``consensus_history``.
    synchronous: bool = True
    #: True when the algorithm checks gradients for NaN / Inf itself before sending them (those
    #: that send during backward); otherwise the loop checks them before ``after_backward``.
    checks_gradients: bool = False
    #: True when the others go on without a worker that dies (asynchronous gossip that drops it).
    survives_lost_workers: bool = False
    #: True when the survivors of a lost worker can go on with this algorithm: they rebuild the
    #: group and redo the interrupted step (see :mod:`distrain.runtime.membership`).
    elastic: bool = False
    #: An elastic step interrupted by a lost peer is redone (:meth:`redo`) with this worker's own
    #: gradients of that step (algorithms that average gradients); False for those whose step is
    #: local until a sync.
    redo_needs_gradients: bool = True
    #: Whether a worker behind the furthest survivor, once it took that survivor's state, redoes
    #: that survivor's interrupted step with it (a sync every worker must join), or is done.
    redo_when_behind: bool = False
    #: Decentralized algorithms, whose workers each hold their own model and may stand a few
    #: steps apart: after a loss no step is redone; every survivor keeps its step's local update,
    #: the survivors' models are averaged (:meth:`realign`) and all go on from the furthest one's
    #: step count.
    realigns: bool = False
    #: Whether the learning rate follows the live workers' global batch after a loss (linear
    #: scaling rule); False where the algorithm's own averaging already scales it (parameter
    #: servers divide the survivors' gradients by ``--workers``).
    rescales_lr: bool = True
    #: Whether the optimizer steps on each worker's own batch, the averaging coming later
    #: (DiLoCo's inner steps): the linear scaling rule then applies to the local batch, and the
    #: learning rate does not change with the members.
    local_steps: bool = False
    #: Set by the driver of an elastic run: keep this worker's own gradients of the step in
    #: flight where averaging overwrites them before ``after_backward`` (see ``local_gradients``).
    keep_local: bool = False
    #: Keys of :meth:`state_dict` that are this worker's alone (error-feedback residuals): a
    #: worker that resumes from another's checkpoint (it was lost before that one was saved)
    #: starts them afresh, as one that joins a running job does.
    own_state: tuple[str, ...] = ("compressor",)
    #: Workers lost and left behind during the run (rank -> when declared dead); asynchronous
    #: algorithms only.
    lost_workers: dict[int, float] = {}  # noqa: RUF012 - replaced, never mutated
    #: Parameter servers lost during the run (server index -> when declared dead); their
    #: parameters were taken over by the others.
    lost_servers: dict[int, float] = {}  # noqa: RUF012 - replaced, never mutated
    #: Lost parameter servers started again that took their parameters back (index -> when).
    returned_servers: dict[int, float] = {}  # noqa: RUF012 - replaced, never mutated

    @property
    def stamps_heartbeat(self) -> bool:
        """Whether this worker stamps a heartbeat in the store outside an elastic membership (which
        always does): asynchronous algorithms' peers tell a lost worker from a slow one by it."""
        return not self.synchronous

    @property
    def common_steps(self) -> bool:
        """Whether the workers end every step together (a joiner then takes the members' data
        plan at the step they admit it); asynchronous parameter servers' do not."""
        return self.synchronous

    @classmethod
    def survives(cls, settings: Any) -> bool:
        """Whether a run whose algorithm has ``settings`` goes on when a worker is lost (launchers
        then keep the others running)."""
        return cls.survives_lost_workers

    def __init__(self, settings: Any, compression: CompressionSettings | None = None) -> None:
        """``settings``: the algorithm's own settings dataclass (see :mod:`distrain.assemble`);
        ``compression``: its compression settings, for an algorithm that compresses."""
        self.settings = settings
        #: the adaptive compression policy (``--compress adaptive:...``), else None
        self.adaptive: AdaptivePolicy | None = None
        self._density: DensityWarmup | None = None  # the adaptive policy's warm-up schedule
        if self.compresses and compression is not None:
            self.adaptive = policy_from_spec(compression.spec)
            if self.adaptive is not None:
                self._density = compression.warmup(self.adaptive.settings.base)
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.transport: Transport | None = None

    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, transport: Transport) -> None:
        self.model, self.optimizer, self.transport = model, optimizer, transport

    def compress_ratio(self, ctx: StepContext) -> float | None:
        """This worker's kept ratio for the compressed traffic of step ``ctx.step``.

        None (without ``--compress adaptive``) follows ``--compress`` and its density warm-up.
        With it, the adaptive policy's choice from the step's per-sample losses and the delays
        of the worker's earlier messages (the density schedule's ratio standing in for its base
        while it is larger). Every worker may return a different ratio at every step (the sparse
        ring and the parameter servers take payloads of any size), except with ``randomk`` under
        all-reduce, whose workers must agree. Ignored during the dense warm-up and by compressors
        without a ratio.
        """
        if self.adaptive is None or self._density is None:  # both or neither
            return None
        epochs_done = ctx.epoch * ctx.step / (ctx.step + 1)  # ctx.epoch counts the step being finished
        base = self._density.ratio(epochs_done)
        return self.adaptive.choose(ctx.per_sample_losses, self.transport, base=base, compute_seconds=ctx.compute_seconds)

    def after_backward(self, ctx: StepContext) -> None:
        """Aggregate gradients (all-reduce, parameter server); default: keep local gradients."""

    def apply_update(self, ctx: StepContext) -> None:
        assert self.optimizer is not None
        self.optimizer.step()

    def after_update(self, ctx: StepContext) -> None:
        """Average models (gossip); default: nothing."""

    def end(self) -> None:
        """This worker's training is over (its last step is done, asynchronous workers have
        drained): parameter-server workers tell the servers; default: nothing."""

    def eval_model(self) -> torch.nn.Module:
        assert self.model is not None
        return self.model

    def start(self, total_steps: int, steps_per_epoch: int) -> None:
        """Called once before the first step (after any resume, as the workers start together),
        with the run's length."""

    # -- asynchronous algorithms (synchronous = False) change these ---------------------------

    def keep_going(self, step: int, total_steps: int) -> bool:
        """Whether this worker takes step ``step`` (0-based); may block at the end of an
        asynchronous run until every worker is done."""
        return step < total_steps

    def request_stop(self) -> None:
        """SIGTERM / Ctrl-C: an asynchronous worker ends its budget now (``keep_going`` then
        winds down); synchronous workers stop at a step agreed by the loop."""

    def schedule_step(self, step: int) -> int:
        """Where the learning-rate schedule stands at ``step`` (asynchronous budgets follow the
        workers' joint progress or the clock)."""
        return step

    def redo(self, ctx: StepContext) -> None:
        """The step a lost peer interrupted, again, over the survivors' new group (``.grad``
        holds this worker's own gradients again): by default the whole update."""
        self.after_backward(ctx)
        self.apply_update(ctx)
        self.after_update(ctx)

    def realign(self) -> None:
        """After a loss (``realigns``): make every survivor's model their average (collective)."""

    def state_before_step(self) -> dict[str, Any] | None:
        """Elastic runs, once a lost peer interrupted a step: this worker's state (a whole
        :meth:`state_dict`) with what the step had already changed as it was before it, which a
        redo of the step starts from; None where a step changes nothing the redo does not start
        from anyway (its parameters and optimizer state are those it began with)."""
        return None

    def membership_changed(self) -> None:
        """Called on the algorithm rebuilt over a new group once its state is loaded (a loss or a
        join): state tied to the old group's shape may be reset here."""

    def before_admission(self) -> None:
        """At the step the members agreed to admit joiners, before the group opens to them
        (collective over the members): what must hold for a joiner to enter there."""

    def admission_step(self, proposed: int) -> int:
        """The first step count from ``proposed`` on at which a worker may join (every step by
        default; a round's boundary for algorithms that sync every so many steps)."""
        return proposed

    def processes(self, workers: int) -> int:
        """The run's processes for ``workers`` training workers (parameter servers add theirs)."""
        return workers

    def joiner_transport(self, joined: Any, link_model: Any = None) -> tuple[Transport, int] | None:
        """A worker started again and admitted (``joined``, its
        :class:`~distrain.runtime.membership.Membership`), before :meth:`setup`: the Transport it
        trains over and its rank there, when its peers open links with it (then :meth:`join`
        takes their state over them); None (the default): the members open a new group with it
        and hand it their state there, as for synchronous elastic algorithms."""
        return None

    def join(self) -> int:
        """After :meth:`setup`, on a worker whose :meth:`joiner_transport` gave its links: take a
        live peer's state over them; returns the step count this worker goes on from."""
        raise NotImplementedError(f"{self.name}: no join over links")

    def newly_joined(self) -> list[Any]:
        """Asynchronous algorithms: the admissions of workers started again that this worker took
        part in since the last call (:class:`~distrain.runtime.membership.Change` each); the
        synchronous ones admit joiners through the optimizer's membership instead."""
        return []

    @property
    def admission_every(self) -> int:
        """Elastic runs: the members look for workers waiting to join every this many steps (one
        store request each time; they are admitted that many steps later, or more)."""
        return 1

    def kept_steps(self, lost_at: int) -> int:
        """Of a worker lost when this one had done ``lost_at`` steps, how many the model holds:
        its samples after them were never learned from, and the survivors train on them (every
        step's gradient is in the model by default; a round's, only once the round has synced)."""
        return lost_at

    def keeps_local_gradients(self) -> bool:
        """Whether :meth:`local_gradients` has this step's gradients (without copying them)."""
        return False

    def local_gradients(self) -> list[torch.Tensor | None] | None:
        """This worker's own gradients of the step in flight, per parameter, where averaging
        has begun overwriting ``.grad`` in place; None when ``.grad`` still holds them."""
        return None

    def replica_state(self) -> list[torch.Tensor]:
        """Tensors every worker must hold alike, which a worker that joins takes from a member
        (its shapes the same on every worker, whatever its progress)."""
        return []

    def load_replica_state(self, tensors: list[torch.Tensor]) -> None:
        """Take a member's :meth:`replica_state` (after a broadcast into this worker's own)."""

    def entered(self) -> None:
        """On a worker that joined a running job, once it holds a member's parameters, optimizer
        state and :meth:`replica_state`: what differs for a newcomer (default: nothing)."""

    def transports(self) -> list[Transport]:
        """Transports besides the loop's (an algorithm's own process groups, over the same
        ranks): their traffic counts as this worker's."""
        return []

    def newly_lost(self, force: bool = False) -> dict[int, float]:
        """Workers this one learned were lost since it last asked (worker id -> Unix time they were
        declared dead), for algorithms whose survivors go on in the same group; reads the store at
        most once a second unless ``force``."""
        return {}

    def meet_to_start(self) -> bool:
        """Meet the others to start training together without a collective over every worker
        (which fails on one lost as the run starts, where the others go on without it), and say
        True; False (the default): the caller's barrier over every worker."""
        return False

    def leads(self, transport: Transport) -> bool:
        """Whether this worker evaluates and writes the summary (``transport``: the loop's):
        rank 0, or the first of the survivors once some were lost."""
        return (self.control_transport() or transport).rank == 0

    def control_transport(self) -> Transport | None:
        """After training: the transport for the final collectives (evaluation, summary) when
        some workers were lost and the others went on without them; None: every worker."""
        return None

    def consensus_history(self) -> Iterator[tuple[dict[str, float], torch.nn.Module]]:
        """After training, asynchronous algorithms: ``({"time": s, ...}, consensus model)`` at
        points during the run (collective: every worker iterates to the end)."""
        return iter(())

    def metrics(self) -> dict[str, float]:
        """Algorithm-specific numbers for metrics.jsonl (e.g. consensus distance)."""
        return {}

    def info(self) -> dict[str, Any]:
        """Facts about this run's setup for config.json (e.g. a mixing matrix's spectral gap)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def resume_at(self, step: int) -> None:
        """After :meth:`load_state_dict`: this worker goes on from its ``step``-th step (an
        asynchronous worker's own count, which a file of another worker's does not hold)."""

    def close(self) -> None:
        pass
