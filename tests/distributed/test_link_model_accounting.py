"""Exact byte accounting of every Transport operation, with and without the link model.

The counters must not depend on emulation: the same operations count the same bytes, peer by
peer, and what one worker sent to another is what that one received from it.
"""

from __future__ import annotations

import pytest
import torch

from distrain.comm import Transport, ring_all_reduce
from distrain.emulation import LinkModel, NetworkSpec
from tests.harness import run_group

NUMEL = 600  # float64, divisible by 2, 3 and 4 workers


def _ops_body(rank: int, world: int, emulate: bool) -> dict:
    model = LinkModel(NetworkSpec.uniform(world, 1e9, 0.0005, jitter=0.0002), rank) if emulate else None
    transport = Transport(link_model=model)
    counts: dict[str, tuple[list[int], list[int]]] = {}
    results: dict[str, torch.Tensor] = {}

    def measure(name: str, fn) -> None:
        sent, received = list(transport.stats.sent), list(transport.stats.received)
        fn()
        counts[name] = ([a - b for a, b in zip(transport.stats.sent, sent, strict=True)],
                        [a - b for a, b in zip(transport.stats.received, received, strict=True)])

    x = torch.arange(NUMEL, dtype=torch.float64) + 1000 * rank

    def p2p() -> None:  # a ring of sends: to the successor, from the predecessor
        out = torch.empty(NUMEL // 2, dtype=torch.float64)
        handles = [transport.send(x[: NUMEL // 2].clone(), transport.next_rank), transport.recv(out, transport.prev_rank)]
        for h in handles:
            h.wait()
        results["p2p"] = out

    def pairwise() -> None:  # pairs (0,1), (2,3): send x, receive the partner's
        peer = rank ^ 1
        if peer < world:
            theirs = torch.empty_like(x)
            transport.exchange(x.clone(), theirs, peer).wait()
            results["pairwise"] = theirs

    def all_reduce() -> None:
        t = x.clone()
        transport.all_reduce(t).wait()
        results["all_reduce"] = t

    def own_ring() -> None:
        t = x.clone()
        ring_all_reduce(transport, t)
        results["own_ring"] = t

    def reduce_scatter() -> None:
        out = torch.empty(NUMEL // world, dtype=torch.float64)
        transport.reduce_scatter(out, list(x.clone().chunk(world))).wait()
        results["reduce_scatter"] = out

    def all_gather() -> None:
        outs = [torch.empty(NUMEL // world, dtype=torch.float64) for _ in range(world)]
        transport.all_gather(outs, x[: NUMEL // world].clone()).wait()
        results["all_gather"] = torch.stack(outs)

    def broadcast() -> None:
        t = x.clone()
        transport.broadcast(t, src=1).wait()
        results["broadcast"] = t

    for name, fn in [("p2p", p2p), ("pairwise", pairwise), ("all_reduce", all_reduce), ("own_ring", own_ring),
                     ("reduce_scatter", reduce_scatter), ("all_gather", all_gather), ("broadcast", broadcast)]:
        measure(name, fn)
    transport.close()
    return {"counts": {k: (torch.tensor(s), torch.tensor(r)) for k, (s, r) in counts.items()}, "results": results}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world,emulate", [(3, False), (4, True)])
def test_every_operation_counts_exact_bytes_per_peer(world, emulate):
    out = run_group(_ops_body, world, args=(emulate,))
    M = NUMEL * 8
    xs = [torch.arange(NUMEL, dtype=torch.float64) + 1000 * r for r in range(world)]
    total = sum(xs)
    piece = M // world
    for rank, o in enumerate(out):
        res, counts = o["results"], o["counts"]
        nxt, prv = (rank + 1) % world, (rank - 1) % world

        def only(peer: int, n: int) -> torch.Tensor:
            t = torch.zeros(world, dtype=torch.int64)
            t[peer] = n
            return t

        # results are right, so the bytes counted are bytes that really moved
        torch.testing.assert_close(res["p2p"], xs[prv][: NUMEL // 2])
        torch.testing.assert_close(res["all_reduce"], total)
        torch.testing.assert_close(res["own_ring"], total)
        torch.testing.assert_close(res["reduce_scatter"], total.chunk(world)[rank])
        torch.testing.assert_close(res["all_gather"], torch.stack([xr[: NUMEL // world] for xr in xs]))
        torch.testing.assert_close(res["broadcast"], xs[1])
        # point to point: exactly the tensor's bytes, to and from the right peer
        assert torch.equal(counts["p2p"][0], only(nxt, M // 2)) and torch.equal(counts["p2p"][1], only(prv, M // 2))
        peer = rank ^ 1
        if peer < world:
            torch.testing.assert_close(res["pairwise"], xs[peer])
            assert torch.equal(counts["pairwise"][0], only(peer, M)) and torch.equal(counts["pairwise"][1], only(peer, M))
        else:
            assert int(counts["pairwise"][0].sum()) == 0
        # ring collectives: 2(n-1)/n M for an all-reduce, (n-1)/n M for reduce-scatter / all-gather
        for name, n in [("all_reduce", 2 * (world - 1) * piece), ("own_ring", 2 * (world - 1) * piece),
                        ("reduce_scatter", (world - 1) * piece), ("all_gather", (world - 1) * piece)]:
            assert torch.equal(counts[name][0], only(nxt, n)), (name, counts[name][0])
            assert torch.equal(counts[name][1], only(prv, n)), (name, counts[name][1])
        # broadcast from 1 along the ring: everyone but the last forwards M, everyone but 1 receives M
        assert int(counts["broadcast"][0].sum()) == (0 if rank == 0 else M)
        assert int(counts["broadcast"][1].sum()) == (0 if rank == 1 else M)
    # conservation, per operation and per pair of workers
    for name in out[0]["counts"]:
        for a in range(world):
            for b in range(world):
                assert int(out[a]["counts"][name][0][b]) == int(out[b]["counts"][name][1][a]), (name, a, b)
