"""The DDP baselines' traffic meter: ring charges per peer, and emulated completion times."""

from __future__ import annotations

import time

import pytest
import torch

from distrain.baselines import build_peer
from distrain.baselines.wire import WireMeter
from distrain.emulation import LinkModel, NetworkSpec
from distrain.errors import ConfigError


def test_ring_charges_per_peer_like_the_transport() -> None:
    meter = WireMeter(world=4, rank=1)
    meter.charge_all_reduce(1_000_000)
    share = 2 * 3 * 1_000_000 // 4  # 2(n-1)/n of the tensor, to the successor, from the predecessor
    assert meter.sent == [0, 0, share, 0] and meter.received == [share, 0, 0, 0]
    single = WireMeter(world=1, rank=0)
    single.charge_all_reduce(1_000_000)
    assert single.bytes_sent == 0


def test_held_future_completes_when_the_emulated_ring_would() -> None:
    bandwidth, latency, nbytes = 80e6, 0.01, 1_000_000  # 10 MB/s links
    spec = NetworkSpec.uniform(world=2, bandwidth=bandwidth, latency=latency)
    meter = WireMeter(world=2, rank=0, link_model=LinkModel(spec, rank=0))
    # Two workers: 2 rounds, each half the tensor over one link plus one latency.
    expected = 2 * (nbytes / 2 / (bandwidth / 8) + latency)
    done: torch.futures.Future = torch.futures.Future()
    start = time.perf_counter()
    held = meter.hold(done, [nbytes], start)
    time.sleep(0.02)
    assert not held.done()  # the real work is not even finished yet
    began = time.perf_counter()  # before: the transfer starts inside set_result, in its callback
    done.set_result(torch.ones(3))  # the real all-reduce finishes now: the emulated transfer starts
    value = held.wait()
    elapsed = time.perf_counter() - began
    assert torch.equal(value, torch.ones(3))
    assert expected <= elapsed < expected + 0.1
    assert meter.comm_seconds == pytest.approx(time.perf_counter() - start, abs=0.05)
    # Back to back: the second queues behind the first on the uplink.
    first, second = torch.futures.Future(), torch.futures.Future()
    a, b = meter.hold(first, [nbytes], time.perf_counter()), meter.hold(second, [nbytes], time.perf_counter())
    began = time.perf_counter()
    first.set_result(1)
    second.set_result(2)
    assert (a.wait(), b.wait()) == (1, 2)
    assert 2 * expected <= time.perf_counter() - began < 2 * expected + 0.15
    meter.close()


def test_without_a_link_model_nothing_is_delayed() -> None:
    meter = WireMeter(world=2, rank=0, link_model=None)
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(7)
    assert meter.hold(done, [10**9], time.perf_counter()).wait() == 7


def test_peer_specs() -> None:
    assert build_peer("ddp-powersgd:4").rank == 4
    assert build_peer("ddp-powersgd").rank == 2
    assert build_peer("localsgd:8").period == 8
    for spec in ("ddp:3", "ddp-powersgd:0", "localsgd:x", "ddp-bf16"):
        with pytest.raises(ConfigError, match="--baselines"):
            build_peer(spec)
