"""The optimizer a parameter server steps on its shard: the workers' class and settings, momentum for asynchronous pushes, merged shards.

See :mod:`distrain.algorithms.parameter_server` for how the pieces fit.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from distrain.compress.gradients import sgd_momentum
from distrain.compress.registry import build_compressor
from distrain.compress.settings import CompressionSettings
from distrain.errors import ConfigError
from distrain.optim.optimizers import LARS


def momentum_corrected(compression: CompressionSettings, optimizer: torch.optim.Optimizer) -> bool:
    """Whether workers apply momentum and weight decay before compressing their pushes
    (momentum correction), so that the servers step plain SGD.

    True for a sparsifying ``--compress`` with error feedback, ``--momentum-correction on`` and
    an SGD optimizer with momentum (see :func:`~distrain.compress.gradients.sgd_momentum`).
    """
    c = compression
    if not c.enabled or not c.momentum_correction or not c.error_feedback:
        return False
    if sgd_momentum(optimizer) is None:
        return False
    return build_compressor(c.spec, error_feedback=False).ratio is not None


def server_optimizer(like: torch.optim.Optimizer, shard: torch.nn.Parameter, *, asynchronous: bool, pushers: int,
                     max_staleness: int, corrected: bool) -> tuple[torch.optim.Optimizer | RoundMomentumSGD, float]:
    """The optimizer a server steps its shard with, and the factor on each push's learning rate.

    ``like`` is the workers' optimizer: its class and the hyperparameters of its parameter groups
    (which must agree: a shard spans tensors of every group). Synchronous servers step the same
    optimizer; asynchronous ones step SGD's momentum once per round of ``pushers`` pushes
    (:class:`RoundMomentumSGD`, the momentum lowered by :func:`async_momentum`), and Adam / AdamW
    once per push at ``lr / pushers`` with ``beta1 ** (1 / pushers)``. ``corrected``: the workers
    applied momentum and weight decay before compressing; the servers step plain SGD.
    """
    hyper = optimizer_settings(like)
    if corrected:
        return torch.optim.SGD([shard], lr=hyper["lr"]), 1.0
    if isinstance(like, LARS):
        raise ConfigError("optimizer", "lars adapts per layer; the parameter servers update flat shards: use sgd or adam")
    if not asynchronous:
        return type(like)([shard], **hyper), 1.0
    if isinstance(like, torch.optim.SGD):
        if hyper.get("nesterov") or hyper.get("dampening"):
            raise ConfigError("ps_mode", "async servers step heavy-ball SGD: use nesterov=False, dampening=0, or "
                                         "ps_mode sync")
        momentum = float(hyper.get("momentum", 0.0))
        return RoundMomentumSGD(shard.data, async_momentum(momentum, pushers, max_staleness),
                                float(hyper.get("weight_decay", 0.0)), pushers), 1.0
    if isinstance(like, torch.optim.Adam | torch.optim.AdamW):
        beta1, beta2 = hyper["betas"]
        return type(like)([shard], **{**hyper, "betas": (beta1 ** (1 / pushers), beta2)}), 1 / pushers
    raise ConfigError("ps_mode", f"async servers step SGD, Adam or AdamW, not {type(like).__name__}; use ps_mode sync")


def follow_pushers(optimizer: torch.optim.Optimizer | RoundMomentumSGD, like: torch.optim.Optimizer,
                   pushers: int) -> float | None:
    """An asynchronous server's ``optimizer`` (:func:`server_optimizer` of the workers'
    ``like``) once ``pushers`` workers push (one was lost or joined), its state kept: SGD's
    rounds hold ``pushers`` pushes (:meth:`RoundMomentumSGD.resize`); Adam / AdamW step each push
    with ``beta1 ** (1 / pushers)``. Returns the new factor on each push's learning rate
    (``1 / pushers``; None: it has none)."""
    if isinstance(optimizer, RoundMomentumSGD):
        optimizer.resize(pushers)
        return None
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and isinstance(like, torch.optim.Adam | torch.optim.AdamW):
        beta1, beta2 = optimizer_settings(like)["betas"]
        for group in optimizer.param_groups:
            group["betas"] = (beta1 ** (1 / pushers), beta2)
        return 1 / pushers
    return None


def optimizer_settings(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The hyperparameters ``optimizer`` was made with that its constructor takes again (its
    first group's current values: a scheduler may have moved the learning rate); ConfigError
    when its parameter groups differ in any of them."""
    accepted = set(inspect.signature(type(optimizer).__init__).parameters) - {"self", "params"}
    groups = [{k: v for k, v in g.items() if k in accepted} for g in optimizer.param_groups]
    differing = sorted({k for g in groups[1:] for k in g if g[k] != groups[0].get(k)})
    if differing:
        raise ConfigError("optimizer", f"the parameter servers step flat shards with one set of hyperparameters; "
                                       f"this optimizer's {len(groups)} parameter groups differ in {', '.join(differing)}")
    return groups[0]


def async_momentum(momentum: float, pushers: int, max_staleness: int) -> float:
    """The explicit momentum an asynchronous server applies so that, with the implicit momentum
    of ``pushers`` workers pushing out of step (about ``1 - 1/pushers``), the total matches
    ``momentum``; unchanged with ``max_staleness`` 0 (sync's rounds) or a single pusher.

    Example::

        async_momentum(0.9, pushers=4, max_staleness=2)   # 0.6
        async_momentum(0.9, pushers=4, max_staleness=0)   # 0.9
    """
    if max_staleness <= 0 or pushers <= 1:
        return momentum
    return max(0.0, 1.0 - pushers * (1.0 - momentum))


class RoundMomentumSGD:
    """Heavy-ball SGD for asynchronous pushes whose momentum advances once per round of
    ``pushes`` pushes; a round then equals one synchronous momentum step on the sum of its
    pushes (with every push computed on the parameters the round started from).

    Example::

        opt = RoundMomentumSGD(shard, momentum=0.9, weight_decay=0.0, pushes=4)
        for g in pushes_of_one_round:          # each the gradient / workers
            opt.step(g, lr=0.1)
    """

    def __init__(self, shard: torch.Tensor, momentum: float, weight_decay: float, pushes: int) -> None:
        self.shard, self.momentum, self.weight_decay, self.pushes = shard, momentum, weight_decay, pushes
        self.buffer = torch.zeros_like(shard)  # sync's momentum buffer as of the last full round
        self.pending = torch.zeros_like(shard)  # this round's gradients so far
        self.count = 0
        self.lr = 0.0  # the last push's learning rate
        self.decay = torch.zeros_like(shard) if weight_decay else None  # weight decay at the round's start

    @torch.no_grad()
    def step(self, grad: torch.Tensor, lr: float) -> None:
        self.lr = lr
        if self.decay is not None:
            if self.count == 0:
                torch.mul(self.shard, self.weight_decay / self.pushes, out=self.decay)
            grad = grad.add(self.decay)
        self.shard.add_(self.buffer, alpha=-lr * self.momentum / self.pushes).add_(grad, alpha=-lr)
        self.pending.add_(grad)
        self.count += 1
        if self.count == self.pushes:
            self.buffer.mul_(self.momentum).add_(self.pending)
            self.pending.zero_()
            self.count = 0

    @torch.no_grad()
    def resize(self, pushes: int) -> None:
        """Rounds hold ``pushes`` pushes from now on (a pusher was lost). The pushes of the round
        in progress took their shares of the momentum and the weight decay at the old count; they
        are brought to the new one, so that the round still applies each once, and a round that
        the pushes so far complete ends now."""
        if pushes == self.pushes or pushes < 1:
            return
        old, self.pushes = self.pushes, pushes
        if self.count:
            lr = self.lr
            self.shard.add_(self.buffer, alpha=-lr * self.momentum * self.count * (1 / pushes - 1 / old))
            if self.decay is not None:  # each push added the round's weight decay / old
                missing = self.decay * (self.count * (old / pushes - 1))
                self.shard.add_(missing, alpha=-lr)
                self.pending.add_(missing)
        if self.decay is not None:
            self.decay.mul_(old / pushes)
        if self.count >= pushes:
            self.buffer.mul_(self.momentum).add_(self.pending)
            self.pending.zero_()
            self.count = 0

    def state_dict(self) -> dict[str, Any]:
        state = {"buffer": self.buffer, "pending": self.pending, "count": self.count}
        return state if self.decay is None else {**state, "decay": self.decay}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer.copy_(state["buffer"])
        self.pending.copy_(state["pending"])
        self.count = int(state["count"])
        if self.decay is not None:
            self.decay.copy_(state["decay"])


def merged_optimizer(old: torch.optim.Optimizer, old_param: torch.nn.Parameter, new: torch.optim.Optimizer,
                     new_param: torch.nn.Parameter) -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
    """One parameter, ``old_param`` then ``new_param``, and an optimizer of ``old``'s class and
    settings whose state is both optimizers' state concatenated (zeros where one has none yet;
    scalar state such as Adam's step count is ``old``'s)."""
    param = torch.nn.Parameter(torch.cat([old_param.data, new_param.data]))
    param.grad = torch.zeros_like(param)
    merged = type(old)([param], **optimizer_settings(old))
    a, b = old.state.get(old_param, {}), new.state.get(new_param, {})
    state: dict[str, Any] = {}
    for key in list(a) + [k for k in b if k not in a]:
        x, y = a.get(key), b.get(key)
        if isinstance(x, torch.Tensor) and x.shape == old_param.shape or isinstance(y, torch.Tensor) and y.shape == new_param.shape:
            x = x if isinstance(x, torch.Tensor) and x.shape == old_param.shape else torch.zeros_like(old_param.data)
            y = y if isinstance(y, torch.Tensor) and y.shape == new_param.shape else torch.zeros_like(new_param.data)
            state[key] = torch.cat([x, y])
        else:
            state[key] = x if x is not None else y
    if state:
        merged.state[param] = state
    return param, merged


def sliced_state(optimizer: torch.optim.Optimizer, param: torch.nn.Parameter, index: torch.Tensor) -> dict[str, Any]:
    """A copy of ``optimizer``'s state of ``param`` at ``index`` (elements of the flat shard):
    every per-element tensor sliced, scalar state (such as Adam's step count) as it is."""
    return {key: (value[index] if value.shape == param.shape else value.clone()) if isinstance(value, torch.Tensor)
            else value for key, value in optimizer.state.get(param, {}).items()}


def shrunk_optimizer(optimizer: torch.optim.Optimizer, param: torch.nn.Parameter,
                     keep: torch.Tensor) -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
    """One parameter of ``param``'s elements at ``keep`` and an optimizer of ``optimizer``'s
    class and settings with their state (the inverse of :func:`merged_optimizer`: a server gives
    back the pieces of a returned server's range)."""
    kept = torch.nn.Parameter(param.data[keep].clone())
    kept.grad = torch.zeros_like(kept)
    shrunk = type(optimizer)([kept], **optimizer_settings(optimizer))
    state = sliced_state(optimizer, param, keep)
    if state:
        shrunk.state[kept] = state
    return kept, shrunk
