"""What parameter servers keep when one is taken over: every parameter owned exactly once after
each loss, and the optimizer state of the shard kept beside a fresh one for the pieces; when a
lost server returns, its range given back with the pieces' state."""

from __future__ import annotations

import pytest
import torch

from distrain.algorithms.parameter_server import (
    ShardLayout,
    gather_ranges,
    merged_optimizer,
    scatter_ranges,
    shard_bounds,
)
from distrain.algorithms.parameter_server.layout import positions
from distrain.algorithms.parameter_server.server_optim import shrunk_optimizer, sliced_state


def owned_once(layout: ShardLayout, numel: int) -> bool:
    covered = sorted(i for ranges in layout.owned.values() for lo, hi in ranges for i in range(lo, hi))
    return covered == list(range(numel))


def test_each_loss_spreads_the_lost_ranges_over_the_live_servers():
    layout = ShardLayout(shard_bounds(10, 3))
    assert layout.take_over(1) == {0: [(4, 6)], 2: [(6, 7)]}
    assert layout.owned == {0: [(0, 4), (4, 6)], 2: [(7, 10), (6, 7)]} and owned_once(layout, 10)
    assert layout.take_over(2) == {0: [(7, 10), (6, 7)]}  # the last one left takes everything
    assert layout.live() == [0] and layout.numel(0) == 10 and owned_once(layout, 10)
    tiny = ShardLayout(shard_bounds(3, 3))
    assert tiny.take_over(0) == {1: [(0, 1)], 2: []}  # a piece of nothing is no piece


def test_a_servers_ranges_travel_as_one_tensor_in_their_order():
    flat = torch.arange(10.0)
    ranges = [(7, 10), (6, 7)]
    packed = gather_ranges(flat, ranges)
    assert packed.tolist() == [7.0, 8.0, 9.0, 6.0]
    out = torch.zeros(10)
    scatter_ranges(out, ranges, packed)
    assert out[6:].tolist() == [6.0, 7.0, 8.0, 9.0] and out[:6].abs().sum() == 0


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_the_shards_state_goes_on_and_the_pieces_start_fresh(kind):
    """A merged step moves the old part exactly as the old optimizer would have, and the new part
    exactly as a fresh optimizer steps a parameter of its own (SGD: zero momentum is a fresh
    buffer)."""
    def make(p: torch.nn.Parameter) -> torch.optim.Optimizer:
        return torch.optim.SGD([p], lr=0.1, momentum=0.9) if kind == "sgd" else torch.optim.AdamW([p], lr=0.1)

    old, twin = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    old_opt, twin_opt = make(old), make(twin)
    for g in (torch.tensor([1.0, -2.0, 0.5]), torch.tensor([0.3, 0.3, -1.0])):
        for p, o in ((old, old_opt), (twin, twin_opt)):
            p.grad = g.clone()
            o.step()
    piece, fresh_piece = torch.nn.Parameter(torch.full((2,), 5.0)), torch.nn.Parameter(torch.full((2,), 5.0))
    merged, opt = merged_optimizer(old_opt, old, make(piece), piece)
    fresh = make(fresh_piece)
    g_old, g_new = torch.tensor([0.2, -0.1, 0.4]), torch.tensor([1.0, -1.0])
    merged.grad = torch.cat([g_old, g_new])
    opt.step()
    twin.grad, fresh_piece.grad = g_old, g_new
    twin_opt.step()
    fresh.step()
    torch.testing.assert_close(merged.data[:3], twin.data)
    if kind == "sgd":
        torch.testing.assert_close(merged.data[3:], fresh_piece.data)
    else:  # Adam's step count is the shard's: the pieces' bias correction differs, and is logged as reset
        assert not torch.allclose(merged.data[3:], torch.full((2,), 5.0))


def test_a_returned_server_takes_back_its_range_from_every_holder():
    """Server 1 lost, then server 2 (which held a piece of 1's range): server 0 holds 1's range in
    two pieces; when 1 returns, each holder gives back exactly what lies in 1's range, and once 2
    returns too every server holds its own range again."""
    layout = ShardLayout(shard_bounds(10, 3))  # [(0, 4)], [(4, 7)], [(7, 10)]
    layout.take_over(1)
    layout.take_over(2)
    assert layout.owned == {0: [(0, 4), (4, 6), (7, 10), (6, 7)]}
    assert layout.give_back(1) == {0: [(4, 6), (6, 7)]}
    assert layout.owned == {0: [(0, 4), (7, 10)], 1: [(4, 7)]} and owned_once(layout, 10) and not layout.whole()
    assert layout.give_back(2) == {0: [(7, 10)], 1: []}
    assert layout.whole() and owned_once(layout, 10)
    straddling = ShardLayout(shard_bounds(10, 2))
    straddling.owned = {0: [(0, 10)]}  # a range across the returning server's bounds is cut at them
    assert straddling.give_back(1) == {0: [(5, 10)]} and straddling.whole()


def test_positions_index_a_servers_shard_in_the_order_of_the_ranges():
    held = [(0, 4), (7, 10), (4, 6)]  # the shard: 0..3, then 7..9, then 4..5
    assert positions(held, [(4, 6), (8, 10)]).tolist() == [7, 8, 5, 6]
    with pytest.raises(ValueError, match="not inside"):
        positions(held, [(3, 5)])


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_the_pieces_given_back_carry_their_state(kind):
    """A server that took a piece over gives it back: the returned server's piece, with the state
    sliced out, steps exactly as the merged shard would have; so does what the holder keeps."""
    def make(p: torch.nn.Parameter) -> torch.optim.Optimizer:
        return torch.optim.SGD([p], lr=0.1, momentum=0.9) if kind == "sgd" else torch.optim.AdamW([p], lr=0.1)

    shard = torch.nn.Parameter(torch.arange(5.0))
    opt = make(shard)
    for g in (torch.tensor([1.0, -2.0, 0.5, 0.3, 0.7]), torch.tensor([0.3, 0.3, -1.0, 2.0, -0.4])):
        shard.grad = g.clone()
        opt.step()
    give, keep = torch.tensor([3, 4]), torch.tensor([0, 1, 2])
    piece = torch.nn.Parameter(shard.data[give].clone())
    piece_opt = make(piece)
    piece_opt.state[piece] = sliced_state(opt, shard, give)
    kept, kept_opt = shrunk_optimizer(opt, shard, keep)
    g = torch.tensor([0.2, -0.1, 0.4, -0.5, 0.9])
    fresh = torch.nn.Parameter(piece.data.clone())  # the check can fail: a fresh state steps elsewhere
    fresh.grad = g[give].clone()
    make(fresh).step()
    shard.grad, kept.grad, piece.grad = g.clone(), g[keep].clone(), g[give].clone()
    opt.step()
    kept_opt.step()
    piece_opt.step()
    torch.testing.assert_close(kept.data, shard.data[keep], rtol=0, atol=0)
    torch.testing.assert_close(piece.data, shard.data[give], rtol=0, atol=0)
    assert not torch.allclose(fresh.data, piece.data, atol=1e-4)


def test_every_range_held_after_losses_and_returns_lies_in_one_shard_of_the_run():
    """A compressed push carries one message per shard of the run's layout: whatever takeovers
    and returns made of the ranges, each lies in one shard, and a server's list names each
    shard it holds pieces of once."""
    from distrain.algorithms.parameter_server.layout import shard_of, shards_touched

    bounds = shard_bounds(10, 3)  # (0, 4), (4, 7), (7, 10)
    layout = ShardLayout(bounds)
    layout.take_over(1)
    assert shards_touched(bounds, layout.owned[0]) == [0, 1] and shards_touched(bounds, layout.owned[2]) == [1, 2]
    layout.take_over(2)
    assert layout.owned == {0: [(0, 4), (4, 6), (7, 10), (6, 7)]}
    assert [shard_of(bounds, r) for r in layout.owned[0]] == [0, 1, 2, 1]
    assert shards_touched(bounds, layout.owned[0]) == [0, 1, 2]
    layout.give_back(1)
    assert shards_touched(bounds, layout.owned[0]) == [0, 2] and shards_touched(bounds, layout.owned[1]) == [1]
    with pytest.raises(ValueError, match="not inside one shard"):
        shard_of(bounds, (3, 5))


def test_a_shard_is_put_together_from_the_parts_several_servers_saved():
    """After a takeover, the servers' checkpoint files hold their ranges in parts; a resumed
    server takes its own shard's values and per-element optimizer state from them, the first
    part's scalar state, and zeros where a part had none yet (a piece never stepped)."""
    from distrain.algorithms.parameter_server.layout import assemble_range

    flat = torch.arange(10.0)
    momentum = torch.arange(10.0) * 10
    # server 0 held (0, 4) and took over (4, 6) under one optimizer; server 2 took over (6, 7)
    # with a fresh one (no momentum yet) and holds (7, 10) with its own
    parts = [([(0, 4), (4, 6)], flat[[0, 1, 2, 3, 4, 5]], {"buf": momentum[[0, 1, 2, 3, 4, 5]], "step": 7}),
             ([(7, 10)], flat[7:10], {"buf": momentum[7:10], "step": 9}),
             ([(6, 7)], flat[6:7], {"step": 1})]
    values, state = assemble_range(parts, (4, 7))  # server 1's shard
    assert values.tolist() == [4.0, 5.0, 6.0]
    assert state["buf"].tolist() == [40.0, 50.0, 0.0] and state["step"] == 7
    values, state = assemble_range(parts, (0, 10))
    assert torch.equal(values, flat) and state["buf"].tolist() == [*momentum[:6].tolist(), 0.0, *momentum[7:].tolist()]
    with pytest.raises(ValueError, match="cover 2 of the 3"):
        assemble_range(parts[:2], (4, 7))
