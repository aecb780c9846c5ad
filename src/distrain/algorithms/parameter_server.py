"""Sharded parameter servers: workers push gradients, servers update their shard, workers pull.

The flat parameter vector is cut into ``--servers`` equal shards (balanced by bytes; a shard may
span several tensors). Each step every worker sends each server the gradient of its shard and
receives the shard's new parameters; the server owns the optimizer state of its shard.

Modes:
    sync: a server waits for all workers' gradients of a step, averages them, takes one
        optimizer step, and answers everyone (equal to all-reduce SGD).
    async: a server applies each push as it arrives (gradient / workers, one optimizer step per
        push) and answers that worker at once, unless the worker is more than
        ``--max-staleness`` pushes ahead of the slowest worker: then its answer waits
        (stale-synchronous parallel). With ``--max-staleness 0`` and SGD (with or without
        momentum) this is the sync result, up to the order of floating-point additions.

        Momentum must not act once per push: a round of P pushes would then apply the
        momentum P times on gradients all computed before the round, which diverges at
        learning rates sync trains well with. With SGD the server keeps sync's heavy-ball
        momentum per round (:class:`RoundMomentumSGD`): push i of a round moves the shard by
        ``lr * (momentum * M / P + g_i)`` and the buffer ``M`` becomes ``momentum * M + sum g_i``
        once the round's P pushes are in, exactly one sync step per round when no push is stale.
        Adam steps once per push with ``lr / P`` and ``beta1 ** (1/P)``. A gradient computed on
        parameters ``tau`` rounds old (more than a round of other pushes applied since its
        worker's pull) counts ``1 / (1 + tau)`` (staleness-aware SGD, Zhang et al. 2016).

        Asynchrony itself acts as momentum (Mitliagkas et al. 2016): with ``--max-staleness``
        above 0, P pushers applying gradients some pushes old behave like SGD with an implicit
        momentum of about ``1 - 1/P``. Added to an explicit 0.9 this overshoots at the rates
        sync trains well with (the default job lost 2-10 points at ``--max-staleness 2``), so
        the servers lower the explicit momentum to keep the total inertia at the configured
        value: ``(1 - explicit) * (1/P) = 1 - momentum``, i.e.
        ``explicit = max(0, 1 - P * (1 - momentum))`` (:func:`async_momentum`; 0.6 for 4
        pushers and 0.9). ``--max-staleness 0`` holds every answer until the round is complete,
        has no implicit momentum, and keeps the configured value.

With ``--compress`` (other than none) each worker compresses the gradient of each shard, with
error feedback kept per shard, and the server decodes every push to a dense gradient before
summing; pulls stay dense. The density warm-up sends dense pushes; every worker may push a
different ratio at every step (:meth:`~distrain.algorithms.base.Algorithm.compress_ratio`).
With a sparsifier, SGD with momentum and ``--momentum-correction on`` (the default), the workers
apply momentum and weight decay before compressing (Deep Gradient Compression) and the servers
step with plain SGD.

Hierarchical (``--workers-per-node K``): workers first sum their gradients inside their node
(:mod:`~distrain.algorithms.hierarchical`); only each node's leader pushes the node's sum to the
servers and pulls the parameters, which it then broadcasts inside the node. A server divides the
sum of the pushes by the number of workers, so this is the flat result; in async mode a node's
push counts as one push.

Wire format (tensors only): at start, worker 0 sends each server an int64 header
``[shard_numel, total_steps, steps_per_epoch]`` (checked before the server allocates: at most
``MAX_SHARD_BYTES`` of parameters, and what the server keeps of the shard must fit in its
machine's memory) and the initial shard; each push is an int64
``[clock, lr]`` (the worker's learning rate, a float64's bits) then the float gradient shard, or
with ``--compress`` one message of :mod:`distrain.compress.pushes` (a header announcing the
payload's size, checked by the server before it allocates); each pull is the float parameter
shard. When a worker's training ends it sends ``[-1, 0]`` (:data:`STOP`) to every server, which
serves until every worker has.

Elastic (``--ps-mode sync``, flat, ``--min-workers`` below ``--workers``): a server whose
receive from a worker fails (the worker's process died: its connection resets) declares it
dead in the store and serves the others; the round in progress completes without that
worker's push (or with it, if it arrived first: a gradient counts once), and every later round
sums the survivors' gradients over ``--workers`` as before, i.e. their average at the learning
rate scaled to the smaller global batch (linear scaling rule). The workers never wait for one
another, so nothing is redone. The workers look in the store once a second for workers the
servers lost (:meth:`ParameterServer.newly_lost`): the loss becomes a change of members, and
``distrain train`` splits the data again over the survivors (the learning rate stays: the servers
scale it). At the end the survivors and the servers each register as
finished and close the run over those that did (:func:`survivors_transport`).

A lost worker joins again when the launcher starts it again (``--max-restarts``): it asks in the
store (:meth:`~distrain.runtime.membership.Membership.enter`), and the workers and the servers,
each looking there at every step's end, agree on the step after which it joins, two steps after
the first of them saw it (:func:`admissions`). After that round each server opens a link with it
(:func:`servers_link`: a gloo group of the servers and the worker, since nobody can enter the
run's group again) and sends it its shard of the parameters; the worker takes them and that step
(:meth:`ParameterServer.join`), and from the next round on every server waits for its push again,
summing the live workers' gradients over ``--workers`` as always. The servers are the live state:
no checkpoint is read, the optimizer state stays on them, and the worker's own error-feedback
residuals start from zero. The workers record the change (the members, in order of their ids, so
``distrain train`` gives every worker its shard of the first split back).

A lost server (uncompressed pushes, two servers or more): every worker finds its push or pull
failing, and once the server is declared dead the workers agree in the store that they all lost
it at the same step (it answered nobody; pulls land in a spare buffer, so each worker still holds
the last parameters it answered). The live servers split its ranges between them
(:class:`ShardLayout`), take their pieces' parameters from one worker, redo the step on them with
every worker's gradient and a fresh optimizer state (logged), and serve their shard and pieces as
one from then on: no step lost or applied twice. A server lost while it answered some workers and
not others, a hung worker, async mode, node groups and a lost server with compressed pushes (or
the only one) still stop the run; a run whose servers took over another's cannot resume from its
checkpoints, nor can a worker join it.

The servers step the workers' optimizer on their shards: the same class and hyperparameters
(:func:`server_optimizer`; one parameter group, or groups that differ only in their
parameters), at the learning rate each push carries, so a scheduler attached to the workers'
optimizer drives the servers too.

Workers run with :class:`PSSettings`, servers with :class:`ServerSettings` (the same and what
only a server uses); :mod:`distrain.assemble` makes them from the flags and starts a server
(``distrain.assemble.serve``).

Example::

    distrain train --algorithm ps --servers 2 --ps-mode async --max-staleness 2
    distrain train --algorithm ps --servers 2 --compress group_topk:0.01
    distrain train --algorithm ps --servers 2 --workers 8 --workers-per-node 4
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from distrain.algorithms.base import Algorithm, RunFacts, StepContext
from distrain.algorithms.hierarchical import NodeGroups, node_process_groups
from distrain.comm.link import LinkTransport, open_link
from distrain.comm.store_group import StoreGroup
from distrain.comm.transport import Handle, Transport
from distrain.compress.base import CompressInfo
from distrain.compress.gradients import sgd_momentum, take_momentum
from distrain.compress.momentum_correction import MomentumCorrection
from distrain.compress.pushes import PushDecoder, ShardPush, send_message
from distrain.compress.registry import build_compressor
from distrain.compress.settings import CompressionSettings
from distrain.errors import ConfigError, WorkerFailure
from distrain.optim.optimizers import LARS
from distrain.runtime.faults import FaultWatch, is_comm_error, maybe_injected_kill, store_client
from distrain.runtime.health import DEAD_KEY, declare_dead, declared_dead, finishers
from distrain.runtime.membership import JOINS_KEY, RESTARTS_KEY, Membership
from distrain.runtime.totals import RunTotals
from distrain.topology import NodeMap

if TYPE_CHECKING:
    from distrain.emulation import Emulation
    from distrain.emulation.link import LinkModel

log = logging.getLogger(__name__)

HEADER = 3  # shard_numel, total_steps, steps_per_epoch
#: The clock a worker pushes when its training has ended (no gradient follows).
STOP = -1
#: The clock of a worker's header that announces a takeover of a lost server's ranges (a
#: :data:`TAKEOVER_FIELDS` message follows; see :meth:`ShardServer._take_over`).
TAKEOVER = -2
#: The takeover message: lost server, the worker that sends its parameters, the step redone,
#: the number of parameters (the whole model's).
TAKEOVER_FIELDS = 4
#: The clock of a worker's header that asks the server for its optimizer state (the state
#: follows, :func:`send_state`; the worker's next header is its push as usual).
STATE = -3
#: Store keys of the workers' agreement on a lost server (see :meth:`ParameterServer._agree`).
TAKEOVER_KEY = "distrain/" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") + "/ps/takeover/{}/{}"
#: The largest shard a server accepts, and worker 0 sends (float32 parameters): 8 GiB.
MAX_SHARD_BYTES = 2**33
#: The largest layout of an optimizer state a worker or server accepts (JSON bytes).
MAX_STATE_META = 2**20
#: Shard-sized buffers a server keeps besides one gradient per pusher: the shard, its gradient,
#: optimizer state.
SERVER_COPIES = 3
GIB = 2**30


def send_state(transport: Transport, state: dict[str, Any], dst: int) -> None:
    """Send a nested dict of tensors and plain values (numbers, strings, booleans, None, lists)
    to ``dst``, never pickled: its layout as JSON bytes (each tensor named by position, dtype and
    shape), then every tensor. :func:`recv_state` rebuilds it."""
    tensors: list[torch.Tensor] = []

    def layout(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(value.detach().reshape(-1).contiguous())
            return {"__tensor__": len(tensors) - 1, "dtype": str(value.dtype).removeprefix("torch."),
                    "shape": list(value.shape)}
        if isinstance(value, dict):
            return {"__dict__": [[layout(k), layout(v)] for k, v in value.items()]}  # keys keep their type
        if isinstance(value, (list, tuple)):
            return [layout(v) for v in value]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise TypeError(f"cannot send a {type(value).__name__} in an optimizer state")

    meta = json.dumps(layout(state)).encode()
    handles = [transport.send(torch.tensor([len(meta)], dtype=torch.int64), dst),
               transport.send(torch.frombuffer(bytearray(meta), dtype=torch.uint8), dst)]
    handles += [transport.send(t, dst) for t in tensors]
    for h in handles:
        h.wait()


def recv_state(transport: Transport, src: int) -> dict[str, Any]:
    """The state :func:`send_state` sent from ``src``."""
    size = torch.zeros(1, dtype=torch.int64)
    transport.recv(size, src).wait()
    if not 0 < int(size) <= MAX_STATE_META:
        raise WorkerFailure(f"malformed optimizer state from rank {src}: {int(size)} bytes of layout")
    meta = torch.zeros(int(size), dtype=torch.uint8)
    transport.recv(meta, src).wait()
    layout = json.loads(bytes(meta.tolist()).decode())

    def build(value: Any) -> Any:
        if isinstance(value, dict) and "__tensor__" in value:
            dtype = getattr(torch, str(value["dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                raise WorkerFailure(f"malformed optimizer state from rank {src}: dtype {value['dtype']!r}")
            out = torch.zeros(int(torch.Size(value["shape"]).numel()), dtype=dtype)
            transport.recv(out, src).wait()  # in the order they were sent: depth first, as laid out
            return out.reshape(value["shape"])
        if isinstance(value, dict) and "__dict__" in value:
            return {build(k): build(v) for k, v in value["__dict__"]}
        if isinstance(value, list):
            return [build(v) for v in value]
        return value

    return build(layout)


def physical_memory() -> int | None:
    """Bytes of memory of this machine (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_start_header(values: list[int], pushers: int, memory: int | None) -> tuple[int, int, int]:
    """``(shard_numel, total_steps, steps_per_epoch)`` of a server's start header, checked before
    anything is allocated; WorkerFailure naming what is wrong otherwise.

    Example::

        numel, total, per_epoch = check_start_header(header.tolist(), pushers=4, memory=physical_memory())
    """
    if len(values) != HEADER:
        raise WorkerFailure(f"malformed start header {values}: {len(values)} values, expected {HEADER}")
    numel, total_steps, steps_per_epoch = values
    if total_steps <= 0 or steps_per_epoch <= 0:
        raise WorkerFailure(f"malformed start header {values}: run length must be positive")
    if numel <= 0 or numel * 4 > MAX_SHARD_BYTES:
        raise WorkerFailure(f"start header announces a shard of {numel} parameters; a server accepts 1 to "
                            f"{MAX_SHARD_BYTES // 4} ({MAX_SHARD_BYTES / GIB:g} GiB)")
    need = numel * 4 * (SERVER_COPIES + pushers)
    if memory is not None and need > memory:
        raise WorkerFailure(f"a shard of {numel} parameters needs {need / GIB:.1f} GiB on its server "
                            f"({SERVER_COPIES + pushers} copies), more than this machine's {memory / GIB:.1f} GiB; "
                            "use more --servers")
    return numel, total_steps, steps_per_epoch


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
        self.decay = torch.zeros_like(shard) if weight_decay else None  # weight decay at the round's start

    @torch.no_grad()
    def step(self, grad: torch.Tensor, lr: float) -> None:
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

    def state_dict(self) -> dict[str, Any]:
        state = {"buffer": self.buffer, "pending": self.pending, "count": self.count}
        return state if self.decay is None else {**state, "decay": self.decay}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer.copy_(state["buffer"])
        self.pending.copy_(state["pending"])
        self.count = int(state["count"])
        if self.decay is not None:
            self.decay.copy_(state["decay"])


def shard_bounds(numel: int, servers: int) -> list[tuple[int, int]]:
    """``servers`` contiguous [lo, hi) ranges of nearly equal size covering ``numel`` elements."""
    base, extra = divmod(numel, servers)
    bounds, lo = [], 0
    for s in range(servers):
        hi = lo + base + (1 if s < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


class ShardLayout:
    """Which ranges of the flat parameter vector each server owns: its own shard at first, and
    pieces of lost servers' ranges after takeovers. Workers and servers each keep a copy and
    apply the same takeovers in the same order, so the copies agree; a server's shard is its
    ranges concatenated in order.

    Example::

        layout = ShardLayout(shard_bounds(10, 3))   # [(0, 4)], [(4, 7)], [(7, 10)]
        layout.take_over(1)                          # {0: [(4, 6)], 2: [(6, 7)]}
        layout.owned[2]                              # [(7, 10), (6, 7)]
    """

    def __init__(self, bounds: list[tuple[int, int]]) -> None:
        self.owned = {s: [b] for s, b in enumerate(bounds)}

    def live(self) -> list[int]:
        return sorted(self.owned)

    def numel(self, server: int) -> int:
        return sum(hi - lo for lo, hi in self.owned[server])

    def take_over(self, lost: int) -> dict[int, list[tuple[int, int]]]:
        """Split ``lost``'s ranges over the live servers (each range in nearly equal pieces, in
        server order); returns the pieces each live server gained."""
        ranges = self.owned.pop(lost)
        live = self.live()
        gained: dict[int, list[tuple[int, int]]] = {s: [] for s in live}
        for lo, hi in ranges:
            for s, (a, b) in zip(live, shard_bounds(hi - lo, len(live)), strict=True):
                if b > a:
                    gained[s].append((lo + a, lo + b))
                    self.owned[s].append((lo + a, lo + b))
        return gained


def gather_ranges(flat: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """``flat``'s ``ranges`` concatenated (a view when there is one)."""
    if len(ranges) == 1:
        return flat[ranges[0][0] : ranges[0][1]]
    return torch.cat([flat[lo:hi] for lo, hi in ranges])


def scatter_ranges(flat: torch.Tensor, ranges: list[tuple[int, int]], values: torch.Tensor) -> None:
    """Write ``values`` (``ranges`` concatenated) into ``flat``."""
    offset = 0
    for lo, hi in ranges:
        flat[lo:hi].copy_(values[offset : offset + hi - lo])
        offset += hi - lo


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


def elastic_servers(settings: PSSettings) -> bool:
    """Whether the servers go on without a lost worker (see the module docstring)."""
    r = settings.run
    return (settings.ps_mode == "sync" and not settings.workers_per_node and r.device == "cpu" and 1 < r.workers
            and r.min_workers < r.workers and "TORCHELASTIC_RUN_ID" not in os.environ)


def survivors_transport(store: dist.Store | None, rank: int, world: int,
                        timeout: float) -> tuple[StoreGroup | None, dict[int, float]]:
    """After serving or training (every process of an elastic parameter-server run calls it):
    the processes that finished, as a group over ``store`` (the rendezvous store) for the closing
    bookkeeping (None when all did and the run's group is whole: nobody joined, a worker started
    again being outside it), and the workers lost on the way (global rank -> when declared dead)."""
    if store is None:
        return None, {}
    finished = finishers(store, rank, world, timeout)
    lost = {r: float(store.get(DEAD_KEY.format(r)).decode()) for r in range(world) if r not in finished}
    if not lost and int(store.add(JOINS_KEY, 0)) == 0:
        return None, {}
    return StoreGroup(store, finished, rank, timeout), lost


def admissions(store: dist.Store | None, workers: list[int], me: int, settings: PSSettings) -> Membership | None:
    """Where workers that a launcher starts again ask to join an elastic run (None: it starts
    none, or the run is not elastic): the workers and the servers each look there at every step's
    end, and admit them together at the step agreed in the store (see
    :meth:`~distrain.runtime.membership.Membership.admit`)."""
    if store is None or not elastic_servers(settings) or not store.check([RESTARTS_KEY]):
        return None
    return Membership(store, list(workers), me, timeout=settings.run.timeout)


def servers_link(membership: Membership, worker: int, me: int, settings: PSSettings,
                 link_model: LinkModel | None = None) -> LinkTransport:
    """The link between every server and ``worker``, admitted in ``membership``'s current epoch
    (each of them opens it; ``me``: this process's rank in the run). Its ranks are the run's: the
    servers after the ``--workers`` workers. Workers join only in local runs, whose processes
    listen on the store's address (``MASTER_ADDR``, loopback by default)."""
    workers = settings.run.workers
    servers = [workers + s for s in range(settings.servers)]
    return open_link(membership.store_prefix(f"servers/{worker}"), [*servers, worker], me, workers + settings.servers,
                     settings.run.timeout, link_model, host=os.environ.get("MASTER_ADDR", "127.0.0.1"))


#: How often a worker of an elastic run looks in the store for workers the servers lost (seconds).
LOST_CHECK_S = 1.0


class ParameterServer(Algorithm):
    """The worker side: push gradient shards, pull parameter shards."""

    name = "ps"
    compresses = True
    rescales_lr = False  # the servers divide the survivors' gradients by --workers: already scaled
    settings: PSSettings

    def __init__(self, settings: PSSettings) -> None:
        super().__init__(settings, settings.compression)

    @classmethod
    def survives(cls, settings: PSSettings) -> bool:
        return elastic_servers(settings)

    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, transport: Transport) -> None:
        super().setup(model, optimizer, transport)
        settings = self.settings
        self.num_workers = settings.run.workers
        self.servers = [self.num_workers + s for s in range(settings.servers)]
        self.params = [p for p in model.parameters() if p.requires_grad]
        # The wire and the servers' shards are float32 on the CPU, whatever the model's type and
        # device (a model on the GPU: pinned copies, one transfer each way a step).
        pin = bool(self.params) and self.params[0].device.type == "cuda"
        self.flat = torch.cat([p.detach().reshape(-1) for p in self.params]).to("cpu", torch.float32)
        self.flat = self.flat.pin_memory() if pin else self.flat
        self.grad = torch.zeros_like(self.flat, pin_memory=pin)
        self.bounds = shard_bounds(self.flat.numel(), len(self.servers))
        self.layout = ShardLayout(self.bounds)
        largest = max(hi - lo for lo, hi in self.bounds) * 4
        if largest > MAX_SHARD_BYTES:
            raise ConfigError("--servers", f"{len(self.servers)} servers would each hold up to {largest / GIB:.1f} GiB of "
                                           f"parameters, more than the {MAX_SHARD_BYTES / GIB:g} GiB a server accepts; "
                                           f"use at least {-(-self.flat.numel() * 4 // MAX_SHARD_BYTES)}")
        self.clock = 0
        self._clock_header = torch.zeros(2, dtype=torch.int64)  # [clock, learning rate's float64 bits]
        self._ended = False
        self._control: StoreGroup | None = None  # over the processes that finished (elastic, some lost)
        self._settled = False  # the processes that finished are known
        self._store: Any = None  # the rendezvous store, to read which workers the servers lost
        self._known_lost: set[int] = set()
        self._lost_checked = time.monotonic()
        #: workers that joined the run again after their loss (this one too, if it did); they
        #: lead nothing (their counters cover their last life only)
        self.rejoined: set[int] = set()
        c = settings.compression
        self.push: ShardPush | None = None
        self.ratio, self.momentum, self.weight_decay = 1.0, 0.0, 0.0
        if c.enabled:
            compressor = c.compressor(settings.run.seed)
            if momentum_corrected(c, optimizer):  # the servers step plain SGD
                self.momentum, self.weight_decay = take_momentum(optimizer)
                compressor = MomentumCorrection(compressor.inner, self.momentum)
            self.push = ShardPush(compressor)
            self.density = c.warmup(compressor.ratio)
        #: the others take over a lost server's ranges (elastic, uncompressed, two servers or more);
        #: pulls then land in a second buffer, so a failed one leaves the last parameters whole
        self.takes_over = elastic_servers(settings) and self.push is None and len(self.servers) > 1
        self._spare = self.flat.clone() if self.takes_over else None
        self._started = False  # worker 0 started the servers (start())
        self._loaded_servers: list[dict[str, Any]] | None = None  # load_server_state(): sent at the start
        # --workers-per-node: sum inside the node; only its leader talks to the servers
        k = settings.workers_per_node
        self.nodes = NodeGroups(transport, k, timeout=settings.run.timeout, workers=self.num_workers) if k else None
        self.pushes = self.nodes is None or self.nodes.is_leader

    def _push_info(self, ctx: StepContext) -> tuple[CompressInfo, bool]:
        """How this step's pushes are compressed (key 0; set per shard), and whether they are dense."""
        epochs_done = ctx.epoch * ctx.step / (ctx.step + 1)  # ctx.epoch counts the step being finished
        dense = self.density.dense(epochs_done)
        ratio = None if dense else self.compress_ratio(ctx)
        if not dense and (ratio is None or self.push.compressor.ratio is None):
            ratio = self.density.ratio(epochs_done)
        self.ratio = 1.0 if dense or ratio is None else ratio
        return CompressInfo(step=ctx.step, ratio=ratio, worker=self.transport.rank), dense

    def start(self, total_steps: int, steps_per_epoch: int) -> None:
        """Worker 0 tells every server its shard size and the run length, and sends the start values
        (and the optimizer state to start from, after :meth:`load_server_state`)."""
        if self._started:  # a worker that joined a running job (:meth:`join`)
            return
        self._started = True
        if self.transport.rank != 0:
            return
        self.flat.copy_(torch.cat([p.detach().reshape(-1) for p in self.params]))  # after any resume
        handles: list[Handle] = []
        loaded = self._loaded_servers
        for s, (server, (lo, hi)) in enumerate(zip(self.servers, self.bounds, strict=True)):
            header = torch.tensor([hi - lo, total_steps, steps_per_epoch], dtype=torch.int64)
            follows = torch.tensor([0 if loaded is None else 1], dtype=torch.int64)
            handles += [self.transport.send(header, server), self.transport.send(self.flat[lo:hi].contiguous(), server),
                        self.transport.send(follows, server)]
            if loaded is not None:
                for h in handles:
                    h.wait()
                handles = []
                send_state(self.transport, loaded[s], server)
        for h in handles:
            h.wait()

    def server_state(self) -> list[dict[str, Any]] | None:
        """Every server's optimizer state, asked for now (between two steps): what ``wrap()``'s
        ``state_dict()`` holds besides the workers' own state. None on a worker that does not talk
        to the servers (``--workers-per-node``: only each node's first worker does)."""
        if not self.pushes:
            return None
        if not self._started:  # no step yet: the servers hold what they were started with
            return self._loaded_servers
        if self._ended:
            raise RuntimeError("state_dict() under algorithm='ps' after this worker's training ended: the servers "
                               "stop serving it then; save the state before finish()")
        if self.layout.live() != list(range(len(self.servers))):
            raise WorkerFailure("the servers took over a lost server's parameters: their state no longer matches "
                                "the run's shards, so it cannot be saved for a resume")
        asking = torch.tensor([STATE, 0], dtype=torch.int64)
        states = []
        for server in self.servers:
            self.transport.send(asking, server).wait()
            states.append(recv_state(self.transport, server))
        return states

    def load_server_state(self, states: list[dict[str, Any]] | None) -> None:
        """Start the servers from ``states`` (:meth:`server_state` of a run with as many servers
        and the same model); before the first step."""
        if states is None:
            return
        if self._started:
            raise RuntimeError("load_state_dict() under algorithm='ps' must come before the first step: the "
                               "servers take their optimizer state when training starts")
        if not isinstance(states, list) or len(states) != len(self.servers):
            raise ConfigError("servers", f"the saved state is of {len(states) if isinstance(states, list) else '?'} "
                                         f"servers, this run has {len(self.servers)}")
        self._loaded_servers = states

    def after_backward(self, ctx: StepContext) -> None:
        self.grad.copy_(torch.cat([p.grad.reshape(-1) if p.grad is not None
                                   else torch.zeros(p.numel(), dtype=p.dtype, device=p.device) for p in self.params]))
        info, dense = self._push_info(ctx) if self.push is not None else (None, True)
        if self.push is not None and self.momentum and self.weight_decay:  # the servers' SGD has none
            self.grad.add_(torch.cat([p.detach().reshape(-1) for p in self.params]).to(self.grad.device),
                           alpha=self.weight_decay)
        self.clock += 1
        intra = self.nodes.intra if self.nodes is not None and self.nodes.intra.world_size > 1 else None
        if intra is not None:
            intra.reduce(self.grad, dst=0).wait()  # the leader holds the node's sum
        if self.pushes:
            self._push_pull(info, dense)
        if intra is not None:
            intra.broadcast(self.flat, src=0).wait()
        if self.nodes is not None:
            self.nodes.fold_stats()
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(self.flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    def _push_pull(self, info: CompressInfo | None, dense: bool) -> None:
        """Send every server its gradient shard (with this step's clock and learning rate);
        receive its parameters."""
        assert self.optimizer is not None
        self._clock_header[0] = self.clock
        self._clock_header[1:] = torch.tensor([float(self.optimizer.param_groups[0]["lr"])], dtype=torch.float64).view(torch.int64)
        if self.takes_over:
            self._push_pull_elastic()
            return
        handles: list[Handle] = []
        for shard, (server, (lo, hi)) in enumerate(zip(self.servers, self.bounds, strict=True)):
            handles.append(self.transport.send(self._clock_header, server))
            if self.push is None or info is None:
                handles.append(self.transport.send(self.grad[lo:hi], server))
            else:
                info.key = shard
                handles += send_message(self.transport, self.push.encode(self.grad[lo:hi], info, dense=dense), server)
            handles.append(self.transport.recv(self.flat[lo:hi], server))
        for h in handles:
            h.wait()

    def _push_pull_elastic(self) -> None:
        """The push and pull of a run whose servers may be lost: each live server's ranges; the
        pulls land in the spare buffer, which becomes the parameters once every server answered.
        A server lost on the way is taken over by the others (:meth:`_take_over`)."""
        assert self._spare is not None
        pending: dict[int, tuple[torch.Tensor, list[Handle]]] = {}
        lost: list[tuple[int, BaseException]] = []
        for s in self.layout.live():
            ranges, server = self.layout.owned[s], self.servers[s]
            into = gather_ranges(self._spare, ranges) if len(ranges) == 1 else torch.empty(self.layout.numel(s))
            try:  # a connection already closed fails here, not at the wait
                pending[s] = (into, [self.transport.send(self._clock_header, server),
                                     self.transport.send(gather_ranges(self.grad, ranges), server),
                                     self.transport.recv(into, server)])
            except Exception as exc:
                if not is_comm_error(exc):
                    raise
                lost.append((s, exc))
        for s, (into, handles) in pending.items():
            try:
                for h in handles:
                    h.wait()
            except Exception as exc:
                if not is_comm_error(exc):
                    raise
                lost.append((s, exc))
                continue
            if len(self.layout.owned[s]) > 1:
                scatter_ranges(self._spare, self.layout.owned[s], into)
        if not lost:
            self.flat, self._spare = self._spare, self.flat
            return
        for s in pending:  # the live servers' answers; the lost ones' ranges keep the last parameters
            if s not in dict(lost):
                scatter_ranges(self.flat, self.layout.owned[s], gather_ranges(self._spare, self.layout.owned[s]))
        for s, exc in lost:
            self._take_over(s, exc)
        self._spare.copy_(self.flat)

    def _take_over(self, s: int, exc: BaseException) -> None:
        """Server ``s`` is lost while this step's pushes were out (its connection reset): once it
        is declared dead, the workers agree (:meth:`_agree`) and send every live server a
        takeover: the servers split its ranges between them (:class:`ShardLayout`), start them
        from the parameters of the last step it answered (from one worker) with fresh optimizer
        state, redo this step on them with every live worker's gradient, and answer the new
        parameters. No step is lost or applied twice."""
        store = self._store_client()
        rank = self.servers[s]
        deadline = time.monotonic() + self.settings.run.timeout
        while store is None or not declared_dead(store, rank):  # the launcher declares an exited process dead
            if store is None or time.monotonic() > deadline:
                raise exc
            time.sleep(0.02)
        leader = self._agree(store, s)
        gained = self.layout.take_over(s)
        me, numel = self.transport.rank, self.flat.numel()
        log.warning("worker %d: lost server %d at step %d; servers %s take over its parameters", me, s, self.clock,
                    [t for t, pieces in gained.items() if pieces])
        header = self._clock_header.clone()
        header[0] = TAKEOVER
        message = torch.tensor([s, leader, self.clock, numel], dtype=torch.int64)
        handles: list[Handle] = []
        answers: dict[int, torch.Tensor] = {}
        for t, pieces in gained.items():
            server = self.servers[t]
            handles += [self.transport.send(header, server), self.transport.send(message, server)]
            if not pieces:
                continue
            if me == leader:
                handles.append(self.transport.send(gather_ranges(self.flat, pieces).contiguous(), server))
            handles.append(self.transport.send(gather_ranges(self.grad, pieces).contiguous(), server))
            answers[t] = torch.empty(sum(hi - lo for lo, hi in pieces))
            handles.append(self.transport.recv(answers[t], server))
        for h in handles:
            h.wait()
        for t, values in answers.items():
            scatter_ranges(self.flat, gained[t], values)

    def _agree(self, store: Any, s: int) -> int:
        """The live workers agree on taking over server ``s`` at this step: each registers its
        step; all must have seen the loss at the same step (the server died before answering
        anyone), else the run stops with one line. Returns the worker that sends the parameters
        (the first live one)."""
        me = self.transport.rank
        store.set(TAKEOVER_KEY.format(s, me), str(self.clock))
        deadline = time.monotonic() + self.settings.run.timeout
        while True:
            live = [w for w in range(self.num_workers) if not declared_dead(store, w)]
            seen = {w: int(store.get(TAKEOVER_KEY.format(s, w)).decode()) for w in live
                    if store.check([TAKEOVER_KEY.format(s, w)])}
            if len(seen) == len(live):
                break
            if time.monotonic() > deadline:
                raise WorkerFailure(f"worker {me}: lost server {s} at step {self.clock}; workers "
                                    f"{sorted(set(live) - set(seen))} never reported it")
            time.sleep(0.02)
        if set(seen.values()) != {self.clock}:
            raise WorkerFailure(f"worker {me}: server {s} was lost while it answered step {self.clock} (workers saw it "
                                f"at steps {seen}); its parameters differ between workers and it cannot be taken over")
        return live[0]

    def join(self) -> int:
        """This worker was started again and the servers admitted it (its transport is their
        link, :func:`servers_link`): take every server's parameters of the step after which they
        admitted it, and that step (returned), where this worker's clock goes on from. The
        servers hold the optimizer state; a worker keeps none of its own but its error-feedback
        residuals (and momentum, under momentum correction), which start again from zero."""
        steps = set()
        header = torch.zeros(2, dtype=torch.int64)
        for server, (lo, hi) in zip(self.servers, self.bounds, strict=True):
            self.transport.recv(header, server).wait()
            step, numel = (int(v) for v in header.tolist())
            if numel != hi - lo:
                raise WorkerFailure(f"worker {self.transport.rank}: server {server - self.num_workers} announced "
                                    f"{numel} parameters for its shard of {hi - lo}")
            self.transport.recv(self.flat[lo:hi], server).wait()
            steps.add(step)
        if len(steps) != 1:
            raise WorkerFailure(f"worker {self.transport.rank}: the servers admitted it after different steps {sorted(steps)}")
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(self.flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        self.clock, self._started = steps.pop(), True
        self.rejoined.add(self.transport.rank)
        self._known_lost = set(range(self.num_workers)) - set(self.live_workers())  # lost before it joined
        return self.clock

    def rejoin(self, workers: list[int]) -> None:
        """``workers`` joined again after their loss: a later loss of theirs is news again."""
        self._known_lost.difference_update(workers)
        self.rejoined.update(workers)

    def live_workers(self) -> list[int]:
        """The workers the servers have not declared dead (elastic runs; all of them otherwise)."""
        store = self._store_client()
        return [r for r in range(self.num_workers) if store is None or not declared_dead(store, r)]

    def apply_update(self, ctx: StepContext) -> None:
        """The servers took the optimizer step."""

    def end(self) -> None:
        """Tell every server this worker's training is over (they serve until every worker has)."""
        if self._ended or not self.pushes:
            return
        self._ended = True
        stop = torch.tensor([STOP, 0], dtype=torch.int64)
        for h in [self.transport.send(stop, self.servers[s]) for s in self.layout.live()]:
            h.wait()

    def control_transport(self) -> StoreGroup | None:  # type: ignore[override]
        """Once this worker's training has ended, in an elastic run: the processes that finished,
        when some workers were lost (they register as finished; see :func:`survivors_transport`)."""
        if not self._ended or not elastic_servers(self.settings):
            return None
        if not self._settled:
            assert self.transport is not None
            self._settled = True
            self._control, lost = survivors_transport(self._store_client(), self.transport.rank,
                                                      self.transport.world_size, self.settings.run.timeout)
            self.lost_workers = {r: t for r, t in lost.items() if r < self.num_workers}
            self.lost_servers = {r - self.num_workers: t for r, t in lost.items() if r >= self.num_workers}
        return self._control

    def newly_lost(self, force: bool = False) -> dict[int, float]:
        """Workers the servers declared dead since the last call (elastic runs), so that the loop
        spreads their data over the survivors."""
        now = time.monotonic()
        if not elastic_servers(self.settings) or (not force and now - self._lost_checked < LOST_CHECK_S):
            return {}
        self._lost_checked = now
        store = self._store_client()
        if store is None:
            return {}
        new = {r: float(store.get(DEAD_KEY.format(r)).decode()) for r in range(self.num_workers)
               if r not in self._known_lost and declared_dead(store, r)}
        self._known_lost.update(new)
        return new

    def leads(self, transport: Transport) -> bool:
        """In an elastic run: the first worker the servers have not lost (once training ended, the
        first that finished), of those in the run from its start when there are any."""
        if not elastic_servers(self.settings):
            return super().leads(transport)
        if self._ended:
            control = self.control_transport()
            live = [r for r in (control.members if control is not None else range(self.num_workers))
                    if r < self.num_workers]
        else:
            live = self.live_workers()
        first = [r for r in live if r not in self.rejoined] or live
        return bool(first) and self.transport.rank == first[0]

    def _store_client(self) -> Any:
        """The rendezvous store (a client made on first use; None without one)."""
        if self._store is None:
            self._store = store_client(self.settings.run.timeout)
        return self._store

    def metrics(self) -> dict[str, float]:
        if self.push is None:
            return {}
        adaptive = {} if self.adaptive is None else self.adaptive.metrics(self.transport)
        return {"compress_ratio": self.ratio, **adaptive}

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"clock": self.clock}
        if self.push is not None:
            state["compressor"] = self.push.compressor.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.clock = int(state.get("clock", 0))
        if self.push is not None and "compressor" in state:
            self.push.compressor.load_state_dict(state["compressor"])

    def close(self) -> None:
        if self.nodes is not None:
            self.nodes.close()


class ShardServer:
    """One server process: owns a shard of the parameters and its optimizer state.

    Args:
        settings: what the server runs with (workers, servers, mode, compression, checkpoints).
        transport: this server's transport over the world.
        run_dir: where it saves its checkpoints; None: it saves none (``wrap()``, whose user
            saves the workers' state).
        like: the workers' optimizer, whose class and hyperparameters the server steps its shard
            with (:func:`server_optimizer`).
    """

    def __init__(self, settings: ServerSettings, transport: Transport, run_dir: str | Path | None,
                 like: torch.optim.Optimizer) -> None:
        self.settings = settings
        self.transport = transport
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.num_workers = settings.run.workers
        self.index = transport.rank - self.num_workers
        k = settings.workers_per_node  # hierarchical: only node leaders push, each its node's sum
        self.pushers = NodeMap(self.num_workers, k).leaders if k else list(range(self.num_workers))
        self.lost_pushers: list[int] = []  # workers lost during the run (elastic runs)
        header = torch.zeros(HEADER, dtype=torch.int64)
        transport.recv(header, 0).wait()
        try:
            numel, self.total_steps, self.steps_per_epoch = check_start_header(header.tolist(), len(self.pushers),
                                                                                physical_memory())
        except WorkerFailure as exc:
            raise WorkerFailure(f"server {self.index}: {exc} (from worker 0)") from None
        self.shard = torch.nn.Parameter(torch.empty(numel))
        transport.recv(self.shard.data, 0).wait()
        follows = torch.zeros(1, dtype=torch.int64)
        transport.recv(follows, 0).wait()  # 1: worker 0 sends the optimizer state to resume from
        loaded = recv_state(transport, 0) if int(follows) == 1 else None
        pushes, asynchronous = len(self.pushers), settings.ps_mode == "async"
        self.optimizer, self.lr_factor = server_optimizer(
            like, self.shard, asynchronous=asynchronous, pushers=pushes, max_staleness=settings.max_staleness,
            corrected=momentum_corrected(settings.compression, like))
        if isinstance(self.optimizer, RoundMomentumSGD) and self.optimizer.momentum != like.param_groups[0]["momentum"]:
            log.info("server %d: momentum %g lowered to %.3g for %d pushers out of step (--max-staleness %d)",
                     self.index, like.param_groups[0]["momentum"], self.optimizer.momentum, pushes, settings.max_staleness)
        self.shard.grad = torch.zeros(numel)
        self.updates = 0
        self.steps = 0  # the workers' steps served (sync: rounds; async: the most any worker pushed)
        self.clocks = [0] * len(self.pushers)  # each pusher's last clock
        self.resume_step: int | None = None  # the step a state sent at the start continues from
        if loaded is not None:
            self.load_optimizer_state(loaded)
        self._store: Any = None  # the rendezvous store, where lost workers are declared (elastic runs)
        self._links: dict[int, Transport] = {}  # pusher row -> the link opened when its worker joined
        self._opened: list[Transport] = []  # every link opened, for the counters
        #: elastic runs whose launcher starts lost workers again: where they ask to join
        self.joins = admissions(self._store_client() if elastic_servers(settings) else None, self.pushers,
                                transport.rank, settings)
        self.layout: ShardLayout | None = None  # every server's ranges, from the first takeover on
        self._proposed = False  # this server proposed the step every worker stops at (SIGTERM)
        c = settings.compression
        self.decoder = (PushDecoder(build_compressor(c.spec, error_feedback=False, seed=settings.run.seed), numel)
                        if c.enabled else None)
        self.started, self.cpu_started = time.perf_counter(), time.process_time()
        self.earlier = RunTotals()  # what the earlier segments of a resumed run did

    def optimizer_state(self) -> dict[str, Any]:
        """This server's optimizer state, update count, the steps it served and each pusher's
        last clock (what ``wrap()``'s ``state_dict()`` holds)."""
        clocks = list(self.clocks) if self.settings.ps_mode == "async" else [self.steps] * len(self.pushers)
        return {"optimizer": self.optimizer.state_dict(), "updates": self.updates, "steps": self.steps,
                "clocks": clocks}

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`optimizer_state` of a run with the same shards and pushers."""
        optimizer, clocks = state.get("optimizer"), state.get("clocks")
        if not isinstance(optimizer, dict) or not isinstance(clocks, list) or len(clocks) != len(self.pushers):
            raise WorkerFailure(f"server {self.index}: the optimizer state it was sent is malformed, or of a run "
                                f"with another number of workers pushing ({len(self.pushers)} here)")
        self.optimizer.load_state_dict(optimizer)
        self.updates, self.steps, self.clocks = int(state.get("updates", 0)), int(state.get("steps", 0)), clocks
        self.resume_step = self.steps

    def _peer(self, i: int) -> Transport:
        """The transport to pusher row ``i``: the run's, or the link opened when it joined."""
        return self._links.get(i, self.transport)

    def _recv_header(self, out: torch.Tensor, worker: int, transport: Transport | None = None) -> None:
        """``worker``'s next push header into ``out``, answering its requests for the optimizer
        state on the way (:data:`STATE`)."""
        transport = transport or self.transport
        while True:
            transport.recv(out, worker).wait()
            if int(out[0]) != STATE:
                return
            send_state(transport, self.optimizer_state(), worker)

    def _recv_push(self, out: torch.Tensor, worker: int, transport: Transport | None = None) -> Handle | None:
        """Receive ``worker``'s gradient push into ``out``: a handle to wait for when dense, else
        decoded here (a compressed push's size is known only once its header arrived)."""
        transport = transport or self.transport
        if self.decoder is None:
            return transport.recv(out, worker)
        out.copy_(self.decoder.recv(transport, worker))
        return None

    def _step(self, grad: torch.Tensor, lr: float, weight: float = 1.0) -> None:
        """One optimizer step on ``grad`` (the averaged or pushed gradient) at the workers'
        learning rate ``lr``, counted ``weight``."""
        if isinstance(self.optimizer, RoundMomentumSGD):
            self.optimizer.step(grad.mul_(weight), lr)
        else:
            self.shard.grad.copy_(grad)
            for group in self.optimizer.param_groups:
                group["lr"] = lr * self.lr_factor * weight
            self.optimizer.step()
        self.updates += 1

    def run(self, start_step: int = 0, watch: Any = None) -> None:
        """Serve until every pushing worker has sent :data:`STOP`."""
        self.watch = watch
        self.steps = start_step
        if self.settings.ps_mode == "sync":
            self._run_sync(start_step)
        else:
            self._run_async()

    def _stop_requested(self, step: int) -> None:
        """SIGTERM / Ctrl-C here: propose the step every worker stops at (they then send STOP)."""
        if self.watch is not None and self.watch.stop.requested.is_set() and not self._proposed:
            self._proposed = True
            self.watch.agreed_step(step, synchronous=True)

    def _run_sync(self, start_step: int) -> None:
        pushers = self.pushers
        headers = torch.zeros(len(pushers), 2, dtype=torch.int64)
        grads = torch.zeros(len(pushers), self.shard.numel())  # a lost worker's row stays zero
        every = self.settings.checkpoint_every
        step = start_step
        live = list(range(len(pushers)))  # rows of the workers still pushing
        while True:
            maybe_injected_kill(self.transport.rank, step)  # fault injection for tests
            if self.watch is not None:
                self.watch.step = step
            for i in list(live):
                self._with_worker(i, live, step, grads,
                                  lambda i=i: self._recv_header(headers[i], pushers[i], self._peer(i)))
            clocks = headers[live, 0]
            if bool((clocks == STOP).all()):
                break
            if bool((clocks == TAKEOVER).any()):
                grads = self._take_over(live, headers, step, grads)
                continue
            if not bool((clocks == step + 1).all()):
                raise WorkerFailure(f"server {self.index}: step {step + 1} expected, workers "
                                    f"{[pushers[i] for i in live]} sent clocks {clocks.tolist()} (-1: training ended)")
            for i in list(live):
                self._with_worker(i, live, step, grads, lambda i=i, grads=grads:
                                  (h := self._recv_push(grads[i], pushers[i], self._peer(i))) and h.wait())
            lr = float(headers[live, 1].clone().view(torch.float64).mean())
            self._step(grads.sum(0).div_(self.num_workers), lr)
            handles = {i: self._with_worker(i, live, step, grads,
                                            lambda i=i: self._peer(i).send(self.shard.data, pushers[i]))
                       for i in list(live)}
            for i, h in handles.items():
                if h is not None:
                    self._with_worker(i, live, step, grads, h.wait)
            step = self.steps = step + 1
            if self.joins is not None:  # workers started again join after this round
                self._admit_joiners(step, live)
            if every and step % every == 0:
                self.save(step)
            self._stop_requested(step - 1)
        if step > start_step and not (every and step % every == 0):
            self.save(step)

    def _take_over(self, live: list[int], headers: torch.Tensor, step: int, grads: torch.Tensor) -> torch.Tensor:
        """Every live worker announced the takeover of a lost server at step ``step``, just served (see
        :meth:`ParameterServer._take_over`): this server takes its share of the lost ranges
        (:class:`ShardLayout`), their parameters of the last step answered from one worker, redoes
        the step on them with every live worker's gradient and a fresh optimizer state, answers
        them, and from then on serves its shard and its share as one. Returns the buffer of pushes
        for the larger shard."""
        pushers = self.pushers
        clocks = headers[live, 0]
        if not bool((clocks == TAKEOVER).all()):
            raise WorkerFailure(f"server {self.index}: a takeover announced by some workers only (clocks {clocks.tolist()})")
        messages = torch.zeros(len(pushers), TAKEOVER_FIELDS, dtype=torch.int64)
        for i in list(live):
            self._with_worker(i, live, step, grads, lambda i=i: self._peer(i).recv(messages[i], pushers[i]).wait())
        if not live or not bool((messages[live] == messages[live[0]]).all()):
            raise WorkerFailure(f"server {self.index}: workers disagree on a takeover: {messages[live].tolist()}")
        lost, leader, redone, numel = messages[live[0]].tolist()
        if redone != step:  # the step the live servers just served, the lost one never did
            raise WorkerFailure(f"server {self.index}: a takeover of step {redone} after serving step {step}")
        if self.layout is None:
            self.layout = ShardLayout(shard_bounds(numel, self.settings.servers))
        pieces = self.layout.take_over(lost)[self.index]
        if not pieces:
            log.warning("server %d: server %d is lost; the others take over its parameters", self.index, lost)
            return grads
        n = sum(hi - lo for lo, hi in pieces)
        piece = torch.nn.Parameter(torch.empty(n))
        self._peer(pushers.index(leader)).recv(piece.data, leader).wait()
        pushed = torch.zeros(len(pushers), n)
        for i in list(live):
            self._with_worker(i, live, step, pushed, lambda i=i: self._peer(i).recv(pushed[i], pushers[i]).wait())
        fresh = type(self.optimizer)([piece], **optimizer_settings(self.optimizer))  # type: ignore[arg-type]
        piece.grad = pushed.sum(0).div_(self.num_workers)
        lr = float(headers[live, 1].clone().view(torch.float64).mean())
        for group in fresh.param_groups:
            group["lr"] = lr * self.lr_factor
        fresh.step()
        handles = {i: self._with_worker(i, live, step, pushed, lambda i=i: self._peer(i).send(piece.data, pushers[i]))
                   for i in list(live)}
        for i, h in handles.items():
            if h is not None:
                self._with_worker(i, live, step, pushed, h.wait)
        self.shard, self.optimizer = merged_optimizer(self.optimizer, self.shard, fresh, piece)  # type: ignore[arg-type]
        log.warning("server %d: took over parameters %s of lost server %d at step %d (from worker %d's copy); their "
                    "optimizer state starts from zero", self.index, pieces, lost, step, leader)
        return torch.zeros(len(pushers), self.shard.numel())

    def _admit_joiners(self, step: int, live: list[int]) -> None:
        """After round ``step``: when the workers and servers agreed (in the store) to admit workers
        started again after this step, open a link to each, send it this server's parameters of
        the step, and from the next round on wait for its push again."""
        assert self.joins is not None
        growth = self.joins.planned_growth(step)
        if growth is None or growth.at != step:
            return
        change = self.joins.admit(growth, step, time.perf_counter(), [self.pushers[i] for i in live])
        if change.joined and self.layout is not None:  # the link would wait for the lost server
            raise WorkerFailure(f"server {self.index}: worker(s) {change.joined} asked to join after step {step}, but "
                                "the servers took over a lost server's parameters; a worker cannot join such a run")
        for worker in change.joined:
            i = self.pushers.index(worker)
            if i in live:  # its loss was never seen here: its row would count twice
                raise WorkerFailure(f"server {self.index}: worker {worker} joined after step {step}, but this "
                                    "server was still serving its earlier process")
            link = servers_link(self.joins, worker, self.transport.rank, self.settings, self.transport.link_model)
            for h in [link.send(torch.tensor([step, self.shard.numel()], dtype=torch.int64), worker),
                      link.send(self.shard.data, worker)]:
                h.wait()
            self._links[i] = link
            self._opened.append(link)
            live.append(i)
            live.sort()
            if worker in self.lost_pushers:
                self.lost_pushers.remove(worker)
            log.info("server %d: worker %d joined after step %d; serving %d", self.index, worker, step, len(live))

    def _with_worker(self, i: int, live: list[int], step: int, grads: torch.Tensor, fn: Any) -> Any:
        """``fn()``, an exchange with pusher row ``i`` (its result; None once the worker is lost);
        in an elastic run a worker whose process died (its connection reset) is lost: declared
        dead, its row zeroed, the others served."""
        if i not in live:
            return None
        try:
            return fn()
        except Exception as exc:
            if not (elastic_servers(self.settings) and is_comm_error(exc)):
                raise
            worker = self.pushers[i]
            live.remove(i)
            self.lost_pushers.append(worker)
            grads[i].zero_()
            declare_dead(self._store_client(), worker)
            log.warning("server %d: lost worker %d at step %d; serving the other %d", self.index, worker, step + 1,
                        len(live))
            if len(live) < max(1, self.settings.run.min_workers):
                raise WorkerFailure(f"server {self.index}: lost worker {worker} at step {step + 1}; {len(live)} "
                                    f"left, fewer than --min-workers {self.settings.run.min_workers}") from exc
            return None

    def _store_client(self) -> Any:
        """The rendezvous store (a client made on first use; None without one)."""
        if self._store is None:
            self._store = store_client(self.settings.run.timeout)
        return self._store

    def control_transport(self) -> Transport | StoreGroup:
        """After serving: the transport for the closing collectives, over the processes that
        finished when workers were lost in an elastic run."""
        if not elastic_servers(self.settings):
            return self.transport
        control, _ = survivors_transport(self._store_client(), self.transport.rank, self.transport.world_size,
                                         self.settings.run.timeout)
        return control or self.transport

    def _run_async(self) -> None:
        """Apply pushes in arrival order; hold back answers to workers too far ahead."""
        n, limit = len(self.pushers), self.settings.max_staleness
        index = {w: i for i, w in enumerate(self.pushers)}
        clocks = self.clocks  # from a state sent at the start, else zeros
        ended = [False] * n
        pulled = [self.updates] * n  # self.updates when each pusher last got the parameters (a resumed run: its start)
        waiting: deque[int] = deque()
        header = torch.zeros(2, dtype=torch.int64)
        grad = torch.zeros(self.shard.numel())
        while not all(ended):
            worker = self.transport.recv_any(header)
            clock = int(header[0])
            if worker in index and clock == STATE:
                send_state(self.transport, self.optimizer_state(), worker)
                continue
            if worker in index and clock == STOP and not ended[index[worker]] and worker not in waiting:
                ended[index[worker]] = True
            elif worker not in index or clock != clocks[index[worker]] + 1 or ended[index[worker]]:
                raise WorkerFailure(f"server {self.index}: unexpected push (worker {worker}, clock {clock})")
            else:
                handle = self._recv_push(grad, worker)
                if handle is not None:
                    handle.wait()
                clocks[index[worker]] = clock
                self.steps = max(self.steps, clock)
                stale_rounds = (self.updates - pulled[index[worker]]) // n
                lr = float(header[1:].clone().view(torch.float64))
                self._step(grad.div_(self.num_workers), lr, 1 / (1 + stale_rounds))
                waiting.append(worker)
                self._stop_requested(clock)
            # a worker that has ended holds nobody back
            slowest = min((c for c, done in zip(clocks, ended, strict=True) if not done), default=None)
            for w in [w for w in waiting if slowest is None or clocks[index[w]] - slowest <= limit]:
                waiting.remove(w)
                pulled[index[w]] = self.updates
                self.transport.send(self.shard.data, w).wait()
        if waiting:
            raise WorkerFailure(f"server {self.index}: workers {list(waiting)} still waiting at the end")
        self.save(self.steps)

    def save(self, step: int) -> None:
        if self.run_dir is None:
            return
        from distrain.runtime.checkpoint import MEMBERS_KEY, CheckpointStore

        world = self.transport.world_size
        store = CheckpointStore(self.run_dir, self.transport.rank, world)
        # after a loss the set is written by the processes still serving and training
        members = [r for r in range(world) if r not in self.lost_pushers]
        store.save(step, {"shard": self.shard.data, "optimizer": self.optimizer.state_dict(), "step": step,
                          "model_name": self.settings.model, "algorithm_name": "ps",
                          "world_size": world, "steps_per_epoch": self.steps_per_epoch,
                          "total_steps": self.total_steps, "totals": self.totals().state_dict(),
                          **({MEMBERS_KEY: members} if self.lost_pushers else {})})

    def load(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's state (see :meth:`save`)."""
        if state["shard"].numel() != self.shard.numel():
            raise WorkerFailure(f"server {self.index}: its checkpoint holds {state['shard'].numel()} parameters, not "
                                f"{self.shard.numel()}: it took over a lost server's, and such a run cannot resume")
        self.shard.data.copy_(state["shard"])
        self.optimizer.load_state_dict(state["optimizer"])

    def totals(self) -> RunTotals:
        """This server's counters over the run so far, every segment (a row that trained no samples)."""
        every = [self.transport.stats, *(link.stats for link in self._opened)]
        sent = [sum(column) for column in zip(*(t.sent for t in every), strict=True)]
        received = [sum(column) for column in zip(*(t.received for t in every), strict=True)]
        busy = sum(t.comm_seconds for t in every)
        row = [0.0, 0.0, time.perf_counter() - self.started, 0.0, busy, *sent, *received,
               time.process_time() - self.cpu_started]
        return self.earlier.plus(row, 0.0, None)


def serve(settings: ServerSettings, run_dir: str | Path | None, like: torch.optim.Optimizer, emulation: Emulation,
          *, gather_totals: bool = True) -> None:
    """Run one parameter server until every worker's training has ended; then join the final
    gather of counters (``gather_totals``: distrain's own loop) and the closing barrier.

    ``like``: the workers' optimizer; ``emulation``: this server's emulated links (not started);
    ``run_dir`` None saves no checkpoint and resumes from none. ``distrain.assemble.serve`` makes
    these from a run's config.
    """

    watch = FaultWatch(dist.get_rank(), role="server")
    watch.run(_serve, settings, run_dir, like, emulation, gather_totals, watch)


def _serve(settings: ServerSettings, run_dir: str | Path | None, like: torch.optim.Optimizer, emulation: Emulation,
           gather_totals: bool, watch: FaultWatch) -> None:
    from distrain.runtime.checkpoint import CheckpointStore, finished_for

    transport = Transport(link_model=emulation.link_model)  # servers' links are emulated too
    state = None
    if run_dir is not None:
        store = CheckpointStore(run_dir, transport.rank, transport.world_size)
        resume = store.resolve(settings.resume)
        state = store.load(resume) if resume is not None else None
    if state is not None and finished_for(state, settings.epochs):
        return  # the workers found the run finished too, and leave before anything collective
    if settings.workers_per_node:  # the workers create their node groups: collective over the world
        node_process_groups(settings.run.workers, settings.workers_per_node, settings.run.timeout)
    emulation.start()
    start, cpu_start = time.perf_counter(), time.process_time()
    server = ShardServer(settings, transport, run_dir, like)
    server.started, server.cpu_started = start, cpu_start  # waiting for the workers' start counts too
    start_step = server.resume_step or 0  # wrap(): worker 0 sent the state to continue from
    if state is not None:
        server.load(state)
        server.earlier = RunTotals.from_state(state.get("totals"))
        start_step = int(state["step"])
    server.run(start_step, watch)
    control = server.control_transport()
    if gather_totals:  # the workers' final gather of counters (train.loop), as a row that trained no samples
        control.control_all_gather(torch.tensor(server.totals().row, dtype=torch.float64))
    control.control_barrier()
