"""A link between a few processes over a gloo group of their own (two threads here): peers are
named, and traffic counted, by their ranks in the run."""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from distrain.comm.link import open_link


def test_a_link_carries_tensors_between_run_ranks_and_counts_them():
    store, ranks = dist.HashStore(), [4, 5, 0]  # two servers of four workers, and worker 0
    out: dict[int, dict] = {}

    def process(me: int) -> None:
        link = open_link(dist.PrefixStore("link", store), ranks, me, world_size=6, timeout=30)
        if me == 0:
            got = [torch.zeros(3), torch.zeros(3)]
            for h in [link.recv(got[0], 4), link.recv(got[1], 5)]:
                h.wait()
            link.send(torch.tensor([7], dtype=torch.int64), 5).wait()
            out[me] = {"got": got}
        else:
            link.send(torch.full((3,), float(me)), 0).wait()
            if me == 5:
                back = torch.zeros(1, dtype=torch.int64)
                link.recv(back, 0).wait()
                out[me] = {"back": int(back)}
        out.setdefault(me, {}).update(rank=link.rank, sent=link.stats.sent, received=link.stats.received)

    threads = [threading.Thread(target=process, args=(me,)) for me in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [t.tolist() for t in out[0]["got"]] == [[4.0] * 3, [5.0] * 3] and out[5]["back"] == 7
    assert out[0]["rank"] == 0 and out[4]["rank"] == 4
    assert out[0]["received"] == [0, 0, 0, 0, 12, 12] and out[0]["sent"] == [0, 0, 0, 0, 0, 8]
    assert out[4]["sent"] == [12, 0, 0, 0, 0, 0] and out[5]["received"] == [8, 0, 0, 0, 0, 0]
