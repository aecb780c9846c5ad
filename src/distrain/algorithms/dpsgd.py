"""D-PSGD: decentralized synchronous SGD, gossip with neighbours instead of a global all-reduce.

Every step each worker exchanges its model with its neighbours in ``--topology`` and mixes what
it receives with the weights of a doubly stochastic matrix ``W`` (``--mixing``), so the models
never agree exactly but their average follows SGD (Lian et al. 2017). Two orders
(``--gossip-order``):

- ``cta`` (combine, then adapt; the paper's form, default): ``x_i <- sum_j W_ij x_j - lr g_i``,
  with ``g_i`` computed on the local model before averaging. The model of step t is sent when
  the forward pass of step t starts (a forward pre-hook), so the exchange overlaps forward and
  backward, and the mix is applied after the optimizer step.
- ``atc`` (adapt, then combine): ``x_i <- sum_j W_ij (x_j - lr g_j)``. The exchange follows
  the optimizer step and overlaps nothing, but on the complete graph with uniform weights this
  is exactly synchronous all-reduce SGD.

The default weights, ``--mixing lazy`` = ``(I + W_metropolis) / 2``, have no negative
eigenvalues. A disagreement that flips sign every round (eigenvalue -1/3 on a ring of even size
with weights 1/3) does not sit well with momentum: on the default job (4 workers, ring, momentum
0.9) Metropolis weights end at 0.973 / 0.974 test accuracy (seeds 0 / 1), lazy ones at 0.981 /
0.983, as all-reduce does, although their spectral gap is half as large.

The update ``-lr g_i`` above is whatever the local optimizer does to ``x_i`` in its step,
``delta_i = step(x_i) - x_i``: for plain SGD exactly ``-lr g_i``. Momentum (and Adam's moments)
stay local: each worker's buffer accumulates its own gradients and is never averaged, which
keeps the traffic at one model per neighbour per step; since the average of the buffers then
follows the momentum of the average gradient, the average model is still SGD with momentum.

Elastic: when a worker is lost (SIGKILL, a crash of its machine) the survivors go on. A worker
learns of the loss in its step's exchange, after its own optimizer step; the survivors agree on
the new members (:mod:`distrain.runtime.membership`), build the topology again over themselves
(a ring where ``--topology`` cannot be built for their number), and every survivor's model
becomes the survivors' average, counted as traffic: a mixing step with the uniform matrix, which
is doubly stochastic, so the average model still follows SGD. Workers a step or two behind (gossip
lets workers up to the topology's diameter apart) take the furthest one's step count; their own
updates are all in the average. Momentum stays local. A worker that joins takes rank 0's model and
optimizer state, at least the topology's diameter steps after it asked, so no member has passed
that step.

The consensus model (the average of every worker's model, computed with an all-reduce at
evaluation points) is what gets evaluated; ``consensus_distance`` in metrics.jsonl is the mean
over workers of ``||x_i - x_avg||^2`` at those points. The spectral gap of ``W`` is written to
config.json (``algorithm_info``).

D-PSGD and D2 run with :class:`DPSGDSettings`, which :mod:`distrain.assemble` makes from the flags.

Example::

    distrain train --algorithm dpsgd --topology ring
    distrain train --algorithm dpsgd --topology exponential --workers 8 --gossip-order atc
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from distrain.algorithms.base import Algorithm, FlatParams, RunFacts, StepContext, copy_module
from distrain.comm.transport import Handle, Transport
from distrain.errors import ConfigError
from distrain.topology import (
    Graph,
    build_topology,
    diameter,
    eigenvalues,
    mixing_matrix,
    spectral_gap,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class DPSGDSettings:
    """What D-PSGD and D2 run with."""

    #: who exchanges models with whom (a name of :data:`~distrain.topology.TOPOLOGIES`)
    topology: str
    #: the gossip weights (a name of :data:`~distrain.topology.MIXINGS`)
    mixing: str
    #: D-PSGD: ``cta`` (exchange overlapping forward and backward) or ``atc`` (after the update); D2 is atc
    gossip_order: str
    run: RunFacts


class DPSGD(Algorithm):
    """Decentralized parallel SGD over a fixed topology (see the module docstring)."""

    name = "dpsgd"
    replicated = False
    # Elastic: survivors average their models and go on (see the module docstring).
    elastic = True
    realigns = True
    redo_needs_gradients = False
    settings: DPSGDSettings

    @classmethod
    def survives(cls, settings: DPSGDSettings) -> bool:
        r = settings.run
        return r.device == "cpu" and 1 < r.workers and r.min_workers < r.workers

    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, transport: Transport) -> None:
        super().setup(model, optimizer, transport)
        a = self.settings
        rank = transport.rank
        self.graph: Graph = self._topology(a.topology, transport.world_size)
        self.W = self.mixing_weights(mixing_matrix(self.graph, a.mixing))
        self.peers = list(self.graph.neighbors[rank])
        self.self_weight = float(self.W[rank, rank])
        self.peer_weights = [float(self.W[rank, j]) for j in self.peers]
        self.order = self.gossip_order()
        self.flat = FlatParams([p for p in model.parameters() if p.requires_grad])
        self.outgoing = torch.empty(self.flat.numel, dtype=self.flat.dtype)
        self.incoming = [torch.empty_like(self.outgoing) for _ in self.peers]
        self._handles: list[Handle] = []
        self._pending = False
        self._failed: Exception | None = None  # an exchange that could not start (a peer already gone)
        self._realigned = False  # every worker holds the same model (after a loss, until the next step)
        self._consensus_distance: float | None = None
        # Copied before any hook is registered on ``model`` (a hook would drag ``self`` along).
        self.consensus = copy_module(model)
        self._hooks = []
        if self.order == "cta" and self.peers:
            self._hooks.append(model.register_forward_pre_hook(self._on_forward))

    def _topology(self, name: str, n: int) -> Graph:
        """``name`` over ``n`` workers; after a change of members, a ring where it cannot be built."""
        try:
            return build_topology(name, n)
        except ConfigError:
            if n == self.settings.run.workers:
                raise
            log.warning("%s: the %s topology cannot be built for %d workers; gossiping over a ring", self.name, name, n)
            return build_topology("ring", n)

    # -- knobs subclasses change ----------------------------------------------------------------

    def mixing_weights(self, W: torch.Tensor) -> torch.Tensor:
        return W

    def gossip_order(self) -> str:
        return self.settings.gossip_order

    # -- exchange with neighbours ---------------------------------------------------------------

    def _start_exchange(self) -> None:
        assert self.transport is not None
        self._handles, self._pending = [], True
        try:
            for peer, buf in zip(self.peers, self.incoming, strict=True):
                self._handles.append(self.transport.exchange(self.outgoing, buf, peer))
        except Exception as exc:  # a peer already gone: the step's wait reports it, after the local update
            self._failed = exc

    def _finish_exchange(self) -> None:
        handles, failed = self._handles, self._failed
        self._handles, self._pending, self._failed = [], False, None
        for handle in handles:
            handle.wait()
        if failed is not None:
            raise failed

    def _mix_into(self, out: torch.Tensor) -> torch.Tensor:
        """``out += W_ii * outgoing + sum_j W_ij * incoming_j`` (``out`` is float64: the models'
        average stays put to float64 rounding, not float32's, however many steps are mixed)."""
        out.add_(self.outgoing, alpha=self.self_weight)
        for weight, buf in zip(self.peer_weights, self.incoming, strict=True):
            out.add_(buf, alpha=weight)
        return out

    # -- hooks ------------------------------------------------------------------------------------

    def _on_forward(self, module: torch.nn.Module, _args: Any) -> None:
        # cta: the model of this step goes out as soon as the forward pass starts.
        if module.training and not self._pending:
            self.flat.read(out=self.outgoing)
            self._start_exchange()

    def after_backward(self, ctx: StepContext) -> None:
        self._realigned = False
        if self.order == "cta" and self.peers and not self._pending:  # the model was not called via forward()
            self.flat.read(out=self.outgoing)
            self._start_exchange()

    def after_update(self, ctx: StepContext) -> None:
        if not self.peers:
            return
        if self.order == "cta":
            # x_{t+1} = (x' - x_t) + W_ii x_t + sum_j W_ij x_j, where x' = x_t + delta_t.
            self._finish_exchange()
            x = self.flat.read().double().sub_(self.outgoing)
            self.flat.write(self._mix_into(x))
        else:
            self.flat.read(out=self.outgoing)
            self.before_atc_exchange(self.outgoing)
            self._start_exchange()
            self._finish_exchange()
            mixed = self._mix_into(torch.zeros_like(self.outgoing, dtype=torch.float64))
            self.after_atc_mix(mixed)
            self.flat.write(mixed)

    def before_atc_exchange(self, half: torch.Tensor) -> None:
        """atc: change the vector about to be mixed in place (D2 adds its correction)."""

    def after_atc_mix(self, mixed: torch.Tensor) -> None:
        """atc: see the mixed vector before it becomes the model."""

    # -- elastic ------------------------------------------------------------------------------------

    @torch.no_grad()
    def realign(self) -> None:
        """Every survivor's model (and floating-point buffers) becomes the survivors' average."""
        assert self.transport is not None and self.model is not None
        n = self.transport.world_size
        total = self.flat.read()
        self.transport.all_reduce(total).wait()
        self.flat.write(total.div_(n))
        buffers = [b for b in self.model.buffers() if b.is_floating_point()]
        self._average_buffers(buffers, buffers, lambda t: self.transport.all_reduce(t).wait())
        self._realigned = True

    def _average_buffers(self, mine: list[torch.Tensor], into: list[torch.Tensor], reduce: Any) -> None:
        """``into[i]`` becomes the average over workers of ``mine[i]`` (floating-point buffers,
        e.g. BatchNorm statistics), with one ``reduce`` (an in-place sum) of them all."""
        if not mine:
            return
        assert self.transport is not None
        total = torch.cat([b.reshape(-1) for b in mine]).cpu()  # the reductions are on the CPU
        reduce(total)
        for c, chunk in zip(into, total.div_(self.transport.world_size).split([b.numel() for b in mine]), strict=True):
            c.copy_(chunk.view_as(c))

    def admission_step(self, proposed: int) -> int:
        """Members stand up to the topology's diameter steps apart: a joiner enters that much later."""
        return proposed + diameter(self.graph)

    # -- the consensus model ----------------------------------------------------------------------

    @torch.no_grad()
    def eval_model(self) -> torch.nn.Module:
        """The average of every worker's model (collective: every worker calls it, except right
        after the survivors of a loss averaged their models, when each holds it)."""
        assert self.transport is not None and self.model is not None
        if self._realigned:
            self.consensus.load_state_dict(self.model.state_dict())
            self._consensus_distance = 0.0
            return self.consensus
        n = self.transport.world_size
        mine = self.flat.read()
        average = self.transport.control_all_reduce(mine.clone()).div_(n)
        spread = torch.tensor([float((mine - average).pow(2).sum())], dtype=torch.float64)
        self._consensus_distance = float(self.transport.control_all_reduce(spread)) / n
        FlatParams([p for p in self.consensus.parameters() if p.requires_grad]).write(average)
        pairs = [(b, c) for b, c in zip(self.model.buffers(), self.consensus.buffers(), strict=True)
                 if b.is_floating_point()]
        self._average_buffers([b for b, _ in pairs], [c for _, c in pairs], self.transport.control_all_reduce)
        return self.consensus

    def metrics(self) -> dict[str, float]:
        if self._consensus_distance is None:
            return {}
        out, self._consensus_distance = {"consensus_distance": self._consensus_distance}, None
        return out

    def info(self) -> dict[str, Any]:
        lam = eigenvalues(self.W)
        return {"topology": self.graph.name, "mixing": self.settings.mixing, "gossip_order": self.order,
                "spectral_gap": spectral_gap(self.W), "lambda_min": float(lam[-1]) if len(lam) > 1 else 1.0,
                "degrees": self.graph.degrees}

    def close(self) -> None:
        self._finish_exchange()
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


def consensus_distance(models: list[torch.Tensor]) -> float:
    """Mean over workers of ``||x_i - mean(x)||^2`` for flat model vectors (tests, reports)."""
    stacked = torch.stack([m.double() for m in models])
    return float((stacked - stacked.mean(0)).pow(2).sum(1).mean())


__all__ = ["DPSGD", "DPSGDSettings", "consensus_distance"]
