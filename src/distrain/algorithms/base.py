"""The Algorithm interface: the hooks the worker loop calls around each step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from distrain.comm.transport import Transport


@dataclass
class StepContext:
    """What the loop knows about the current step, handed to every algorithm hook."""

    step: int
    epoch: float
    batch_size: int
    per_sample_losses: torch.Tensor | None = None
    compute_seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


class Algorithm:
    """One instance per worker; composes the Transport (and later a Compressor).

    The loop calls, per step: backward, ``after_backward`` (gradient aggregation),
    ``apply_update`` (the optimizer step, unless a server owns it), ``after_update`` (model
    averaging). ``eval_model`` gives the model to evaluate (the consensus for decentralized
    algorithms); it may be collective, so every worker calls it.
    """

    name: str = "base"
    #: True when every worker holds the same model after each step (synchronous data parallel).
    replicated: bool = True

    def __init__(self, config: Any) -> None:
        self.config = config
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.transport: Transport | None = None

    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, transport: Transport) -> None:
        self.model, self.optimizer, self.transport = model, optimizer, transport

    def after_backward(self, ctx: StepContext) -> None:
        """Aggregate gradients (all-reduce, parameter server); default: keep local gradients."""

    def apply_update(self, ctx: StepContext) -> None:
        assert self.optimizer is not None
        self.optimizer.step()

    def after_update(self, ctx: StepContext) -> None:
        """Average models (gossip); default: nothing."""

    def eval_model(self) -> torch.nn.Module:
        assert self.model is not None
        return self.model

    def metrics(self) -> dict[str, float]:
        """Algorithm-specific numbers for metrics.jsonl (e.g. consensus distance)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass
