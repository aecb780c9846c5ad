"""The run's last collectives survive a member lost on the way (distrain.comm.surviving): each
member of a real TCPStore's run ends every operation with its mark, and the members left redo an
operation that was not through everywhere, over the store, with the same result on each."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from distrain.comm.store_group import StoreGroup
from distrain.comm.surviving import SurvivingGroup
from distrain.runtime.health import declare_dead, declared_dead

pytestmark = pytest.mark.timeout(60)


def _client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=20))


def _run(members: list[int], body, port: int, absent: tuple[int, ...] = ()) -> dict[int, object]:  # noqa: ANN001
    """``body(group, me)`` on a thread per member but the ``absent`` ones, each with its own store
    client; their results."""
    results: dict[int, object] = {}
    errors: list[BaseException] = []

    def member(me: int) -> None:
        try:
            store = _client(port)
            first = StoreGroup(store, members, me, timeout=20, name="first", gone=lambda r: declared_dead(store, r))
            results[me] = body(SurvivingGroup(first, members, me, store, timeout=20, key="test"), me)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(m,)) for m in members if m not in absent]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    return results


def test_a_member_lost_before_its_part_is_left_out_and_every_other_gets_the_same_sum():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=20),
                           wait_for_workers=False)
    declare_dead(_client(server.port), 2)  # member 2 of 0..3 never comes (its launcher saw it exit)

    def body(group: SurvivingGroup, me: int) -> tuple:
        total = group.control_all_reduce(torch.tensor([float(me + 1)]))
        rows = group.control_all_gather(torch.tensor([me]))
        group.control_barrier()
        return float(total), [int(r) for r in rows], group.members, dict(group.lost)

    results = _run([0, 1, 2, 3], body, server.port, absent=(2,))
    assert sorted(results) == [0, 1, 3]
    for total, rows, members, lost in results.values():
        assert total == 1 + 2 + 4  # members 0, 1 and 3's values; nobody's twice
        assert rows == [0, 1, 3] and members == [0, 1, 3] and list(lost) == [2]


def test_without_a_loss_every_operation_is_done_once_over_everyone():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=20),
                           wait_for_workers=False)

    def body(group: SurvivingGroup, me: int) -> tuple:
        sums = [float(group.control_all_reduce(torch.tensor([float(me + k)]))) for k in range(3)]
        return sums, group.members, dict(group.lost)

    results = _run([0, 1, 3], body, server.port)
    for sums, members, lost in results.values():
        assert sums == [4.0 + 3 * k for k in range(3)] and members == [0, 1, 3] and lost == {}
