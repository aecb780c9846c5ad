"""Transport byte accounting and our ring collectives, over real gloo processes."""

from __future__ import annotations

import pytest
import torch

from distrain.comm import Transport, doubling_all_reduce, ring_all_reduce
from tests.harness import run_group


def _ring_body(rank: int, world: int, numel: int) -> dict:
    transport = Transport()
    g = torch.Generator().manual_seed(rank)
    data = torch.randn(numel, generator=g, dtype=torch.float64)
    mine = data.clone()
    ring_all_reduce(transport, data)
    return {"input": mine, "output": data, "sent": torch.tensor(transport.stats.sent),
            "received": torch.tensor(transport.stats.received)}


def _doubling_body(rank: int, world: int, numel: int) -> dict:
    transport = Transport()
    data = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    mine = data.clone()
    doubling_all_reduce(transport, data)
    return {"input": mine, "output": data, "sent": torch.tensor(transport.stats.sent)}


def _doubling_bytes(rank: int, world: int, nbytes: int) -> int:
    """What recursive doubling sends from ``rank``: a whole copy per round it takes part in."""
    power = 1 << (world.bit_length() - 1)
    extra = world - power
    rounds = power.bit_length() - 1
    if rank < 2 * extra:
        return nbytes if rank % 2 == 0 else (rounds + 1) * nbytes  # (the odd one hands the sum back)
    return rounds * nbytes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3, 4, pytest.param(5, marks=pytest.mark.slow), 6])
def test_recursive_doubling_sums_to_the_same_bits_on_every_rank_and_counts_its_bytes(world):
    results = run_group(_doubling_body, world, args=(1001,))
    expected = torch.stack([r["input"].double() for r in results]).sum(0)
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["output"].double(), expected, rtol=1e-6, atol=1e-5)
        assert torch.equal(r["output"], results[0]["output"])  # the same bits: the replicas stay equal
        assert int(r["sent"].sum()) == _doubling_bytes(rank, world, 1001 * 4)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world,numel", [  # uneven chunks (999 on 3, 7 on 4) in CI; even ones in `make test-all`
    (2, 1000), (3, 999), pytest.param(4, 1000, marks=pytest.mark.slow), (4, 7)])
def test_own_ring_all_reduce_sums_and_counts_exact_bytes(world, numel):
    results = run_group(_ring_body, world, args=(numel,))
    expected = sum(r["input"] for r in results)
    for r in results:
        torch.testing.assert_close(r["output"], expected)
    if numel % world == 0:
        for rank, r in enumerate(results):
            share = 2 * (world - 1) * numel * 8 // world
            assert int(r["sent"].sum()) == share
            assert int(r["sent"][(rank + 1) % world]) == share  # all of it to the successor
    assert sum(int(r["sent"].sum()) for r in results) == sum(int(r["received"].sum()) for r in results)
    for rank, r in enumerate(results):  # per-peer: what I sent to my successor, it received from me
        succ = (rank + 1) % world
        assert int(r["sent"][succ]) == int(results[succ]["received"][rank])
