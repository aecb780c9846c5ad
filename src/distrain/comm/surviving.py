"""The collectives that end a run whose workers may be lost at any time, survived.

After training, asynchronous gossip (AD-PSGD, Prague) averages the workers' final models, gathers
their step counts and the summary's rows, and meets in a last barrier. A worker lost during one of
these collectives used to stop the run after all its training was done. :class:`SurvivingGroup`
runs each of them as an operation with a commit:

1. the operation runs over the current group (at first the workers' own gloo group);
2. each member marks its outcome in the launcher's store, ``ok`` or ``fail``, with
   ``compare_set``: a member that finds another declared dead (its launcher saw it exit) marks
   that one ``gone`` in its place, and whichever mark comes first is the only one, so every
   member reads the same marks;
3. when every member marked ``ok``, the operation is done (a member lost after its mark took
   part: its share is in every result); otherwise the members still there agree who they are
   (:func:`~distrain.runtime.membership.agree_before_groups`), go on over the store
   (:class:`~distrain.comm.store_group.StoreGroup`) and redo the operation from their own
   inputs again.

Every member returns from an operation with the same result over the same members, so the
consensus model, the checkpoint's step counts and the summary agree; a member marked ``gone``
while it was alive (silent too long) leaves with :class:`~distrain.runtime.membership.LeftOut`.

Example::

    group = SurvivingGroup(Transport(), members=[0, 1, 2, 3], me=1, store=store, timeout=120, key="adpsgd")
    total = group.control_all_reduce(torch.ones(3))  # the sum over whoever is left at its end
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from distrain.comm.store_group import WAIT_POLL_S, StoreGroup
from distrain.errors import WorkerFailure
from distrain.runtime.faults import inject_kill_in, is_comm_error
from distrain.runtime.health import dead_since, declared_dead
from distrain.runtime.membership import PREFIX, LeftOut, LinkMissed, agree_before_groups

log = logging.getLogger(__name__)

T = TypeVar("T")

OK, FAIL, GONE = "ok", "fail", "gone"


class ControlGroup(Protocol):
    """What the closing collectives run over: a :class:`~distrain.comm.transport.Transport` or a
    :class:`~distrain.comm.store_group.StoreGroup`."""

    world_size: int

    def control_all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]: ...
    def control_all_reduce(self, tensor: torch.Tensor) -> torch.Tensor: ...
    def control_barrier(self) -> None: ...


class SurvivingGroup:
    """``members`` (global ranks, in order) ending a run over ``group``, this process ``me``;
    ``store``: the launcher's, where deaths are declared; ``key`` names this run's marks."""

    def __init__(self, group: ControlGroup, members: list[int], me: int, store: dist.Store, timeout: float,
                 key: str) -> None:
        self.group, self.members, self.me = group, list(members), me
        self.store, self.timeout, self.key = store, timeout, key
        self._marks = dist.PrefixStore(f"{PREFIX}/closing/{key}", store)
        self._ops = 0  # every member runs the same operations in the same order
        self._generation = 0
        #: members lost during these collectives: global rank -> when declared dead (Unix time)
        self.lost: dict[int, float] = {}

    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def rank(self) -> int:
        return self.members.index(self.me)

    def global_rank(self, rank: int) -> int:
        return self.members[rank]

    def control_all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return self._run(lambda group: group.control_all_gather(tensor))

    def control_all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` in place over the members left when it is done."""
        mine = tensor.detach().clone()  # a redo sums this worker's own values again
        return self._run(lambda group: group.control_all_reduce(tensor.copy_(mine)))

    def control_barrier(self) -> None:
        self._run(lambda group: group.control_barrier())

    def _run(self, operation: Callable[[Any], T]) -> T:
        while True:
            self._ops += 1
            try:
                result, outcome = operation(self.group), OK
            except Exception as exc:  # noqa: BLE001 - sorted below
                if not (is_comm_error(exc) or isinstance(exc, LinkMissed | TimeoutError)):
                    raise
                log.debug("worker %d: closing collective %d failed: %r", self.me, self._ops, exc)
                result, outcome = None, FAIL
            inject_kill_in(f"closing-{self._ops}", self.me)  # tests: lost between an operation and its mark
            marks = self._marks_of_all(outcome)
            if all(mark == OK for mark in marks.values()):
                return result  # type: ignore[return-value]
            self._regroup([m for m in self.members if marks[m] != GONE])

    def _marks_of_all(self, outcome: str) -> dict[int, str]:
        """Every member's mark of the current operation (see the module's docstring)."""
        key = f"{self._ops}/{{}}"
        if self._marks.compare_set(key.format(self.me), "", outcome).decode() == GONE:
            raise LeftOut(f"worker {self.me} was taken for lost by the others as the run ended; leaving")
        marks: dict[int, str] = {}
        deadline = time.monotonic() + self.timeout
        while waiting := [m for m in self.members if m not in marks]:
            for m in waiting:
                if self._marks.check([key.format(m)]):
                    marks[m] = self._marks.get(key.format(m)).decode()
                elif declared_dead(self.store, m):
                    marks[m] = self._marks.compare_set(key.format(m), "", GONE).decode()
            if len(marks) < len(self.members):
                if time.monotonic() > deadline:
                    missing = sorted(set(self.members) - set(marks))
                    raise WorkerFailure(f"worker {self.me}: worker(s) {missing} did not end the run within "
                                        f"{self.timeout:g} s")
                time.sleep(WAIT_POLL_S)
        return marks

    def _regroup(self, candidates: list[int]) -> None:
        """Agree with the other ``candidates`` on who is left and go on over the store."""
        self._generation += 1
        name = f"closing/{self.key}/{self._generation}"
        came = agree_before_groups(self.store, self.me, len(self.members), self.timeout, "the run's last collectives",
                                   name, members=candidates)
        if (gone := sorted(set(self.members) - set(came))) and came[0] == self.me:  # one line for the run
            log.warning("worker %d: lost worker(s) %s as the run ended; its last collectives go on over workers %s",
                        self.me, gone, came)
        for m in gone:
            self.lost[m] = dead_since(self.store, m) or time.time()
        self.members = came
        self.group = StoreGroup(self.store, came, self.me, self.timeout, name=name,
                                gone=lambda r: declared_dead(self.store, r))
