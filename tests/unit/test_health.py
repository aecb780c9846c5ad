"""Heartbeats name the worker that stopped stamping."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from distrain.launch.common import free_port
from distrain.runtime.health import Heartbeat


def test_a_worker_that_stops_stamping_becomes_the_suspect():
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    beats = [Heartbeat("127.0.0.1", port, rank=r, world_size=3, interval=0.1).start() for r in range(3)]
    try:
        assert beats[0].wait_for_suspects(patience=0.5) == []  # everyone alive: nobody suspected
        beats[2].stop()  # worker 2 "dies"
        assert beats[0].wait_for_suspects(patience=5) == [2]
        assert beats[1].wait_for_suspects(patience=5) == [2]
    finally:
        for b in beats:
            b.stop()
    del master
    # With the store's host gone, rank 0 (its host) is the suspect.
    assert Heartbeat("127.0.0.1", port, rank=1, world_size=3, interval=0.1).suspects() == [0]
