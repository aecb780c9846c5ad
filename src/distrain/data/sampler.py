"""Which samples a worker trains on at each step: a pure function of (seed, rank, step)."""

from __future__ import annotations

import numpy as np
import torch


class ShardSampler:
    """Endless reshuffled passes over one worker's shard, addressable by step.

    Pass ``p`` of worker ``rank`` is a permutation seeded by ``(seed, rank, p)``; step ``s``
    takes positions ``[s * batch_size, (s + 1) * batch_size)`` of the concatenated passes. So
    the batch of any step can be recomputed (resume, reference runs in tests) without replaying
    the ones before it, and shards of unequal size (non-iid) still give every worker the same
    number of steps.

    Args:
        indices: the shard, as indices into the training set.
        batch_size: samples per step.
        seed: the run's seed.
        rank: the worker's rank.

    Example::

        sampler = ShardSampler(np.arange(100), batch_size=10, seed=0, rank=1)
        first = sampler.batch(0)  # LongTensor of 10 training-set indices
    """

    def __init__(
        self, indices: np.ndarray | torch.Tensor, batch_size: int, seed: int, rank: int
    ) -> None:
        self.indices = torch.as_tensor(np.asarray(indices), dtype=torch.long)
        if len(self.indices) == 0:
            raise ValueError(f"worker {rank} has an empty shard")
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self._pass = -1
        self._order = self.indices

    def _order_of(self, pass_index: int) -> torch.Tensor:
        if pass_index != self._pass:
            g = torch.Generator().manual_seed(
                (self.seed * 1_000_003 + self.rank) * 1_000_003 + pass_index
            )
            self._order = self.indices[torch.randperm(len(self.indices), generator=g)]
            self._pass = pass_index
        return self._order

    def batch(self, step: int) -> torch.Tensor:
        """Training-set indices of this worker's batch at ``step``."""
        n = len(self.indices)
        start = step * self.batch_size
        out = []
        while sum(len(o) for o in out) < self.batch_size:
            pass_index, offset = divmod(start, n)
            take = min(self.batch_size - sum(len(o) for o in out), n - offset)
            out.append(self._order_of(pass_index)[offset : offset + take])
            start += take
        return out[0] if len(out) == 1 else torch.cat(out)
