"""Run as one worker of a job started by torchrun (RANK, WORLD_SIZE, MASTER_ADDR/PORT set)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from distrain.comm.group import check_device, close_group, init_group, store_of
from distrain.config import TrainConfig
from distrain.launch.common import (
    claim_run_dir,
    configure_worker_logging,
    default_run_dir,
    die_with_parent,
    replace_earlier_run,
    run_role,
    server_count,
    wait_for_master,
)


def _shared_run_dir(cfg: TrainConfig) -> Path:
    """A run directory every rank agrees on, stable across torchrun restarts."""
    if cfg.run.run_dir or cfg.run.name:
        return default_run_dir(cfg, 0.0)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if run_id != "none":
        return default_run_dir(replace(cfg, run=replace(cfg.run, name=f"{cfg.algo.algorithm}-{cfg.data.dataset}-{run_id}")), 0.0)
    stamp = torch.tensor([time.time()], dtype=torch.float64)
    dist.broadcast(stamp, src=0)  # rank 0's clock names the run
    return default_run_dir(cfg, float(stamp.item()))


def run_torchrun_worker(cfg: TrainConfig, *, summary_everywhere: bool = False,
                        **user: Any) -> dict[str, Any] | None:
    """Train as the worker torchrun made this process; returns the summary on rank 0 (on every
    rank with ``summary_everywhere``: a script running the same code on each rank reads it)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # torchrun starts its workers in sessions of their own: one whose agent was killed (its
        # node lost) would train on with the others, who could never go on without it
        die_with_parent(os.getppid())
    configure_worker_logging(rank)
    check_device(cfg, processes=int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    cfg = replace(cfg, cluster=replace(cfg.cluster, workers=world - server_count(cfg)))
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if rank == 0 and attempt == "0" and (cfg.run.run_dir or cfg.run.name):
        # Before anyone joins: torchrun stops the other ranks when this one exits on bad input. A
        # restarted attempt finds its own first attempt's files, which are not an earlier run.
        claimed = default_run_dir(cfg, 0.0)
        claim_run_dir(cfg, claimed)
        replace_earlier_run(cfg, claimed)
    hosted_elsewhere = rank != 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if hosted_elsewhere:  # the torchrun agent (or rank 0) hosts the store
        wait_for_master(addr, port, cfg.cluster.timeout)
    # The agent's store outlives a restart: each attempt meets under its own prefix, or a
    # restarted worker could read the addresses of the attempt before and connect to nobody. An
    # elastic job (--nnodes MIN:MAX) that a node joins restarts its workers without counting a
    # restart: the world size tells that attempt from the one before.
    store = dist.PrefixStore(f"distrain/attempt-{attempt}-{world}", store_of(addr, port, cfg.cluster.timeout, host=not hosted_elsewhere))
    init_group(cfg, rank, world, store=store)
    try:
        run_dir = _shared_run_dir(cfg)
        run_dir.mkdir(parents=True, exist_ok=True)
        summary = run_role(cfg, rank, world, run_dir, **user)
        return share_summary(summary) if summary_everywhere else summary
    finally:
        close_group()


def share_summary(summary: dict[str, Any] | None) -> dict[str, Any]:
    """The run summary on every rank, from the one rank that has it (collective).

    It travels as JSON bytes, not as a pickled object, and needs no run directory shared
    between hosts.
    """
    mine = json.dumps(summary).encode() if summary is not None else b""
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    gathered = dist.all_gather(sizes, torch.tensor([len(mine)], dtype=torch.int64), async_op=True)
    gathered.wait()
    source = next((r for r, size in enumerate(sizes) if size.item() > 0), None)  # the rank that wrote it
    if source is None:
        raise RuntimeError("no rank has the run summary")
    payload = torch.frombuffer(bytearray(mine), dtype=torch.uint8) if mine else torch.empty(
        int(sizes[source].item()), dtype=torch.uint8)
    sent = dist.broadcast(payload, src=source, async_op=True)
    sent.wait()
    # The last collectives before a user's script may end. gloo's worker thread lets go of an
    # operation after its wait has returned; were that the last reference, it would free the
    # operation's tensors there, and freeing a tensor made in Python takes the interpreter's lock,
    # which a thread cannot take once the interpreter is shutting down: the process aborted
    # ("terminate called without an active exception") in about 1 of 10 runs of a script that
    # ended right after distrain.fit under torchrun. Held here, the operations are freed by the
    # interpreter itself, with their tensors.
    _LAST_SHARED[:] = [gathered, sent]
    return summary if summary is not None else json.loads(payload.numpy().tobytes())


#: The operations of the last :func:`share_summary` (see there).
_LAST_SHARED: list[dist.Work] = []
