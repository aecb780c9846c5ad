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
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from distrain.runtime.membership import LinkMissed

PREFIX = "distrain/" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") + "/store-group/"


class StoreGroup:
    """``members`` (global ranks, in order) meeting through ``store``; this process is ``me``."""

    def __init__(self, store: dist.Store, members: list[int], me: int, timeout: float = 60.0, *,
                 name: str | None = None, gone: Callable[[int], bool] | None = None) -> None:
        """``name``: the group's keys' prefix (default: from the members); ``gone(rank)``: whether
        a member is lost, so that a wait for its part ends at once (None: waits last ``timeout``)."""
        self.store, self.members = store, list(members)
        self.rank, self.world_size = self.members.index(me), len(self.members)
        self.timeout = datetime.timedelta(seconds=timeout)
        self._name = PREFIX + (name or "_".join(map(str, self.members)))
        self._gone = gone
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
        self._wait(keys)
        return [torch.frombuffer(bytearray(self.store.get(k)), dtype=mine.dtype).reshape(mine.shape).to(tensor.device)
                for k in keys]

    def control_all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` in place over the members."""
        total = torch.stack(self.control_all_gather(tensor)).sum(0)
        return tensor.copy_(total)

    def control_barrier(self) -> None:
        self.control_all_gather(torch.zeros(1, dtype=torch.uint8))

    def _wait(self, keys: list[str]) -> None:
        if self._gone is None:
            self.store.wait(keys, self.timeout)
            return
        # Polled (a timed store wait logs a warning each time it times out): a member found lost
        # ends the wait within a poll.
        deadline = time.monotonic() + self.timeout.total_seconds()
        while missing := [m for m, k in zip(self.members, keys, strict=True) if not self.store.check([k])]:
            if lost := [m for m in missing if self._gone(m)]:
                raise LinkMissed(lost, f"rank(s) {lost} lost during a collective over the store")
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank(s) {missing} did not take part in a collective over the store within "
                                   f"{self.timeout.total_seconds():g} s")
            time.sleep(WAIT_POLL_S)


#: how often a wait over the store looks again (its collectives are few and small)
WAIT_POLL_S = 0.005
