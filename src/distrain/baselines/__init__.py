"""PyTorch's DDP and torchft as baselines, run in distrain's harness and emulated networks.

``ddp`` (plain DDP), ``ddp-fp16`` (``fp16_compress_hook``), ``ddp-powersgd[:RANK]``
(``powerSGD_hook``) and ``localsgd[:PERIOD]`` (post-local SGD with ``PeriodicModelAverager``):
PyTorch public APIs only; ``torchft-diloco[:H]`` and ``torchft-localsgd[:H]``: torchft's
``DiLoCo`` and ``LocalSGD`` (``pip install 'distrain[peers]'``, see
:mod:`distrain.baselines.torchft_peers`). All run with the same data, model, schedule and
run-directory format as ``distrain train``. See :mod:`distrain.baselines.wire` for how their
traffic is counted and delayed on an emulated network.

Example::

    from distrain.baselines import run_baseline
    summary = run_baseline("ddp-fp16", cfg)
"""

from __future__ import annotations

from typing import Any

from distrain.baselines.common import Peer, check_peer_config, launch_peer, peer_label
from distrain.baselines.fp16 import DDPFp16
from distrain.baselines.localsgd import PostLocalSGD
from distrain.baselines.plain import PlainDDP
from distrain.baselines.powersgd import DDPPowerSGD
from distrain.baselines.torchft_peers import TorchftDiLoCo, TorchftLocalSGD
from distrain.config import TrainConfig
from distrain.errors import ConfigError

BASELINES: dict[str, type[Peer]] = {p.name: p for p in (PlainDDP, DDPFp16, DDPPowerSGD, PostLocalSGD, TorchftDiLoCo,
                                                        TorchftLocalSGD)}


def build_peer(spec: str) -> Peer:
    """``name[:option]`` -> a Peer; ConfigError (naming --baselines) lists the valid names, or
    names what is missing to run it."""
    name, _, option = spec.strip().partition(":")
    if name not in BASELINES:
        raise ConfigError("--baselines", f"unknown baseline {name!r}; choose one of: {', '.join(BASELINES)}")
    peer = BASELINES[name](option or None)
    peer.check_available()
    return peer


def check_baseline(spec: str, cfg: TrainConfig) -> None:
    """Raise ConfigError if baseline ``spec`` cannot run with ``cfg``."""
    check_peer_config(build_peer(spec), cfg)


def run_baseline(spec: str, cfg: TrainConfig) -> dict[str, Any]:
    """Run baseline ``spec`` with ``cfg`` (local processes on loopback); returns the summary."""
    return launch_peer(cfg, build_peer(spec))


__all__ = ["BASELINES", "Peer", "build_peer", "check_baseline", "peer_label", "run_baseline"]
