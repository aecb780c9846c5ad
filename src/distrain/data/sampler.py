"""Which samples a worker trains on at each step: a pure function of (seed, rank, step), and of
the membership changes an elastic run went through (:class:`DataPlan`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

_P = 1_000_003
_EMPTY = torch.zeros(0, dtype=torch.long)


class ShardSampler:
    """Endless reshuffled passes over one worker's shard, addressable by step.

    Pass ``p`` of worker ``rank`` is a permutation seeded by ``(seed, rank, p)``; step ``s``
    takes positions ``[s * batch_size, (s + 1) * batch_size)`` of the concatenated passes. So
    the batch of any step can be recomputed (resume, reference runs in tests) without replaying
    the ones before it, and shards of unequal size (non-iid) still give every worker the same
    number of steps.

    After a change of an elastic run's members (see :class:`DataPlan`), a worker's sampler
    starts at step ``start`` with ``carry``: the rest of the epoch the change interrupted that is
    this worker's to train on (its own, and its part of what the lost workers had left), taken
    before the passes over its new shard; ``segment`` (the changes so far) seeds those passes.

    Args:
        indices: the shard, as indices into the training set.
        batch_size: samples per step.
        seed: the run's seed.
        rank: the worker's rank (its id in an elastic run).
        carry: training-set indices taken first, from step ``start`` on.
        start: the first step this sampler gives.
        segment: 0 for a run's first members, then one more at each change.

    Example::

        sampler = ShardSampler(np.arange(100), batch_size=10, seed=0, rank=1)
        first = sampler.batch(0)  # LongTensor of 10 training-set indices
    """

    def __init__(
        self, indices: np.ndarray | torch.Tensor, batch_size: int, seed: int, rank: int, *,
        carry: torch.Tensor | None = None, start: int = 0, segment: int = 0,
    ) -> None:
        self.indices = torch.as_tensor(np.asarray(indices), dtype=torch.long)
        if len(self.indices) == 0:
            raise ValueError(f"worker {rank} has an empty shard")
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.carry = _EMPTY if carry is None else torch.as_tensor(carry, dtype=torch.long)
        self.start, self.segment = start, segment
        self._pass = -1
        self._order = self.indices

    def _order_of(self, pass_index: int) -> torch.Tensor:
        if pass_index != self._pass:
            key = (self.seed * _P + self.rank) * _P + pass_index
            if self.segment:  # the first members' passes are those of a run without changes
                key = (key * _P + self.segment) % 2**63
            g = torch.Generator().manual_seed(key)
            self._order = self.indices[torch.randperm(len(self.indices), generator=g)]
            self._pass = pass_index
        return self._order

    def _take(self, position: int, count: int) -> torch.Tensor:
        """``count`` indices from ``position`` of the carry followed by the passes."""
        n, c, out = len(self.indices), len(self.carry), []
        while count > 0:
            if position < c:
                take = min(count, c - position)
                out.append(self.carry[position : position + take])
            else:
                pass_index, offset = divmod(position - c, n)
                take = min(count, n - offset)
                out.append(self._order_of(pass_index)[offset : offset + take])
            position += take
            count -= take
        return out[0] if len(out) == 1 else torch.cat(out)

    def batch(self, step: int) -> torch.Tensor:
        """Training-set indices of this worker's batch at ``step``."""
        if step < self.start:
            raise ValueError(f"worker {self.rank}'s samples start at step {self.start}, not {step}")
        return self._take((step - self.start) * self.batch_size, self.batch_size)

    def pending(self, steps: int) -> torch.Tensor:
        """What this worker has left of its current epoch after ``steps`` steps of the run: the
        rest of its carry, or else of its current pass."""
        position = max(0, steps - self.start) * self.batch_size
        c = len(self.carry)
        if position < c:
            return self.carry[position:]
        pass_index, offset = divmod(position - c, len(self.indices))
        return self._order_of(pass_index)[offset:]


@dataclass
class DataPlan:
    """Every member's sampler in an elastic run, the same on each member.

    A run starts with one shard per worker. When the members change at a step (see
    :meth:`changed`), every sample that the epoch under way had still to give is given in it:
    each survivor keeps what its epoch had left, and what the lost workers had left (from where
    the model stops holding their steps) is dealt out in equal parts over the new members. Each
    member then goes on with reshuffled passes over its shard of the training set split again
    over the new members. A worker that joins has nothing left of the epoch under way: it starts
    on its new shard at once (its samples in that epoch may come twice; none is missed).

    Args:
        samplers: every member's sampler, by id, in rank order.
        segment: the changes so far.

    Example::

        plan = DataPlan.first(parts, batch_size=32, seed=0)          # 4 workers
        plan = plan.changed([1, 2, 3], step=40, kept={0: 40}, parts=split_over_3)
        plan.samplers[2].batch(40)   # worker 2's batch of the redone step 40
    """

    samplers: dict[int, ShardSampler]
    segment: int = 0

    @classmethod
    def first(cls, parts: Sequence[np.ndarray | torch.Tensor], batch_size: int, seed: int) -> DataPlan:
        """The run's first members: worker ``r`` on ``parts[r]``."""
        return cls({r: ShardSampler(p, batch_size, seed, r) for r, p in enumerate(parts)})

    @property
    def members(self) -> list[int]:
        return list(self.samplers)

    def changed(self, members: list[int], step: int, kept: dict[int, int],
                parts: Sequence[np.ndarray | torch.Tensor], carry: bool = True) -> DataPlan:
        """The plan from ``step`` on for ``members`` (ids in rank order; ``parts[i]`` is the
        shard of the ``i``-th). ``kept``: for each member that left, how many of its steps the
        model holds (its samples from there on are dealt out). Without ``carry`` (asynchronous
        workers, at no common step) the new shards start at once, addressed by step from 0."""
        any_sampler = next(iter(self.samplers.values()))
        batch, seed, segment = any_sampler.batch_size, any_sampler.seed, self.segment + 1
        if not carry:
            return DataPlan({m: ShardSampler(parts[i], batch, seed, m) for i, m in enumerate(members)}, segment)
        gone = [w for w in self.samplers if w not in members]
        left = [self.samplers[w].pending(kept.get(w, step)) for w in sorted(gone)]
        dealt = torch.tensor_split(torch.cat([_EMPTY, *left]), len(members))
        out = {}
        for i, m in enumerate(members):
            own = self.samplers[m].pending(step) if m in self.samplers else _EMPTY
            out[m] = ShardSampler(parts[i], batch, seed, m, carry=torch.cat([own, dealt[i]]), start=step,
                                  segment=segment)
        return DataPlan(out, segment)

    def state(self) -> torch.Tensor:
        """The plan as one int64 tensor (checkpoints, and a joiner, which reads it from the
        run's store): segment, members, then each member's start, carry length and carry."""
        ids = self.members
        head = [self.segment, len(ids), *ids]
        for m in ids:
            s = self.samplers[m]
            head += [s.start, len(s.carry)]
        return torch.cat([torch.tensor(head, dtype=torch.long), *(self.samplers[m].carry for m in ids)])

    @classmethod
    def from_state(cls, state: torch.Tensor, parts_for: Callable[[int], Sequence[np.ndarray | torch.Tensor]],
                   batch_size: int, seed: int) -> DataPlan:
        """The plan :meth:`state` wrote; ``parts_for(n)``: the training set split over ``n``."""
        values = state.tolist()
        segment, n = int(values[0]), int(values[1])
        ids = [int(v) for v in values[2 : 2 + n]]
        heads = values[2 + n : 2 + 3 * n]
        if len(values) != 2 + 3 * n + sum(heads[1::2]) or len(set(ids)) != n:
            raise ValueError("a data plan that does not add up")
        parts, at, out = parts_for(n), 2 + 3 * n, {}
        for i, m in enumerate(ids):
            start, length = int(heads[2 * i]), int(heads[2 * i + 1])
            out[m] = ShardSampler(parts[i], batch_size, seed, m, carry=state[at : at + length].clone(), start=start,
                                  segment=segment)
            at += length
        return cls(out, segment)


__all__ = ["DataPlan", "ShardSampler"]
