"""D2 (D-squared): D-PSGD with a correction that removes the bias of non-iid shards (Tang et al. 2018).

With data that differs between workers, D-PSGD's models are pulled towards their own shard's
optimum and the spread between them stays proportional to how much the shards differ. D2 mixes
a half-step that reuses the previous step::

    x_1     = W (x_0 - lr g_0)                                   (the first step is D-PSGD)
    x_{t+1} = W (2 x_t - x_{t-1} - lr g_t + lr g_{t-1})

Written with the optimizer's update ``delta_t = step(x_t) - x_t`` (``-lr g_t`` for plain SGD)
and the previous mix's displacement ``m_t = x_t - (x_{t-1} + delta_{t-1})`` this is
``x_{t+1} = W (x_t + delta_t + m_t)``: the previous step's mixing is repeated before mixing
again, so one vector of state is kept. With momentum ``delta_t`` is the momentum step and the
correction cancels the difference of consecutive updates; the paper analyses plain SGD
(``--momentum 0``), momentum works in practice (see the tests and the README figures).

D2 needs the smallest eigenvalue of ``W`` above -1/3 (otherwise a mode of the disagreement does
not decay: a ring of even size with weights 1/3 has exactly -1/3). When the chosen ``W`` does
not satisfy it, D2 uses the lazy matrix ``(I + W) / 2`` (eigenvalues >= 0) and says so in
config.json (``algorithm_info.made_lazy``).

Example::

    distrain train --algorithm d2 --topology ring --partition dirichlet --dirichlet-alpha 0.1
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from distrain.algorithms.dpsgd import DPSGD
from distrain.comm.transport import Transport
from distrain.topology import eigenvalues

log = logging.getLogger(__name__)

#: D2 converges when every eigenvalue of W exceeds -1/3; below this margin W is made lazy.
MIN_EIGENVALUE = -1.0 / 3.0 + 1e-3


class D2(DPSGD):
    """D-PSGD with the D2 correction for non-iid shards (always adapt-then-combine)."""

    name = "d2"
    own_state = ("correction",)  # m_t follows this worker's own iterates and gradients

    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, transport: Transport) -> None:
        self.lazy = False
        super().setup(model, optimizer, transport)
        self.correction = torch.zeros(self.flat.numel, dtype=torch.float64)  # m_t; zero before step 1

    def mixing_weights(self, W: torch.Tensor) -> torch.Tensor:
        if W.shape[0] > 1 and float(eigenvalues(W)[-1]) < MIN_EIGENVALUE:
            self.lazy = True
            log.info("d2: smallest eigenvalue of W is %.3f <= -1/3; using (I + W) / 2", float(eigenvalues(W)[-1]))
            return (torch.eye(W.shape[0], dtype=W.dtype) + W) / 2
        return W

    def gossip_order(self) -> str:
        return "atc"

    def before_atc_exchange(self, half: torch.Tensor) -> None:
        half.add_(self.correction)  # x_t + delta_t + m_t

    def after_atc_mix(self, mixed: torch.Tensor) -> None:
        # m_{t+1} = x_{t+1} - (x_t + delta_t) = mixed - (half - m_t)
        self.correction.add_(mixed).sub_(self.outgoing)

    def membership_changed(self) -> None:
        """Over new members (a new W) D2 starts again from a D-PSGD step."""
        self.correction.zero_()

    def info(self) -> dict[str, Any]:
        return {**super().info(), "made_lazy": self.lazy}

    def state_dict(self) -> dict[str, Any]:
        return {"correction": self.correction.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "correction" in state:
            self.correction.copy_(state["correction"])
