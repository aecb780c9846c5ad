"""Bandwidth traces: piecewise-constant bandwidth per worker over time, read from a file.

CSV (``.csv`` or any other extension), one change per line, ``#`` starts a comment::

    time_s,worker,bandwidth        # header, optional
    0,*,50mbit                     # every worker's link: 50 Mbit/s from t = 0
    0,1,5mbit                      # worker 1: 5 Mbit/s from t = 0 (a worker line beats a * line)
    2.5,1,50mbit                   # worker 1 back to 50 Mbit/s at t = 2.5 s
    4,last,10mbit                  # 'last' is the highest rank
    5,*,repeat                     # optional, last line: the schedule repeats every 5 s

JSON: ``{"period_s": 5, "schedule": [{"time_s": 0, "worker": "*", "bandwidth": "50mbit"}, ...]}``
(``period_s`` optional; a bare list of entries works too).

Times are seconds since training started (all workers start their clocks together, after the
first barrier). A worker's bandwidth at time t is set by the latest line at or before t that
names it or ``*``; before its first line it has the run's ``--bandwidth`` (or none: unlimited).
Lines are in time order. A worker's bandwidth applies to its link (both directions).
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from pathlib import Path

from distrain.emulation.units import parse_bandwidth
from distrain.errors import ConfigError

SETTING = "--bandwidth-trace"
ALL = "*"


@dataclass(frozen=True)
class TraceEntry:
    """From ``time_s`` on, ``worker`` (a rank, ``"*"`` or ``"last"``) has ``bits_per_s``."""

    time_s: float
    worker: int | str
    bits_per_s: float


@dataclass
class BandwidthTrace:
    """A parsed trace file; ``resolve(world)`` turns it into one schedule per worker."""

    entries: list[TraceEntry]
    period_s: float | None = None

    @classmethod
    def load(cls, path: str | Path) -> BandwidthTrace:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(SETTING, f"file {str(path)!r} does not exist")
        text = path.read_text()
        if path.suffix == ".json":
            return cls.parse_json(text, str(path))
        return cls.parse_csv(text, str(path))

    @classmethod
    def parse_csv(cls, text: str, source: str = "trace") -> BandwidthTrace:
        rows: list[tuple[int, list[str]]] = []
        for number, line in enumerate(text.splitlines(), start=1):
            line = line.split("#", 1)[0].strip()
            if line:
                rows.append((number, [f.strip() for f in line.split(",")]))
        if rows and rows[0][1][:1] == ["time_s"]:
            rows = rows[1:]
        builder = _Builder(source, "line")
        for number, fields in rows:
            if len(fields) != 3:
                builder.fail(number, f"expected 3 fields time_s,worker,bandwidth, got {len(fields)}")
            builder.add(number, *fields)
        return builder.done()

    @classmethod
    def parse_json(cls, text: str, source: str = "trace") -> BandwidthTrace:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(SETTING, f"{source} line {exc.lineno}: not valid JSON ({exc.msg})") from None
        period = None
        if isinstance(data, dict):
            period = data.get("period_s")
            data = data.get("schedule")
        if not isinstance(data, list):
            raise ConfigError(SETTING, f"{source}: expected a list of entries or {{\"schedule\": [...]}}")
        builder = _Builder(source, "entry")
        for number, entry in enumerate(data, start=1):
            if not isinstance(entry, dict) or set(entry) != {"time_s", "worker", "bandwidth"}:
                builder.fail(number, "expected {\"time_s\": ..., \"worker\": ..., \"bandwidth\": ...}")
            builder.add(number, str(entry["time_s"]), str(entry["worker"]), str(entry["bandwidth"]))
        if period is not None:
            builder.add(len(data) + 1, str(period), ALL, "repeat")
        return builder.done()

    def resolve(self, world: int, last: int | None = None) -> list[Schedule | None]:
        """One schedule per rank (None where the trace never names that worker); ``last`` is
        the rank that ``last`` names (default: ``world - 1``)."""
        last = world - 1 if last is None else last
        per_worker: list[list[tuple[float, int, float]]] = [[] for _ in range(world)]
        for order, e in enumerate(self.entries):
            if e.worker == ALL:
                targets = range(world)
            else:
                rank = last if e.worker == "last" else int(e.worker)
                if rank >= world:
                    raise ConfigError(SETTING, f"names worker {rank}, but there are only {world} workers")
                targets = range(rank, rank + 1)
            for r in targets:  # at equal times a line naming the worker beats a '*' line
                per_worker[r].append((e.time_s, 1 if e.worker != ALL else 0, order))
        out: list[Schedule | None] = []
        for rows in per_worker:
            rows.sort()
            out.append(Schedule([t for t, _, _ in rows], [self.entries[i].bits_per_s for _, _, i in rows],
                                self.period_s) if rows else None)
        return out


class _Builder:
    """Checks entries one by one, with errors naming the line (or JSON entry)."""

    def __init__(self, source: str, unit: str) -> None:
        self.source, self.unit = source, unit
        self.entries: list[TraceEntry] = []
        self.period: float | None = None

    def fail(self, number: int, message: str) -> None:
        raise ConfigError(SETTING, f"{self.source} {self.unit} {number}: {message}")

    def add(self, number: int, time_text: str, worker_text: str, bandwidth_text: str) -> None:
        if self.period is not None:
            self.fail(number, "nothing may follow the 'repeat' line")
        try:
            time_s = float(time_text)
        except ValueError:
            time_s = math.nan
        if not (math.isfinite(time_s) and time_s >= 0):
            self.fail(number, f"time_s must be a number of seconds >= 0, got {time_text!r}")
        if self.entries and time_s < self.entries[-1].time_s:
            self.fail(number, f"time {time_s:g} is earlier than the line before ({self.entries[-1].time_s:g}); keep lines in time order")
        worker: int | str
        if worker_text in (ALL, "all"):
            worker = ALL
        elif worker_text == "last":
            worker = "last"
        elif worker_text.isdigit():
            worker = int(worker_text)
        else:
            self.fail(number, f"worker must be a rank (0, 1, ...), '*' or 'last', got {worker_text!r}")
        if bandwidth_text == "repeat":
            if worker != ALL or time_s <= 0:
                self.fail(number, "a repeat line looks like 'PERIOD,*,repeat' with PERIOD > 0")
            if self.entries and time_s <= self.entries[-1].time_s:
                self.fail(number, f"the repeat period {time_s:g} must be later than every change")
            self.period = time_s
            return
        try:
            bits = parse_bandwidth(bandwidth_text, SETTING)
        except ConfigError:
            self.fail(number, f"bandwidth must look like 100mbit or 500kbit (bits/s) or 10mbps (bytes/s), got {bandwidth_text!r}")
        self.entries.append(TraceEntry(time_s, worker, bits))

    def done(self) -> BandwidthTrace:
        if not self.entries:
            raise ConfigError(SETTING, f"{self.source}: no entries")
        return BandwidthTrace(self.entries, self.period)


@dataclass
class Schedule:
    """One worker's bandwidth over time (bits/s), piecewise constant, optionally periodic."""

    times: list[float]
    values: list[float]
    period_s: float | None = None

    def at(self, t: float) -> float | None:
        """Bandwidth at time ``t``; None before the first change (the run's base bandwidth)."""
        cycles = 0
        if self.period_s is not None and t >= self.period_s:
            cycles, t = divmod(t, self.period_s)
        i = bisect.bisect_right(self.times, t) - 1
        if i >= 0:
            return self.values[i]
        return self.values[-1] if cycles else None

    def next_change(self, t: float) -> float:
        """The first time after ``t`` at which the bandwidth may change (inf if never); always
        strictly later than ``t``, also where rounding puts ``t`` on a change point (``base +
        times[i]`` can round back to ``t``: callers that step from change to change would spin)."""
        probe = t
        while True:
            change = self._next_change(probe)
            if change > t:
                return change
            probe = math.nextafter(max(probe, change), math.inf)

    def _next_change(self, t: float) -> float:
        base = 0.0
        if self.period_s is not None and t >= 0:
            cycles, _ = divmod(t, self.period_s)
            base = cycles * self.period_s
        i = bisect.bisect_right(self.times, t - base)
        if i < len(self.times):
            return base + self.times[i]
        if self.period_s is not None:
            return base + self.period_s + self.times[0]
        return math.inf
