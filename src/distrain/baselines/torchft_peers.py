"""``torchft-diloco[:H]`` and ``torchft-localsgd[:H]``: torchft's DiLoCo and LocalSGD as peers.

Each worker is its own torchft replica group (one rank), with a ``Manager`` over torchft's
``ProcessGroupGloo`` and a TCPStore on 127.0.0.1 (:mod:`distrain.baselines.torchft_group`); the
launcher runs one ``torchft_lighthouse`` for the run (:mod:`distrain.baselines.lighthouse`). The
worker trains the bare model with the same shards, initial parameters, inner optimizer and
learning-rate schedule as every other peer; torchft's ``DiLoCo`` / ``LocalSGD`` context registers
hooks on the inner optimizer and synchronises inside ``optimizer.step()`` every H steps (H: the
option, else ``--sync-every``), with torchft's defaults (one all-reduce per parameter tensor, no
quantization, no streaming fragments).

- ``torchft-diloco``: every H steps the replicas average their pseudo-gradients (the parameters
  of the last sync minus their own) and the outer optimizer steps the shared parameters:
  ``torch.optim.SGD(lr=--outer-lr, momentum=--outer-momentum, nesterov=True)`` for
  ``--outer-optimizer nesterov``, the same without Nesterov for ``sgd``, which are the updates
  distrain's ``diloco`` makes (with momentum 0 both are plain SGD; torch refuses Nesterov without
  momentum). Every replica continues from the shared parameters.
- ``torchft-localsgd``: every H steps the replicas' parameters are averaged.

Bytes are counted from torchft's process group: every all-reduce torchft makes is charged as a
ring all-reduce of its tensors and, on an emulated network (``--network``), held until that ring
would have finished on the emulated links, as for the DDP peers (:mod:`distrain.baselines.wire`).
Where that cannot be done the peers refuse to run rather than run un-emulated: ``--emulation
netns`` and ``--device cuda`` are ConfigErrors.

The model evaluated is the one every replica agrees on: the parameters of the last sync (for
DiLoCo the shared parameters after the outer step, for LocalSGD the average), with this worker's
buffers. torchft syncs only every H steps, so the last ``total_steps mod H`` inner steps of a run
are not in the final model (a warning says so, and config.json records ``unsynced_last_steps``).

Example::

    distrain compare --algorithms diloco --baselines torchft-diloco,torchft-localsgd --sync-every 16
"""

from __future__ import annotations

import contextlib
import copy
import importlib.metadata
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from distrain.baselines.common import Peer
from distrain.baselines.lighthouse import Lighthouse, lighthouse_program
from distrain.baselines.wire import WireMeter
from distrain.config import AUTO, TrainConfig
from distrain.errors import ConfigError, DistrainError
from distrain.extras import require

log = logging.getLogger(__name__)

#: How the bytes of these peers are known (summary.json's ``bytes_counted``).
BYTES_COUNTED = ("metered on torchft's process group: each all-reduce as a ring, 2(n-1)/n of its tensors' bytes "
                 "to the next worker")


def outer_optimizer(params: Any, outer: Any) -> torch.optim.SGD:
    """The torch optimizer that makes distrain's outer step for ``--outer-optimizer`` (``outer``:
    the config's ``OuterConfig``)."""
    momentum = float(outer.outer_momentum)
    return torch.optim.SGD(params, lr=float(outer.outer_lr), momentum=momentum,
                           nesterov=outer.outer_optimizer == "nesterov" and momentum > 0)


class TorchftPeer(Peer):
    """A torchft algorithm syncing every H steps; subclasses say which (:meth:`algorithm`)."""

    option_help = "inner steps between syncs (H), an integer >= 1"
    uses_ddp = False
    local_steps = True  # H steps on each replica's own batches, then the sync

    def __init__(self, option: str | None = None) -> None:
        super().__init__(option)
        if option is not None and not (option.isdigit() and int(option) >= 1):
            raise ConfigError("--baselines", f"{self.name}:H needs an H that is an integer >= 1, got {option!r}")
        self.option_h = int(option) if option is not None else None
        self.sync_every = self.option_h or 0
        self.lighthouse: str | None = None  # set by serve() in the launcher, before the workers start
        self.replica: Any = None
        self.context: Any = None
        self.synced: torch.nn.Module | None = None
        self.steps = self.unsynced = 0

    def period(self, cfg: TrainConfig) -> int:
        """H: the option, else ``--sync-every``."""
        if self.option_h is not None:
            return self.option_h
        if cfg.outer.sync_every == AUTO:
            raise ConfigError("--baselines", f"{self.name} syncs every H steps, fixed: give {self.name}:H, "
                                             f"or --sync-every a number instead of auto")
        return int(cfg.outer.sync_every)

    def check_available(self) -> None:
        require("torchft.local_sgd", feature=f"--baselines {self.name}", setting="--baselines")
        if lighthouse_program() is None:
            raise ConfigError("--baselines", f"{self.name} needs the torchft_lighthouse program, which comes with "
                                             "torchft: pip install 'distrain[peers]'")

    def check_config(self, cfg: TrainConfig) -> None:
        if cfg.cluster.device != "cpu":
            raise ConfigError("--device", f"{self.name} runs on torchft's gloo group on CPU here; use --device cpu")
        self.period(cfg)

    @contextlib.contextmanager
    def serve(self, cfg: TrainConfig, run_dir: Path) -> Iterator[None]:
        # The workers start while the lighthouse does: their Managers wait for it (connect timeout).
        house = Lighthouse(cfg.cluster.workers, run_dir / "logs" / "lighthouse.log", start_timeout=None)
        with house as address:
            self.lighthouse = address
            try:
                yield
            except BaseException as exc:
                code = house.exited()
                if code is not None:  # the workers could not meet: that is the news
                    raise DistrainError(f"torchft_lighthouse exited with status {code}: {house.log_tail()}") from exc
                raise
            finally:
                self.lighthouse = None

    def algorithm(self, manager: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  cfg: TrainConfig) -> Any:
        """torchft's context object (``DiLoCo``, ``LocalSGD``) for this worker."""
        raise NotImplementedError

    def register(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, meter: WireMeter, cfg: TrainConfig,
                 steps_per_epoch: int, total_steps: int) -> None:
        super().register(model, optimizer, meter, cfg, steps_per_epoch, total_steps)
        # torchft's Manager server logs every quorum and commit unless told otherwise before it loads
        os.environ.setdefault("RUST_LOG", "warn")
        from distrain.baselines.torchft_group import open_replica

        if self.lighthouse is None:
            raise DistrainError(f"{self.name} needs the lighthouse its launcher starts (run it with run_baseline)")
        self.sync_every = self.period(cfg)
        self.unsynced = total_steps % self.sync_every
        if self.unsynced and dist.get_rank() == 0:
            log.warning("%s syncs every %d steps: the last %d of the run's %d steps are not in the final model",
                        self.name, self.sync_every, self.unsynced, total_steps)
        self.replica = open_replica(dist.get_rank(), dist.get_world_size(), self.lighthouse, meter,
                                    cfg.cluster.timeout)
        self.context = self.algorithm(self.replica.manager, model, optimizer, cfg)
        self.context.__enter__()
        self.synced = copy.deepcopy(model)  # every replica starts from the same seeded parameters

    def after_step(self, model: torch.nn.Module) -> None:
        self.steps += 1
        if self.steps % self.sync_every:
            return
        rounds, expected = self.replica.manager.current_step(), self.steps // self.sync_every
        if rounds != expected:
            raise DistrainError(f"{self.name}: torchft committed {rounds} of {expected} rounds by step {self.steps}")
        assert self.synced is not None
        with torch.no_grad():
            for kept, now in zip(self.synced.parameters(), model.parameters(), strict=True):
                kept.copy_(now)

    def eval_model(self, model: torch.nn.Module) -> torch.nn.Module:
        assert self.synced is not None
        with torch.no_grad():
            for kept, now in zip(self.synced.buffers(), model.buffers(), strict=True):
                kept.copy_(now)
        return self.synced

    def metrics(self) -> dict[str, float]:
        # The rounds torchft committed, under the name distrain's diloco gives its syncs.
        return {"outer_steps": self.replica.manager.current_step()} if self.replica is not None else {}

    def info(self) -> dict[str, Any]:
        return {**super().info(), "sync_every": self.sync_every, "unsynced_last_steps": self.unsynced,
                "torchft": importlib.metadata.version("torchft")}

    def summary_fields(self) -> dict[str, Any]:
        return {"bytes_counted": BYTES_COUNTED}

    def close(self) -> None:
        context, replica, self.context, self.replica = self.context, self.replica, None, None
        try:
            if context is not None:
                context.__exit__(None, None, None)
        finally:
            if replica is not None:
                replica.close()


class TorchftDiLoCo(TorchftPeer):
    """torchft's ``DiLoCo`` with distrain's outer optimizer settings."""

    name = "torchft-diloco"

    def __init__(self, option: str | None = None) -> None:
        super().__init__(option)
        self.outer: dict[str, Any] = {}  # the outer optimizer's settings, for config.json

    def check_config(self, cfg: TrainConfig) -> None:
        super().check_config(cfg)
        if cfg.outer.fragments != 1 or cfg.outer.overlap_steps != 0:
            flag = "--fragments" if cfg.outer.fragments != 1 else "--overlap-steps"
            raise ConfigError(flag, f"{self.name} syncs the whole model at once here; use --fragments 1 and "
                                    "--overlap-steps 0")

    def algorithm(self, manager: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  cfg: TrainConfig) -> Any:
        from torchft.local_sgd import DiLoCo

        outer = outer_optimizer(model.parameters(), cfg.outer)
        self.outer = {"outer_optimizer": cfg.outer.outer_optimizer, **{
            f"outer_{key}": outer.defaults[key] for key in ("lr", "momentum", "nesterov")}}
        return DiLoCo(manager, [model], optimizer, outer, sync_every=self.sync_every)

    def info(self) -> dict[str, Any]:
        return {**super().info(), **self.outer}


class TorchftLocalSGD(TorchftPeer):
    """torchft's ``LocalSGD``: the replicas' parameters averaged every H steps."""

    name = "torchft-localsgd"

    def algorithm(self, manager: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  cfg: TrainConfig) -> Any:
        from torchft.local_sgd import LocalSGD

        return LocalSGD(manager, model, optimizer, sync_every=self.sync_every)
