"""Process-group plumbing every process shares: the backend for the device, opening the
default group with the run's timeout, the rendezvous store, closing the group."""

from __future__ import annotations

import datetime
import os
import socket
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from distrain.errors import ConfigError

if TYPE_CHECKING:
    from distrain.config import TrainConfig


#: The backend of a CUDA run: NCCL moves CUDA tensors only, and distrain's control messages (the
#: step agreement, shard reports, membership) are CPU tensors, so those travel over gloo beside it.
NCCL = "cpu:gloo,cuda:nccl"


def backend_for(cfg: TrainConfig) -> str:
    backend = cfg.cluster.backend if cfg.cluster.backend != "auto" else "nccl" if cfg.cluster.device == "cuda" else "gloo"
    return NCCL if backend == "nccl" else backend


def check_device(cfg: TrainConfig, processes: int | None = None) -> None:
    """Refuse, before any process starts, what this machine cannot run: CUDA without a GPU, NCCL
    without CUDA, or NCCL with more processes on this machine (``processes``; default: the run's
    workers and parameter servers) than GPUs, since NCCL refuses two ranks on one GPU (gloo
    lets them share it)."""
    if cfg.cluster.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device", "cuda was asked for but this machine has no CUDA device; use --device cpu")
    if backend_for(cfg) != NCCL:
        return
    if cfg.cluster.device != "cuda":
        raise ConfigError("--backend", "nccl moves CUDA tensors only; use --device cuda, or --backend gloo")
    if processes is None:
        processes = cfg.cluster.workers + (cfg.ps.servers if cfg.algo.algorithm == "ps" else 0)
    gpus = torch.cuda.device_count()
    if processes > gpus:
        raise ConfigError("--backend", f"nccl needs a GPU for each process: {processes} processes on this machine, "
                                       f"{gpus} GPU(s); use --backend gloo (the processes then share the GPUs) or "
                                       f"at most {gpus} processes")


def init_group(cfg: TrainConfig, rank: int, world: int, init_method: str | None = None,
               store: dist.Store | None = None) -> None:
    """Open the default process group with the run's timeout (a world of 1 needs no network).

    Meet through ``store`` when given (the local launcher hosts one that outlives every
    worker), else through ``init_method``, else (one process) an in-memory store.
    """
    if cfg.cluster.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    if store is None and init_method is None:
        store = dist.HashStore()
    dist.init_process_group(backend_for(cfg), init_method=None if store is not None else init_method, store=store,
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=cfg.cluster.timeout))


def store_of(addr: str, port: int, timeout: float, *, host: bool = False) -> dist.TCPStore:
    """The rendezvous store at ``addr:port``: host it (the launcher), or connect to it (a worker,
    failing after ``timeout`` seconds if nobody answers)."""
    return dist.TCPStore(addr, port, is_master=host, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout),
                         master_listen_fd=listen_on(addr, port)[0] if host else None)


def listen_on(addr: str, port: int) -> tuple[int, int]:
    """A listening socket bound to ``addr:port`` only (port 0: a free one), as a file descriptor
    for a TCPStore to serve on, and its port (torch's store, left to itself, listens on every
    interface whatever its host)."""
    family, kind, proto, _, where = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(where)
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    bound = sock.getsockname()[1]
    return sock.detach(), bound  # the store owns it now


def close_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
