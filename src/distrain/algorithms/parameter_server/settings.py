"""What parameter-server workers and servers run with.

See :mod:`distrain.algorithms.parameter_server` for how the pieces fit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from distrain.algorithms.base import RunFacts
from distrain.compress.settings import CompressionSettings


@dataclass(frozen=True, kw_only=True)
class PSSettings:
    """What a parameter-server worker runs with (and a server: see :class:`ServerSettings`)."""

    #: server processes besides the workers, each owning one shard
    servers: int
    #: ``sync`` (each step waits for all workers) or ``async`` (pushes applied as they arrive)
    ps_mode: str
    #: ranks per node: only each node's first worker talks to the servers (0: every worker)
    workers_per_node: int
    #: how the pushes are compressed (``none``: sent dense)
    compression: CompressionSettings
    run: RunFacts


@dataclass(frozen=True, kw_only=True)
class ServerSettings(PSSettings):
    """What a server runs with: the workers' settings, and what only a server uses."""

    #: async: how many pushes a worker may run ahead of the slowest (0: lockstep)
    max_staleness: int
    #: save a checkpoint every this many steps (0: only at the end)
    checkpoint_every: int
    #: the model's name, recorded in the checkpoints
    model: str
    #: the checkpoint to continue from (``auto``, ``none`` or a step directory), and the run's
    #: length in epochs (a run already finished leaves at once)
    resume: str
    epochs: float


#: Why ``--max-restarts`` is refused with ``--workers-per-node`` (from the config before any
#: worker starts, or by a ``wrap()`` script's worker that finds restarts on in the store).
NO_JOINS_IN_NODES = "a lost worker joins a ps run again without --workers-per-node only; use 0"


def elastic_servers(settings: PSSettings) -> bool:
    """Whether the servers go on without a lost worker (see the module docstring): flat, or
    hierarchical (``--workers-per-node``) with synchronous servers."""
    r = settings.run
    return ((not settings.workers_per_node or settings.ps_mode == "sync") and r.device == "cpu" and 1 < r.workers
            and r.min_workers < r.workers and "TORCHELASTIC_RUN_ID" not in os.environ)
