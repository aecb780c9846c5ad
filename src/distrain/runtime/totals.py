"""What a run did in its earlier segments, carried in checkpoints so that a resumed run's
summary covers the whole run (workers and parameter servers alike)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple


class Offsets(NamedTuple):
    """What the earlier segments of a run add to this one's per-step metrics."""

    wall: float
    sent: int
    received: int


@dataclass
class RunTotals:
    """What a run did in its earlier segments (before the checkpoint it resumed from).

    Checkpoints carry it, so ``summary.json`` covers the whole run however often it was stopped
    and resumed: each process's counters row (``[steps, samples, wall, compute, exposed comm, *sent per
    peer, *received per peer, cpu]``, see :func:`~distrain.train.loop.summarize`) summed over
    segments, the evaluation time, when the target accuracy was first reached (on the run's
    training clock) and each segment's training time. The time a segment spent after its last
    checkpoint, before it died, is lost with its work and is not counted.

    Example::

        totals = RunTotals.from_state(state.get("totals"))   # zeros for a new run
        checkpoint["totals"] = totals.plus(row, eval_s, time_to_target).state_dict()
    """

    row: list[float] = field(default_factory=list)
    eval_s: float = 0.0
    time_to_target_s: float | None = None
    segment_wall_s: list[float] = field(default_factory=list)
    #: membership changes of the earlier segments (``summary.json``'s ``membership`` records)
    changes: list[dict[str, Any]] = field(default_factory=list)
    #: workers the earlier segments lost (id -> Unix time declared dead), with or without a
    #: change of membership (parameter servers serve the others on)
    lost_workers: dict[int, float] = field(default_factory=dict)
    #: parameter servers the earlier segments lost, and those that returned (index -> Unix time)
    lost_servers: dict[int, float] = field(default_factory=dict)
    returned_servers: dict[int, float] = field(default_factory=dict)
    #: the target ``time_to_target_s`` was judged by: ``[target_accuracy, target_loss]`` (None:
    #: not recorded, checkpoints written before 2026-12-02); a run resumed with another target
    #: finds when its earlier segments first met the new one (``distrain.train.loop.retarget``)
    target: list[float | None] | None = None

    @classmethod
    def from_state(cls, state: dict[str, Any] | None) -> RunTotals:
        if not state:
            return cls()
        target = state.get("time_to_target_s")
        return cls(row=[float(v) for v in state.get("row", [])], eval_s=float(state.get("eval_s", 0.0)),
                   time_to_target_s=None if target is None else float(target),
                   segment_wall_s=[float(v) for v in state.get("segment_wall_s", [])],
                   changes=[dict(c) for c in state.get("changes", [])],
                   lost_workers=_times(state.get("lost_workers")), lost_servers=_times(state.get("lost_servers")),
                   returned_servers=_times(state.get("returned_servers")),
                   target=None if state.get("target") is None else [None if v is None else float(v) for v in state["target"]])

    def for_another_worker(self) -> RunTotals:
        """The totals a worker takes from another's checkpoint (it was lost before that one was
        saved): the run's clock, evaluations and changes, none of the other's own counters."""
        row = [0.0] * len(self.row)
        if row:
            row[2] = self.row[2]  # training time is the run's
        return replace(self, row=row)

    def resized(self, peers: int, me: int) -> RunTotals:
        """The totals of process ``me`` once the run goes on with ``peers`` processes (resumed with
        another number of workers): the counters of peers still in the run stay in their columns;
        bytes exchanged with processes no longer in it are counted in this process's own column
        (it sends nothing to itself), so its totals stay whole."""
        old = (len(self.row) - 6) // 2
        if not self.row or old == peers:
            return self

        def fold(columns: list[float]) -> list[float]:
            out = [0.0] * peers
            for i, value in enumerate(columns):
                out[i if i < peers else me] += value
            return out

        head, sent, received, tail = self.row[:5], self.row[5 : 5 + old], self.row[5 + old : 5 + 2 * old], self.row[5 + 2 * old :]
        return replace(self, row=[*head, *fold(sent), *fold(received), *tail])

    @property
    def wall_s(self) -> float:
        """Training time of the earlier segments (the offset of this segment's clock)."""
        return sum(self.segment_wall_s)

    def offsets(self, peers: int) -> Offsets:
        """Where this segment's clock and bytes start, for a process with
        ``peers`` peers (its transport's world size)."""
        row = self.row or [0.0] * (6 + 2 * peers)
        return Offsets(self.wall_s, int(sum(row[5 : 5 + peers])), int(sum(row[5 + peers : 5 + 2 * peers])))

    def total_row(self, row: list[float]) -> list[float]:
        """This segment's counters ``row`` plus the earlier segments'."""
        if not self.row:
            return list(row)
        if len(self.row) != len(row):
            raise ValueError(f"counters of {len(row)} values cannot extend a run's {len(self.row)}")
        return [a + b for a, b in zip(self.row, row, strict=True)]

    def plus(self, row: list[float], eval_s: float, time_to_target_s: float | None,
             changes: list[dict[str, Any]] | None = None, lost_workers: dict[int, float] | None = None,
             lost_servers: dict[int, float] | None = None,
             returned_servers: dict[int, float] | None = None) -> RunTotals:
        """The totals after this segment, whose counters are ``row`` (``row[2]``: its wall time),
        membership changes ``changes``, lost workers ``lost_workers`` and parameter servers lost
        and returned."""
        target = self.time_to_target_s if self.time_to_target_s is not None else time_to_target_s
        return RunTotals(self.total_row(row), self.eval_s + eval_s, target, [*self.segment_wall_s, row[2]],
                         [*self.changes, *(changes or [])], {**self.lost_workers, **(lost_workers or {})},
                         {**self.lost_servers, **(lost_servers or {})},
                         {**self.returned_servers, **(returned_servers or {})}, self.target)

    def state_dict(self) -> dict[str, Any]:
        return {"row": list(self.row), "eval_s": self.eval_s, "time_to_target_s": self.time_to_target_s,
                "segment_wall_s": list(self.segment_wall_s), "changes": [dict(c) for c in self.changes],
                "lost_workers": {str(w): t for w, t in self.lost_workers.items()},
                "lost_servers": {str(s): t for s, t in self.lost_servers.items()},
                "returned_servers": {str(s): t for s, t in self.returned_servers.items()},
                **({} if self.target is None else {"target": list(self.target)})}


def _times(saved: dict[str, float] | None) -> dict[int, float]:
    """A saved ``{id: Unix time}`` record (string keys, as JSON and checkpoints keep them)."""
    return {int(k): float(t) for k, t in (saved or {}).items()}
