"""Bookkeeping collectives over the rendezvous store, for the processes left after a loss.

A gloo group over some processes must be created by all of them with the same view of the
groups made before (torch names a locally synchronised group from the number of groups each
process knows, which differs between a parameter server and a worker), so the few small
collectives that end a run (the summary's rows, the closing barrier) go through the launcher's
store instead: each member writes its tensor's bytes under a key of its own and reads the others'.
Tensors only, as raw bytes; never for training traffic.

Example::

    group = StoreGroup(store, members=[1, 2, 3, 4, 5], me=4)
    rows = group.control_all_gather(torch.tensor([1.0, 2.0], dtype=torch.float64))
    group.control_barrier()
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

PREFIX = "distrain/" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") + "/store-group/"


class StoreGroup:
    """``members`` (global ranks, in order) meeting through ``store``; this process is ``me``."""

    def __init__(self, store: dist.Store, members: list[int], me: int, timeout: float = 60.0) -> None:
        self.store, self.members = store, list(members)
        self.rank, self.world_size = self.members.index(me), len(self.members)
        self.timeout = datetime.timedelta(seconds=timeout)
        self._name = PREFIX + "_".join(map(str, self.members))
        self._ops = 0  # every member makes the same calls in the same order: the nth uses keys of its own

    def global_rank(self, rank: int) -> int:
        return self.members[rank]

    def _keys(self) -> list[str]:
        self._ops += 1
        return [f"{self._name}/{self._ops}/{m}" for m in self.members]

    def control_all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every member's ``tensor`` (the same shape and type everywhere), in member order."""
        keys = self._keys()
        mine = tensor.detach().cpu().contiguous()
        self.store.set(keys[self.rank], mine.view(torch.uint8).reshape(-1).numpy().tobytes())
        self.store.wait(keys, self.timeout)
        return [torch.frombuffer(bytearray(self.store.get(k)), dtype=mine.dtype).reshape(mine.shape).to(tensor.device)
                for k in keys]

    def control_all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` in place over the members."""
        total = torch.stack(self.control_all_gather(tensor)).sum(0)
        return tensor.copy_(total)

    def control_barrier(self) -> None:
        self.control_all_gather(torch.zeros(1, dtype=torch.uint8))
