"""Local launch: spawn one process per worker on this machine, meeting on loopback."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import multiprocessing.connection
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch.distributed as dist

from distrain.config import TrainConfig
from distrain.errors import ConfigError, DataError, DistrainError, WorkerFailure
from distrain.launch.common import (
    check_device,
    check_port_free,
    close_group,
    configure_worker_logging,
    default_run_dir,
    exit_now,
    free_port,
    init_group,
    run_role,
    server_count,
)

log = logging.getLogger(__name__)

# Exit status of a worker that stopped on bad input (mirrors the CLI's status 2).
EXIT_BAD_INPUT = 2


def preflight(cfg: TrainConfig, train_set: Any = None) -> None:
    """Check what can be checked before any worker starts; warms the data cache on the way."""
    from distrain.data import load_dataset, partition_indices
    from distrain.train.loop import labels_of

    if train_set is None and cfg.data.dataset == "shards":
        return  # workers read their own shard files; they check them
    if train_set is None:
        d = cfg.data
        train_set, _ = load_dataset(d.dataset, path=d.data_path, num_samples=d.num_samples, seed=cfg.run.seed)
    n, world = len(train_set), cfg.cluster.workers
    if n == 0:
        raise DataError("the training set is empty")
    if world > n:
        raise ConfigError("--workers", f"must be at most the number of training samples ({n}), got {world}")
    labels = labels_of(train_set) if cfg.data.partition != "iid" else [0] * n
    parts = partition_indices(labels, world, cfg.data.partition, alpha=cfg.data.dirichlet_alpha, seed=cfg.run.seed)
    smallest = min(range(world), key=lambda r: len(parts[r]))
    if len(parts[smallest]) < cfg.data.batch_size:
        raise ConfigError("--batch-size", f"worker {smallest}'s shard has {len(parts[smallest])} samples, fewer than one batch of {cfg.data.batch_size}")


def _worker(rank: int, world: int, cfg: TrainConfig, init_method: str, run_dir: str, user: dict[str, Any]) -> None:
    configure_worker_logging(rank)
    code = 0
    try:
        init_group(cfg, rank, world, init_method)
        run_role(cfg, rank, world, run_dir, **user)
    except (ConfigError, DataError) as exc:
        if rank == 0:
            print(f"distrain: {exc}", file=sys.stderr)
        code = EXIT_BAD_INPUT
    except KeyboardInterrupt:
        code = 130
    except DistrainError as exc:
        print(f"distrain: worker {rank}: {exc}", file=sys.stderr)
        code = 1
    except Exception:
        print(f"distrain: worker {rank} failed:\n{traceback.format_exc()}", file=sys.stderr)
        code = 1
    finally:
        close_group()
    exit_now(code)


def _supervise(procs: list[mp.Process], grace: float) -> None:
    """Wait for every worker; once one fails, give the others ``grace`` seconds, then stop them."""
    pending = list(procs)
    failed_at: float | None = None
    failures: list[tuple[int, int]] = []
    while pending:
        timeout = None if failed_at is None else max(0.0, failed_at + grace - time.monotonic())
        ready = multiprocessing.connection.wait([p.sentinel for p in pending], timeout=timeout)
        if not ready:  # grace is over: the survivors are stuck waiting on the failed worker
            _stop(pending)
            break
        for p in [p for p in pending if p.sentinel in ready]:
            p.join()
            pending.remove(p)
            if p.exitcode != 0:
                failures.append((procs.index(p), p.exitcode))
                failed_at = failed_at or time.monotonic()
    if failures:
        if all(code == EXIT_BAD_INPUT for _, code in failures):
            raise SystemExit(EXIT_BAD_INPUT)
        rank, code = failures[0]
        raise WorkerFailure(f"worker {rank} exited with status {code}; the run was stopped")


def _stop(procs: list[mp.Process], wait: float = 5.0) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + wait
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def launch_local(cfg: TrainConfig, *, model_fn: Any = None, train_set: Any = None, test_set: Any = None) -> dict[str, Any]:
    """Train with ``cfg.cluster.workers`` local processes; returns the run summary.

    Workers are started with the ``spawn`` method, so ``model_fn`` and the data sets must be
    picklable (module-level functions, not lambdas) when there is more than one worker.
    """
    if cfg.network.emulation == "netns":  # emulation: each worker in its own shaped network namespace
        from distrain.launch.netns import launch_netns

        return launch_netns(cfg, model_fn=model_fn, train_set=train_set, test_set=test_set)
    check_device(cfg)
    run_dir = default_run_dir(cfg, time.time())
    run_dir.mkdir(parents=True, exist_ok=True)
    user = {"model_fn": model_fn, "train_set": train_set, "test_set": test_set}
    nprocs = cfg.cluster.workers + server_count(cfg)
    if nprocs == 1:
        return run_in_process(cfg, run_dir, **user)
    preflight(cfg, train_set)
    addr = cfg.cluster.master_addr
    if cfg.cluster.master_port:
        check_port_free(addr, cfg.cluster.master_port)
    port = cfg.cluster.master_port or free_port(addr)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, name=f"distrain-worker-{rank}",
                         args=(rank, nprocs, cfg, f"tcp://{addr}:{port}", str(run_dir), user))
             for rank in range(nprocs)]
    for p in procs:
        p.start()
    try:
        _supervise(procs, grace=min(cfg.cluster.timeout, 30.0))
    except BaseException:
        _stop(procs)
        raise
    return json.loads((run_dir / "summary.json").read_text())


def run_in_process(cfg: TrainConfig, run_dir: str | Path, **user: Any) -> dict[str, Any]:
    """One worker, in this process: a world of size 1 with an in-memory store."""
    from distrain.train.loop import train

    check_device(cfg)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    if dist.is_initialized():
        raise ConfigError("--workers", "a process group already exists in this process; use torchrun or call fit() outside it")
    init_group(cfg, 0, 1)
    try:
        summary = train(cfg, run_dir, **user)
    finally:
        close_group()
    assert summary is not None
    return summary
