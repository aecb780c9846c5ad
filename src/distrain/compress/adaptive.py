"""Adaptive compression: each worker picks its kept ratio every step from its link and its batch.

``--compress adaptive:base=0.01:min=0.001:max=0.1`` sparsifies like ``group_topk`` (same groups,
same error feedback, a different k on every worker and step), with the ratio::

    ratio = clip(max(base, spare ratio) * f(I) / g(C), min, max)
    f(I) = I ** alpha    (alpha = 0 by default: importance off, see below)
    g(C) = C ** beta     (beta = 0.5 by default: halfway, in log terms, between keeping the
                          step's bytes and keeping its communication time)

**The link.** Every point-to-point message a worker sends is timed by the Transport (with the
in-process link model, by the emulated link's delay). Over the messages of its last ``recent``
steps (5) each worker fits how their delay grows with their size: the Theil-Sen slope, the median
over pairs of messages of clearly different sizes of delay difference over size difference, in
seconds per byte. A wait that any message may pay (a busy peer, a thread wake-up) moves delays
but not their dependence on size, and a slope that does not stand out of the delays' scatter (a
loopback, where sizes cost nothing measurable) counts as no measurement. The smallest slope of
the last ``window`` steps (200) is the link's *idle* cost of a byte (its idle throughput).

**Congestion** ``C``: seconds per byte now over idle, read as 1 (not congested) inside a dead
zone: while it is below ``1 + dead`` (0.25), or while the extra time it costs a step (the slope's
excess times the step's bytes) is below ``spare`` of the step's compute time. Timing noise
therefore moves nothing; a link at a tenth of its idle speed reads ``C ~ 10`` within ``recent``
steps and the worker sends ``1 / C ** beta`` of its uncongested ratio: about a third with the
default ``beta = 0.5``; ``beta = 1`` keeps the step's communication time near its idle value,
which saves more time per step and learns less per step (``benchmarks/BENCHMARKS.md`` has both).
When the link recovers, C falls back
to 1 as fast. A link that is slow but steady is not congested: it sends ``base``. Under
all-reduce the workers share their C in the step's exchange (one value per worker rides with the
dense one-dimensional part) and every worker answers to the largest: in a synchronous ring every
worker's bytes cross the slowest link, so a worker on a fast link that kept sending ``base``
would keep the step slow. Parameter-server workers, each on its own link to the servers, answer
to their own.

**Spare bandwidth.** On an uncongested link the ratio is at least ``base``, and more where the
link has time to spare: the *spare ratio* is the ratio whose bytes take ``spare`` (0.1) of the
step's compute time at the idle throughput (bytes per unit of ratio measured on the worker's
recent steps). On a fast link next to a slow computation it reaches ``max``: bandwidth nobody
uses is spent on accuracy. ``spare=0`` keeps the ratio at ``base`` there.

**Importance** ``I``: the rank of the batch's mean loss among the last ``history`` batches (50),
after taking out their trend (a least-squares line through the log losses): ``I = 0.5 + q`` for
the fraction ``q`` of those batches whose detrended loss was lower. It lies in [0.5, 1.5] and
averages 1 over any stretch of training, however fast the loss falls, so it moves bytes between
batches without changing how many are sent. It is off by default (``alpha = 0``):
``benchmarks/bench_adaptive.py`` measured no gain from it at equal bytes (BENCHMARKS.md).

``min`` and ``max`` bound the ratio whatever the signals say. During a density warm-up the
scheduled ratio takes the place of ``base`` (and of ``max`` while it is larger).

Example::

    settings = parse_adaptive(["base=0.01", "min=0.001", "max=0.1"])
    policy = AdaptivePolicy(settings)
    ratio = policy.choose(per_sample_losses, transport, compute_seconds=0.02)   # before this step's exchange

Every algorithm that compresses (``allreduce``, ``ps``, ``diloco``) asks its policy through
:meth:`~distrain.algorithms.base.Algorithm.compress_ratio`; ``diloco`` once per outer round,
with a budget of ``H`` times the per-step ratios (``scale``).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, fields

import torch

from distrain.comm.transport import Exchange, Transport
from distrain.compress.group_topk import DEFAULT_GROUP, GroupTopK

#: Batches the importance signal needs before it departs from 1.
MIN_HISTORY = 8


@dataclass(frozen=True)
class AdaptiveSettings:
    """The constants of the policy (see the module docstring); ``parse_adaptive`` checks them."""

    base: float = 0.01
    min: float = 0.001
    max: float = 0.1
    alpha: float = 0.0
    beta: float = 0.5
    dead: float = 0.25
    spare: float = 0.1
    recent: int = 5
    window: int = 200
    history: int = 50
    group: int = DEFAULT_GROUP

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
    parts: base, min, max, alpha, beta, dead, spare, recent, window, history, group.
    """
    args, options = list(args), dict(options or {})
    allowed = [f.name for f in fields(AdaptiveSettings)]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"unknown option {unknown[0]!r} (options: {', '.join(allowed)})")
    if len(args) > 1 or (args and "base" in options):
        raise ValueError("give the base ratio once, as adaptive:RATIO or base=RATIO")
    if args:
        options["base"] = args[0]
    d = AdaptiveSettings()
    s = AdaptiveSettings(**{f.name: _number(options, f.name, getattr(d, f.name), integer=f.type in (int, "int"))
                            for f in fields(AdaptiveSettings)})
    if not 0 < s.min <= s.base <= s.max <= 1:
        raise ValueError(f"need 0 < min <= base <= max <= 1, got min={s.min:g} base={s.base:g} max={s.max:g}")
    for name in ("alpha", "beta", "dead", "spare"):
        if getattr(s, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {name}={getattr(s, name):g}")
    for name in ("recent", "window", "group"):
        if getattr(s, name) < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {name}={getattr(s, name)}")
    if s.history < MIN_HISTORY:
        raise ValueError(f"history must be an integer >= {MIN_HISTORY}, got history={s.history}")
    return s


def f_importance(importance: float, alpha: float) -> float:
    """f(I) = I ** alpha: more of the gradient for a batch that is harder than usual."""
    return max(importance, 0.0) ** alpha


def g_congestion(congestion: float, beta: float) -> float:
    """g(C) = C ** beta: less on the wire while the link is slower than when idle."""
    return max(congestion, 1e-12) ** beta


def policy_ratio(settings: AdaptiveSettings, importance: float, congestion: float, base: float | None = None,
                 *, spare_ratio: float = 0.0, scale: float = 1.0) -> float:
    """clip(max(base, spare_ratio) * f(importance) / g(congestion), min, max).

    ``base`` overrides the settings' base (a density warm-up's scheduled ratio, which also lifts
    ``max`` while it is larger); ``scale`` multiplies base, min and max (``diloco`` spends ``H``
    steps' ratios on one round; at most 1)."""
    base = (settings.base if base is None else base) * scale
    low, high = min(1.0, settings.min * scale), min(1.0, max(settings.max * scale, base))
    wanted = max(base, spare_ratio) * f_importance(importance, settings.alpha) / g_congestion(congestion, settings.beta)
    return min(max(wanted, low), high)


#: Operations whose delay stands for the network when a step has no point-to-point sends: the
#: sparse all-gather's (its sizes, then the payloads; timed as ring collectives, so at the
#: slowest link's pace). A dense all-reduce alone (the density warm-up) is one message per step,
#: which leaves nothing above the latency floor to measure, so it is not used.
COLLECTIVES = ("all_gather",)


def timed_messages(exchanges: Iterable[Exchange]) -> list[tuple[float, int]]:
    """(delay, bytes sent) of the point-to-point messages this worker sent in ``exchanges``; when
    there were none, of its collectives instead."""
    def pick(ops: tuple[str, ...]) -> list[tuple[float, int]]:
        return [(e.delay, e.bytes_sent) for e in exchanges if e.op in ops and e.bytes_sent > 0]

    exchanges = list(exchanges)
    return pick(("send",)) or pick(COLLECTIVES)


#: How far (in median absolute deviations of the delays) what sizes cost must stand out.
NOISE_MARGIN = 10.0

#: Two messages tell a slope only when one is at least this many times larger than the other.
SIZE_SPREAD = 2.0


def theil_sen_slope(messages: list[tuple[float, int]]) -> float | None:
    """The median over pairs of messages of clearly different sizes of (delay difference) /
    (size difference): seconds per byte, robust to waits that any message may pay (a busy peer,
    a thread wake-up), which move the delays but not their dependence on size. None when no pair
    qualifies."""
    slopes = [(d2 - d1) / (b2 - b1) for (d1, b1), (d2, b2) in itertools.combinations(sorted(messages, key=lambda m: m[1]), 2)
              if b2 >= SIZE_SPREAD * b1]
    return statistics.median(slopes) if slopes else None


def significant_slope(messages: list[tuple[float, int]]) -> float | None:
    """:func:`theil_sen_slope`, when what it says the sizes cost stands out of the delays'
    scatter about the fitted line (more than :data:`NOISE_MARGIN` times their median absolute
    deviation, the size spread of the messages times the slope); else None: on a link where
    sizes cost nothing measurable (a loopback), waits for busy peers make up the delays."""
    slope = theil_sen_slope(messages)
    if slope is None or slope <= 0:
        return None
    residuals = [d - slope * b for d, b in messages]
    centre = statistics.median(residuals)
    scatter = statistics.median(abs(r - centre) for r in residuals)
    spread = max(b for _, b in messages) - min(b for _, b in messages)
    return slope if slope * spread > NOISE_MARGIN * scatter else None


def detrended_rank(values: list[float]) -> float:
    """The fraction of ``values`` (ties counted half) below the last one, once the least-squares
    line through them is taken out."""
    n = len(values)
    mean_t, mean_v = (n - 1) / 2, sum(values) / n
    var_t = sum((t - mean_t) ** 2 for t in range(n))
    slope = sum((t - mean_t) * (v - mean_v) for t, v in enumerate(values)) / var_t
    residuals = [v - mean_v - slope * (t - mean_t) for t, v in enumerate(values)]
    last = residuals[-1]
    below = sum(r < last for r in residuals[:-1]) + 0.5 * sum(r == last for r in residuals[:-1])
    return below / (n - 1)


class AdaptivePolicy:
    """One worker's policy state: its link's calibration, its recent steps, its recent losses.

    Args:
        settings: the constants (from ``parse_adaptive``).
    """

    def __init__(self, settings: AdaptiveSettings) -> None:
        self.settings = settings
        self.importance = 1.0
        self.congestion = 1.0  # this worker's link's C, after the dead zone
        self.cluster_congestion: float | None = None  # the largest C of any worker at the last share
        self._losses: deque[float] = deque(maxlen=settings.history)  # log of past batch losses
        self._messages: deque[list[tuple[float, int]]] = deque(maxlen=settings.recent)  # (delay, bytes) per step
        self._step_bytes: deque[int] = deque(maxlen=settings.recent)  # bytes sent per step
        self._slope: float | None = None  # seconds per byte over the recent steps' messages
        self._slopes: deque[float] = deque(maxlen=settings.window)  # past values of ``_slope``
        self._compute: deque[float] = deque(maxlen=settings.recent)  # compute seconds per step
        self._bytes_per_ratio: deque[float] = deque(maxlen=settings.recent)
        self._ratio: float | None = None  # the ratio the messages observed next were sent with
        self._seen = 0  # transport.stats.recorded already read
        self._bytes_at_choice: int | None = None  # transport.stats.bytes_sent when the ratio was chosen

    # -- the link ----------------------------------------------------------------------------

    @property
    def idle_slope(self) -> float | None:
        """The link's idle cost of a byte (s/byte): the smallest recent-steps slope of the window
        (every slope kept is positive, see :func:`significant_slope`)."""
        return min(self._slopes) if self._slopes else None

    @property
    def idle_rate(self) -> float | None:
        """The link's idle throughput (bytes/s)."""
        idle = self.idle_slope
        return 1.0 / idle if idle else None

    @property
    def latency(self) -> float | None:
        """The link's latency (seconds): the median delay of the recent messages less what
        their bytes take at the current slope."""
        if self._slope is None:
            return None
        return statistics.median(d - self._slope * b for step in self._messages for d, b in step)

    @property
    def slowdown(self) -> float:
        """The current seconds per byte over the idle ones (1 before both are known)."""
        idle = self.idle_slope
        return self._slope / idle if self._slope is not None and idle else 1.0

    def observe_network(self, transport: Transport) -> float:
        """Read the exchanges the Transport recorded since the last call; update and return C."""
        recent = transport.stats.since(self._seen)
        self._seen = transport.stats.recorded
        return self.observe_exchanges(recent)

    def observe_exchanges(self, exchanges: list[Exchange]) -> float:
        """Take in one step's exchanges (see :func:`timed_messages`); update and return C."""
        messages = timed_messages(exchanges)
        if messages:
            nbytes = sum(b for _, b in messages)
            self._messages.append(messages)
            self._step_bytes.append(nbytes)
            slope = significant_slope([m for step in self._messages for m in step])
            self._slope = slope
            if slope is not None:
                self._slopes.append(slope)
            if self._ratio:
                self._bytes_per_ratio.append(nbytes / self._ratio)
        self._update_congestion()
        return self.congestion

    def _update_congestion(self) -> None:
        slowdown = self.slowdown
        extra = 0.0  # the seconds a step's bytes take now beyond their idle time
        idle = self.idle_slope
        if self._slope is not None and idle is not None and self._step_bytes:
            extra = (self._slope - idle) * statistics.median(self._step_bytes)
        costly = extra > self.settings.spare * self.compute_seconds
        self.congestion = slowdown if slowdown > 1 + self.settings.dead and costly else 1.0

    @property
    def compute_seconds(self) -> float:
        """The median compute time of the recent steps (0 while unknown)."""
        return statistics.median(self._compute) if self._compute else 0.0

    @property
    def spare_ratio(self) -> float:
        """The ratio whose bytes take ``spare`` of a step's compute time at the idle throughput
        (0 while any of the three is unknown)."""
        idle = self.idle_rate
        if not (idle and self._bytes_per_ratio and self._compute):
            return 0.0
        return self.settings.spare * self.compute_seconds * idle / statistics.median(self._bytes_per_ratio)

    def shared_value(self) -> float:
        """What this worker tells the others (:meth:`observe_cluster`): its congestion."""
        return self.congestion

    def observe_cluster(self, values: Iterable[float]) -> None:
        """Every worker's :meth:`shared_value` of this step (0: not sent): in a synchronous
        all-reduce every worker's bytes cross the slowest link, so the largest is what paces the
        step and what every worker's ratio answers to."""
        known = [v for v in values if v > 0 and math.isfinite(v)]
        self.cluster_congestion = max(known) if known else None

    @property
    def pace(self) -> float:
        """The congestion the ratio divides by: the cluster's largest where the workers share
        theirs (all-reduce), else this worker's own."""
        return max(self.congestion, self.cluster_congestion or 1.0)

    # -- the batch ---------------------------------------------------------------------------

    def observe_losses(self, losses: torch.Tensor | None) -> float:
        """Update and return the importance of a batch with these per-sample losses."""
        if losses is None or not losses.numel():
            return self.importance
        mean = float(losses.detach().float().mean())
        if not (math.isfinite(mean) and mean > 0):
            self.importance = 1.0
            return self.importance
        self._losses.append(math.log(mean))
        self.importance = 0.5 + detrended_rank(list(self._losses)) if len(self._losses) >= MIN_HISTORY else 1.0
        return self.importance

    # -- the choice --------------------------------------------------------------------------

    def ratio(self, base: float | None = None, scale: float = 1.0) -> float:
        """The ratio for the current signals (see :func:`policy_ratio`)."""
        return policy_ratio(self.settings, self.importance, self.pace, base,
                            spare_ratio=self.spare_ratio, scale=scale)

    def choose(self, losses: torch.Tensor | None, transport: Transport | None, base: float | None = None,
               *, compute_seconds: float | None = None, scale: float = 1.0) -> float:
        """Take in this step's losses and compute time and the exchanges since the last step;
        the ratio to send with."""
        self.observe_losses(losses)
        if compute_seconds is not None and compute_seconds > 0:
            self._compute.append(compute_seconds)
        if transport is not None:
            self.observe_network(transport)
            self._bytes_at_choice = transport.stats.bytes_sent
        self._ratio = self.ratio(base, scale)
        return self._ratio

    def metrics(self, transport: Transport | None = None) -> dict[str, float]:
        """The signals for metrics.jsonl; with ``transport``, also the bytes sent since the last
        :meth:`choose` (``step_bytes_sent``: this step's)."""
        out = {"importance": self.importance, "congestion": self.congestion, "slowdown": self.slowdown}
        if self.cluster_congestion is not None:
            out["cluster_congestion"] = self.cluster_congestion
        if transport is not None and self._bytes_at_choice is not None:
            out["step_bytes_sent"] = transport.stats.bytes_sent - self._bytes_at_choice
        if self.idle_rate is not None:
            out["idle_mbit_s"] = self.idle_rate * 8e-6
        if self.latency is not None:
            out["latency_ms"] = self.latency * 1e3
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The loss history (the link is measured again after a resume)."""
        return {"losses": torch.tensor(list(self._losses), dtype=torch.float64)} if self._losses else {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if "losses" in state:
            self._losses.clear()
            self._losses.extend(float(v) for v in state["losses"].tolist())


class AdaptiveGroupTopK(GroupTopK):
    """Group top-k whose ratio an :class:`AdaptivePolicy` sets per call (``CompressInfo.ratio``);
    ``ratio`` is the policy's base, used when a call gives none."""

    name = "adaptive"

    def __init__(self, settings: AdaptiveSettings) -> None:
        super().__init__(settings.base, group=settings.group)
        self.settings = settings

    def spec(self) -> str:
        return self.settings.spec()
