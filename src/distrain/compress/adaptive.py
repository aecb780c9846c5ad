"""Adaptive compression: each worker picks its kept ratio every step from two signals.

``--compress adaptive:base=0.01:min=0.001:max=0.1`` sparsifies like ``group_topk`` (same groups,
same error feedback, a different k on every worker and step), with the ratio::

    ratio = clip(base * F(importance) * N(congestion), min, max)
    f(I) = I ** alpha        (alpha = 1 by default; 0 switches importance off)
    g(C) = C ** beta         (beta = 0.5 by default; 0 switches the network off)

By default (``budget=0``) ``F = f(I)`` and ``N = 1 / g(C)``: a batch harder than usual sends more
of its gradient, a congested link less, so while links are slow the run sends fewer bytes and its
steps take less time; error feedback keeps what a worker holds back. With ``g(C) = sqrt(C)`` a
worker on a link ten times slower than the cluster's best sends about a third of ``base``. On
the ``fluctuating`` benchmark (a ~1M-parameter MLP trained 10 epochs) this policy reached 80%
test accuracy 1.5x sooner than fixed group top-k at ``base`` and ended at the same accuracy
(``benchmarks/BENCHMARKS.md``). ``beta=1`` responds harder (bytes in proportion to the link's
speed): more time saved per step, more accuracy lost per epoch.

**Budget** (``budget=1``): the signals decide *where* the base ratio's bytes go, not how many
there are. ``F = f(I) / mean f`` (the moving average of f over the worker's past batches, weight
of the past ``ema``) and ``N = g(C)^-1 / mean g^-1``, the mean taken over every worker of the
step where the workers share their delays (all-reduce), else over the worker's own last
``window`` steps (a parameter server's workers). Both average 1, so the run sends about what
fixed group top-k at ``base`` sends: a hard batch gets more than an easy one, a worker on a fast
link more than one on a slow link. It keeps the accuracy of fixed ``base`` step for step, but a
synchronous all-reduce must bring every worker's contribution through its slowest link, so
moving bytes between workers buys no time there (it does where each worker's own link carries
its own bytes).

**Importance** ``I``: the batch's mean per-sample cross-entropy loss over an exponential moving
average of the worker's past batch losses (``ema``: the weight of the past, 0.9). A batch the
model still finds hard (I > 1) earns more of the gradient on the wire; an easy one less. The
first batch has I = 1.

**Congestion** ``C``: the worker's current delay per byte over a baseline. Every point-to-point
message this worker sends is timed by the Transport; with the in-process link model the time is
the emulated link's (uplink queue, transmission at the link's bandwidth, latency), so a worker on
a slower link sees a larger delay per byte. (A step without point-to-point messages, e.g. with
the sparse all-gather, is timed by its collectives instead; those run at the slowest link's pace,
the same for every worker, so use ``--sparse-collective ring`` to tell workers apart.) Per step::

    delay per byte = sum(delay_i - floor) / sum(bytes_i)     over the step's messages

where ``floor`` is the smallest message delay of the last ``window`` steps (the latency that a
tiny message pays anyway; without subtracting it, sending less would look like a slower link).
The current value is a moving average of these (``fast``: the weight of the past, 0.5). The
baseline is the lowest current value *of any worker* over the last ``window`` steps (200): with
all-reduce every worker adds its current value to the dense all-reduce it runs anyway (the
one-dimensional tensors, one float per worker more), so a worker whose link is slower than the
best link in the cluster sees C > 1 even when its link never changes (e.g. C ~ 10 on 5 Mbit/s
when others have 50 Mbit/s). Where nothing is shared (a parameter server's workers, one worker),
the baseline is the worker's own lowest value of the window, so C > 1 while its link is slower
than it was. Either way C >= 1 for the best link. The ratio of step t uses the messages of the
steps before t.

Constant signals (I = 1, C = 1) give ``base``; ``min`` and ``max`` bound the ratio whatever the
signals say. During a density warm-up the scheduled ratio takes the place of ``base`` (and of
``max`` while it is larger).

Example::

    settings = parse_adaptive(["base=0.01", "min=0.001", "max=0.1"])
    policy = AdaptivePolicy(settings)
    ratio = policy.choose(per_sample_losses, transport)   # before this step's exchange

Every algorithm that compresses (``allreduce``, ``ps``) asks its policy through
:meth:`~distrain.algorithms.base.Algorithm.compress_ratio` each step.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, fields

import torch

from distrain.comm.transport import Exchange, Transport
from distrain.compress.group_topk import GroupTopK

#: Added to both delays per byte before dividing (s/byte; 1e-9 is 8 Gbit/s): on an unshaped
#: loopback the measured delays are noise, and a zero baseline must not make C infinite.
EPSILON_S_PER_BYTE = 1e-9


@dataclass(frozen=True)
class AdaptiveSettings:
    """The constants of the policy (see the module docstring); ``parse_adaptive`` checks them."""

    base: float = 0.01
    min: float = 0.001
    max: float = 0.1
    alpha: float = 1.0
    beta: float = 0.5
    ema: float = 0.9
    fast: float = 0.5
    window: int = 200
    group: int = 1024
    budget: int = 0

    def spec(self) -> str:
        default = AdaptiveSettings()
        parts = [f"base={self.base:g}", f"min={self.min:g}", f"max={self.max:g}"]
        parts += [f"{f.name}={getattr(self, f.name):g}" for f in fields(self)
                  if f.name not in ("base", "min", "max") and getattr(self, f.name) != getattr(default, f.name)]
        return "adaptive:" + ":".join(parts)


def _number(options: dict[str, str], key: str, default: float, *, integer: bool = False) -> float:
    text = options.get(key)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or (integer and value != int(value)):
        raise ValueError(f"{key} must be {'an integer' if integer else 'a number'}, got {text!r}")
    return int(value) if integer else value


def parse_adaptive(args: Iterable[str], options: dict[str, str] | None = None) -> AdaptiveSettings:
    """Settings from the parts of an ``adaptive:...`` spec; ValueError (one line) when invalid.

    ``args`` may hold the base ratio alone (``adaptive:0.01``); ``options`` the ``key=value``
    parts: base, min, max, alpha, beta, ema, fast, window, group, budget.
    """
    args, options = list(args), dict(options or {})
    allowed = {f.name for f in fields(AdaptiveSettings)}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(f"unknown option {unknown[0]!r} (options: {', '.join(f.name for f in fields(AdaptiveSettings))})")
    if len(args) > 1 or (args and "base" in options):
        raise ValueError("give the base ratio once, as adaptive:RATIO or base=RATIO")
    if args:
        options["base"] = args[0]
    d = AdaptiveSettings()
    s = AdaptiveSettings(**{f.name: _number(options, f.name, getattr(d, f.name), integer=f.type in (int, "int"))
                            for f in fields(AdaptiveSettings)})
    if not 0 < s.min <= s.base <= s.max <= 1:
        raise ValueError(f"need 0 < min <= base <= max <= 1, got min={s.min:g} base={s.base:g} max={s.max:g}")
    if s.alpha < 0 or s.beta < 0:
        raise ValueError(f"alpha and beta must be >= 0, got alpha={s.alpha:g} beta={s.beta:g}")
    if not (0 <= s.ema < 1 and 0 <= s.fast < 1):
        raise ValueError(f"ema and fast must be in [0, 1), got ema={s.ema:g} fast={s.fast:g}")
    if s.window < 1 or s.group < 1:
        raise ValueError(f"window and group must be integers >= 1, got window={s.window} group={s.group}")
    if s.budget not in (0, 1):
        raise ValueError(f"budget must be 0 or 1, got budget={s.budget}")
    return s


def f_importance(importance: float, alpha: float) -> float:
    """f(I) = I ** alpha: more of the gradient for a batch that is harder than usual."""
    return max(importance, 0.0) ** alpha


def g_congestion(congestion: float, beta: float) -> float:
    """g(C) = C ** beta: less on the wire while the link is slower than its baseline."""
    return max(congestion, 1e-12) ** beta


def policy_ratio(settings: AdaptiveSettings, importance: float, congestion: float, base: float | None = None,
                 *, mean_f: float = 1.0, mean_inv_g: float = 1.0) -> float:
    """clip(base * F * N, min, max) with F = f(importance) / mean_f and N = (1 / g(congestion)) /
    mean_inv_g; the means are the budget's denominators (1: none). ``base`` overrides the
    settings' base (a density warm-up's scheduled ratio, which also lifts ``max`` while it is
    larger)."""
    base = settings.base if base is None else base
    share_f = f_importance(importance, settings.alpha) / mean_f if mean_f > 0 else 1.0
    share_n = 1.0 / g_congestion(congestion, settings.beta) / mean_inv_g if mean_inv_g > 0 else 1.0
    return min(max(base * share_f * share_n, settings.min), max(settings.max, base))


#: Operations whose delay stands for the network when a step has no point-to-point sends: the
#: sparse all-gather's (its sizes, then the payloads; timed as ring collectives, so at the
#: slowest link's pace). A dense all-reduce alone (the density warm-up) is one message per step,
#: which leaves nothing above the latency floor to measure, so it is not used.
COLLECTIVES = ("all_gather",)


def timed_messages(exchanges: Iterable[Exchange]) -> list[tuple[float, int]]:
    """(delay, bytes sent) of the point-to-point messages this worker sent in ``exchanges``; when
    there were none, of its collectives instead."""
    def pick(ops: tuple[str, ...]) -> list[tuple[float, int]]:
        return [(e.link_seconds if e.link_seconds is not None else e.seconds, e.bytes_sent)
                for e in exchanges if e.op in ops and e.bytes_sent > 0]

    exchanges = list(exchanges)
    return pick(("send",)) or pick(COLLECTIVES)


def step_delay_per_byte(messages: list[tuple[float, int]], floor: float) -> float | None:
    """Seconds per byte beyond ``floor`` of ``(delay, bytes)`` messages; None when there were none."""
    nbytes = sum(b for _, b in messages)
    return sum(max(0.0, d - floor) for d, _ in messages) / nbytes if nbytes else None


class AdaptivePolicy:
    """One worker's policy state: the loss average and the delay history.

    Args:
        settings: the constants (from ``parse_adaptive``).
    """

    def __init__(self, settings: AdaptiveSettings) -> None:
        self.settings = settings
        self.loss_ema: float | None = None
        self.importance = 1.0
        self.congestion = 1.0
        self.mean_f = 1.0  # the budget's moving average of f(I) over past batches
        self._inv_g: deque[float] = deque(maxlen=settings.window)  # past 1 / g(C) of this worker
        self._cluster_inv_g: float | None = None  # mean 1 / g(C) over the workers at the last share
        self.delay: float | None = None  # current seconds per byte (moving average)
        self._history: deque[float] = deque(maxlen=settings.window)  # past values of ``delay``
        self._cluster: deque[float] = deque(maxlen=settings.window)  # past lowest ``delay`` of any worker
        self._floors: deque[float] = deque(maxlen=settings.window)  # smallest message delay per step
        self._seen = 0  # transport.stats.recorded already read
        self._bytes_at_choice: int | None = None  # transport.stats.bytes_sent when the ratio was chosen

    @property
    def baseline(self) -> float | None:
        """The lowest delay per byte of the window: any worker's when shared, else our own."""
        history = self._cluster or self._history
        return min(history) if history else None

    def shared_value(self) -> float:
        """What this worker tells the others (:meth:`observe_cluster`): its current delay per
        byte, 0 while unknown."""
        return self.delay if self.delay is not None else 0.0

    def observe_cluster(self, values: Iterable[float]) -> None:
        """Every worker's :meth:`shared_value` of this step (0: unknown); the lowest known one
        enters the baseline's window, and the mean of 1 / g(C) over the known ones becomes the
        budget's denominator."""
        known = [v for v in values if v > 0 and math.isfinite(v)]
        if known:
            self._cluster.append(min(known))
            self._update_congestion()
            baseline = self.baseline
            assert baseline is not None
            self._cluster_inv_g = sum(1.0 / g_congestion(self._congestion_of(v, baseline), self.settings.beta)
                                      for v in known) / len(known)

    def observe_losses(self, losses: torch.Tensor | None) -> float:
        """Update and return the importance of a batch with these per-sample losses."""
        if losses is None or not losses.numel():
            return self.importance
        mean = float(losses.detach().float().mean())
        if not math.isfinite(mean):
            self.importance = 1.0
            return self.importance
        if self.loss_ema is None or self.loss_ema <= 0:
            self.importance = 1.0
            self.loss_ema = mean
        else:
            ema = self.settings.ema
            self.mean_f = ema * self.mean_f + (1 - ema) * f_importance(self.importance, self.settings.alpha)
            self.importance = mean / self.loss_ema
            self.loss_ema = ema * self.loss_ema + (1 - ema) * mean
        return self.importance

    def observe_network(self, transport: Transport) -> float:
        """Read the exchanges the Transport recorded since the last call; update and return C."""
        stats = transport.stats
        new = min(stats.recorded - self._seen, len(stats.exchanges))
        self._seen = stats.recorded
        recent = list(stats.exchanges)[len(stats.exchanges) - new:] if new > 0 else []
        return self.observe_exchanges(recent)

    def observe_exchanges(self, exchanges: list[Exchange]) -> float:
        """Take in one step's exchanges (see :func:`timed_messages`); update and return C."""
        messages = timed_messages(exchanges)
        if messages:
            self._floors.append(min(d for d, _ in messages))
        estimate = step_delay_per_byte(messages, min(self._floors)) if self._floors else None
        if estimate is not None:
            fast = self.settings.fast
            self.delay = estimate if self.delay is None else fast * self.delay + (1 - fast) * estimate
            self._history.append(self.delay)
        self._update_congestion()
        if estimate is not None:
            self._inv_g.append(1.0 / g_congestion(self.congestion, self.settings.beta))
        return self.congestion

    @staticmethod
    def _congestion_of(delay: float, baseline: float) -> float:
        return max(1.0, (delay + EPSILON_S_PER_BYTE) / (baseline + EPSILON_S_PER_BYTE))

    def _update_congestion(self) -> None:
        baseline = self.baseline
        if self.delay is not None and baseline is not None:
            self.congestion = self._congestion_of(self.delay, baseline)

    @property
    def mean_inv_g(self) -> float:
        """The budget's network denominator: mean 1 / g(C) over the workers of the last share,
        else over this worker's recent steps; 1 before anything is known or with ``budget=0``."""
        if not self.settings.budget:
            return 1.0
        if self._cluster_inv_g is not None:
            return self._cluster_inv_g
        return sum(self._inv_g) / len(self._inv_g) if self._inv_g else 1.0

    def ratio(self, base: float | None = None) -> float:
        """The ratio for the current signals (see :func:`policy_ratio`)."""
        mean_f = self.mean_f if self.settings.budget else 1.0
        return policy_ratio(self.settings, self.importance, self.congestion, base,
                            mean_f=mean_f, mean_inv_g=self.mean_inv_g)

    def choose(self, losses: torch.Tensor | None, transport: Transport | None, base: float | None = None) -> float:
        """Take in this step's losses and the exchanges since the last step; the ratio to send with."""
        self.observe_losses(losses)
        if transport is not None:
            self.observe_network(transport)
            self._bytes_at_choice = transport.stats.bytes_sent
        return self.ratio(base)

    def metrics(self, transport: Transport | None = None) -> dict[str, float]:
        """The signals for metrics.jsonl; with ``transport``, also the bytes sent since the last
        :meth:`choose` (``step_bytes_sent``: this step's)."""
        out = {"importance": self.importance, "congestion": self.congestion}
        if transport is not None and self._bytes_at_choice is not None:
            out["step_bytes_sent"] = transport.stats.bytes_sent - self._bytes_at_choice
        if self.delay is not None:
            out["delay_s_per_mb"] = self.delay * 1e6
        if self.baseline is not None:
            out["baseline_s_per_mb"] = self.baseline * 1e6
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        if self.loss_ema is None:
            return {}
        return {"loss_ema": torch.tensor(self.loss_ema, dtype=torch.float64),
                "mean_f": torch.tensor(self.mean_f, dtype=torch.float64)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if "loss_ema" in state:
            self.loss_ema = float(state["loss_ema"])
        if "mean_f" in state:
            self.mean_f = float(state["mean_f"])


class AdaptiveGroupTopK(GroupTopK):
    """Group top-k whose ratio an :class:`AdaptivePolicy` sets per call (``CompressInfo.ratio``);
    ``ratio`` is the policy's base, used when a call gives none."""

    name = "adaptive"

    def __init__(self, settings: AdaptiveSettings) -> None:
        super().__init__(settings.base, group=settings.group)
        self.settings = settings

    def spec(self) -> str:
        return self.settings.spec()
