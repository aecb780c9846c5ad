"""The worker side of the parameter servers: push gradient shards, pull parameter shards.

See :mod:`distrain.algorithms.parameter_server` for how the pieces fit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from distrain.algorithms.base import Algorithm, StepContext
from distrain.algorithms.hierarchical import NodeGroups
from distrain.algorithms.parameter_server.elastic import (
    came_to_start,
    return_link,
    server_life,
    servers_link,
    servers_taken_over,
    survivors_transport,
)
from distrain.algorithms.parameter_server.layout import (
    ShardLayout,
    assemble_range,
    gather_ranges,
    ranges_of,
    scatter_ranges,
    shard_bounds,
    shards_touched,
)
from distrain.algorithms.parameter_server.nodes import ElasticNode, NodeLoss
from distrain.algorithms.parameter_server.server_optim import momentum_corrected
from distrain.algorithms.parameter_server.settings import (
    NO_JOINS_IN_NODES,
    PSSettings,
    elastic_servers,
)
from distrain.algorithms.parameter_server.wire import (
    ANSWER_KEY,
    ASYNC_TAKEOVER_KEY,
    GIB,
    MAX_SHARD_BYTES,
    NO_REDO,
    NODE_ROW_KEY,
    STATE,
    STOP,
    TAKEN_OVER_KEY,
    TAKEOVER,
    TAKEOVER_KEY,
    TAKEOVER_STATE_KEY,
    recv_state,
    send_state,
)
from distrain.comm.store_group import StoreGroup
from distrain.comm.transport import Handle, Transport, blocked
from distrain.compress.base import CompressInfo
from distrain.compress.gradients import take_momentum
from distrain.compress.momentum_correction import MomentumCorrection
from distrain.compress.pushes import PushDecoder, ShardPush, send_message
from distrain.errors import ConfigError, WorkerFailure
from distrain.runtime.faults import inject_kill_in, is_comm_error, store_client
from distrain.runtime.health import LOST_CHECK_S, SilenceWatch, dead_since, declared_dead
from distrain.runtime.membership import (
    PREFIX,
    RESTARTS_KEY,
    LeftOut,
    LinkMissed,
    await_ready,
    meet_before_groups,
    wait_polling,
)

log = logging.getLogger(__name__)

#: How often a worker whose synchronous servers' answers are slow to come looks for a server
#: lost as it answered the step before (see :meth:`ParameterServer._offer_answers`).
ANSWER_POLL_S = 0.2


class ParameterServer(Algorithm):
    """The worker side: push gradient shards, pull parameter shards."""

    name = "ps"
    compresses = True
    rescales_lr = False  # the servers divide the survivors' gradients by --workers: already scaled
    settings: PSSettings

    def __init__(self, settings: PSSettings) -> None:
        super().__init__(settings, settings.compression)
        self._joining = False  # started again, it joins over a link of the servers (joiner_transport)

    @classmethod
    def survives(cls, settings: PSSettings) -> bool:
        return elastic_servers(settings)

    @property
    def asynchronous(self) -> bool:
        """``--ps-mode async``: the servers apply each push as it arrives."""
        return self.settings.ps_mode == "async"

    @property
    def common_steps(self) -> bool:
        return not self.asynchronous

    @property
    def stamps_heartbeat(self) -> bool:
        """Elastic servers have a worker stopped that they wait for while its heartbeat is stale
        (:class:`~distrain.runtime.health.SilenceWatch`): a hung one, whose connections stay open."""
        return super().stamps_heartbeat or elastic_servers(self.settings)

    def processes(self, workers: int) -> int:
        return workers + self.settings.servers

    def joiner_transport(self, joined: Any, link_model: Any = None) -> tuple[Transport, int]:
        """A worker started again talks to the servers over a link they open with it (nobody
        reopens the run's group), where it keeps its rank in the run; its rank among the
        training workers is its place in the members."""
        self._joining = True
        try:
            link = servers_link(joined, joined.me, joined.me, self.settings, link_model)
        except LinkMissed as exc:  # a server lost as it came: the servers took it for lost too
            raise LeftOut(f"worker {joined.me}: server(s) {[r - self.settings.run.workers for r in exc.ranks]} "
                          "lost as this worker joined; it leaves the run, the others go on") from exc
        return link, joined.members.index(joined.me)

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
        self._final_pulled = False  # asynchronous: the servers' final parameters arrived (end())
        #: asynchronous servers that admitted this worker after its loss: their clock for it minus its own
        self._offsets: dict[int, int] = {}
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
                compressor = MomentumCorrection(compressor.inner, self.momentum, masking=c.momentum_masking)
            self.push = ShardPush(compressor)
            self.density = c.warmup(compressor.ratio)
        #: the others take over a lost server's ranges (elastic, two servers or more); pulls then
        #: land in a second buffer, so a failed one leaves the last parameters whole
        self.takes_over = servers_taken_over(settings)
        #: compressed, where servers are taken over: this step's message per shard (a push to a
        #: server that holds pieces of several shards carries each), and decoders of those
        #: messages (a push redone on the servers that take over sends what they decode to)
        self._messages: list[Any] = []
        self._decoders: dict[int, PushDecoder] = {}
        self._takeovers = 0  # asynchronous: the run's takeovers applied here (their order is the store's)
        #: servers that returned after their loss, each reached over the link opened as it did
        self._server_links: dict[int, Transport] = {}
        #: servers lost (taken over) as this worker saw it, returned since or not (index -> Unix
        #: time); checkpoints carry it, and at the end the servers the store declared dead join it
        self.lost_servers: dict[int, float] = {}
        self._offered: set[str] = set()  # the lost servers' answers this worker offered (see _offer_answer)
        self.returned_servers: dict[int, float] = {}
        #: servers admitted back that were lost again before they met the others (when, Unix time)
        self.returns_missed: dict[int, float] = {}
        self._run_length = (0, 0)  # total steps and steps per epoch, for a server that returns
        self._spare = self.flat.clone() if self.takes_over else None
        #: the servers this worker waits for now, each since when (monotonic): one that stays silent
        #: through its heartbeat's staleness (hung) is stopped (:class:`SilenceWatch`), then taken
        #: over; a single server nobody can take over is lost, and the run stops in one line (it
        #: waited out --timeout for a hung one)
        self._awaited: dict[int, float] = {}
        self._silence = SilenceWatch(lambda: self._awaited, f"worker {transport.rank}").start() \
            if elastic_servers(settings) else None
        self._started = False  # the first worker started the servers (start())
        #: the processes that came to start (global ranks; :meth:`meet_to_start`): the first
        #: worker of them starts the servers (worker 0 where no worker was lost as the run started)
        self._came: list[int] = []  # set below
        self._loaded_servers: list[dict[str, Any]] | None = None  # load_server_state(): sent at the start
        # --workers-per-node: sum inside the node; only its leader talks to the servers
        k = settings.workers_per_node
        inject_kill_in("node-groups", transport.rank)  # fault injection for tests
        store = self._store_client() if k and elastic_servers(settings) else None  # None: node losses stop the run
        meet_before_groups(store, transport.rank, transport.world_size, settings.run.timeout, "its node groups", "nodes")
        # flat, elastic: who came, agreed with the servers (one lost as the run starts is lost before the first step)
        self._came = came_to_start(None if k or self._joining else self._store_client(), transport.rank, settings)
        if lost := [r for r in range(self.num_workers) if r not in self._came]:
            self._lost_checked = float("-inf")  # the first step's end records the loss (newly_lost)
            if transport.rank == min(self._came):
                log.warning("worker(s) %s lost as the run started; the servers serve the other %d", lost,
                            self.num_workers - len(lost))
        self.nodes = NodeGroups(transport, k, timeout=settings.run.timeout, workers=self.num_workers) if k else None
        self.pushes = self.nodes is None or self.nodes.is_leader
        #: elastic: the node's survivors meet again when one of them dies (see :mod:`.nodes`)
        self.node: ElasticNode | None = None
        if self.nodes is not None and store is not None:
            if store.check([RESTARTS_KEY]):
                raise ConfigError("--max-restarts", NO_JOINS_IN_NODES)
            self.node = ElasticNode(self.nodes, store, settings.run.timeout)

    def _push_info(self, ctx: StepContext) -> tuple[CompressInfo, bool]:
        """How this step's pushes are compressed (key 0; set per shard), and whether they are dense."""
        epochs_done = ctx.epoch * ctx.step / (ctx.step + 1)  # ctx.epoch counts the step being finished
        dense = self.density.dense(epochs_done)
        ratio = None if dense else self.compress_ratio(ctx)
        if not dense and (ratio is None or self.push.compressor.ratio is None):
            ratio = self.density.ratio(epochs_done)
        self.ratio = 1.0 if dense or ratio is None else ratio
        return CompressInfo(step=ctx.step, ratio=ratio, worker=self.transport.rank), dense

    def meet_to_start(self) -> bool:
        """A flat elastic run: the workers that came (:func:`~.elastic.came_to_start`, in
        :meth:`setup`) meet in the launcher's store, not in a barrier over every worker, which
        would fail on one lost as the run starts; one lost since is the servers' to find."""
        store = self._store_client() if self.nodes is None and elastic_servers(self.settings) else None
        if store is None or self._started:
            return False
        rank, workers = self.transport.rank, [r for r in self._came if r < self.num_workers]
        try:
            await_ready(dist.PrefixStore(f"{PREFIX}/groups/ps-start-meet", store), workers, rank,
                        self.settings.run.timeout, lambda r: declared_dead(store, r),
                        f"worker {rank}: the workers did not start training")
        except LinkMissed:
            pass
        return True

    def start(self, total_steps: int, steps_per_epoch: int) -> None:
        """The first worker that came (worker 0 unless it was lost as the run started) tells every
        server its shard size and the run length, and sends the start values (and the optimizer
        state to start from, after :meth:`load_server_state`)."""
        self._run_length = (total_steps, steps_per_epoch)
        if self._started:  # a worker that joined a running job (:meth:`join`)
            return
        self._started = True
        if self.transport.rank != min(self._came):
            return
        self.flat.copy_(torch.cat([p.detach().reshape(-1) for p in self.params]))  # after any resume
        handles: list[Handle] = []
        loaded = self._loaded_servers
        for s, server in enumerate(self.servers):
            if server not in self._came:  # lost as the run started: the first push to it finds it lost
                continue
            handles += self._send_start(self.transport, s, follows=loaded is not None)
            if loaded is not None:
                for h in handles:
                    h.wait()
                handles = []
                send_state(self.transport, loaded[s], server)
        for h in handles:
            h.wait()

    def _send_start(self, transport: Transport, s: int, follows: bool) -> list[Handle]:
        """Server ``s``'s start message (what :class:`ShardServer` reads first): ``[shard numel,
        total steps, steps per epoch]``, its shard of :attr:`flat`, and whether an optimizer state
        follows."""
        (lo, hi), (total, per_epoch), server = self.bounds[s], self._run_length, self.servers[s]
        return [transport.send(torch.tensor([hi - lo, total, per_epoch], dtype=torch.int64), server),
                transport.send(self.flat[lo:hi].contiguous(), server),
                transport.send(torch.tensor([int(follows)], dtype=torch.int64), server)]

    def _flat_to_params(self) -> None:
        """Copy :attr:`flat` into the model's parameters."""
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(self.flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

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
        if self.asynchronous and self.layout.live() != list(range(len(self.servers))):
            raise WorkerFailure("the asynchronous servers took over a lost server's parameters: their state no "
                                "longer matches the run's shards, so it cannot be saved for a resume")
        asking = torch.tensor([STATE, 0], dtype=torch.int64)
        states = {}
        for s in self.layout.live():
            self._to(s).send(asking, self.servers[s]).wait()
            states[s] = recv_state(self._to(s), self.servers[s])
        if len(states) == len(self.servers) and not any(TAKEOVER_STATE_KEY in state for state in states.values()):
            return [states[s] for s in range(len(self.servers))]
        return self._shard_states(states)

    def _shard_states(self, held: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
        """Every server's state as if each held its own shard (what :meth:`load_server_state` of
        a run with all its servers takes), from the live servers' ``held`` while a takeover is in
        force: each shard's per-element optimizer state put together from the parts the servers
        hold (:func:`~.layout.assemble_range`); the steps served and the hyperparameters are the
        first live server's."""
        first = held[min(held)]
        parts = [(ranges_of(state[TAKEOVER_STATE_KEY]["ranges"]), state[TAKEOVER_STATE_KEY]["state"])
                 for state in held.values()]
        states = []
        for bounds in self.bounds:
            _, state = assemble_range([(ranges, gather_ranges(self.flat, ranges), part) for ranges, part in parts],
                                      bounds)
            optimizer = {"state": {0: state} if state else {}, "param_groups": first["optimizer"]["param_groups"]}
            states.append({**{k: v for k, v in first.items() if k not in ("optimizer", TAKEOVER_STATE_KEY)},
                           "optimizer": optimizer})
        return states

    def _to(self, s: int) -> Transport:
        """The transport to server ``s``: the run's, or the link opened when it returned."""
        return self._server_links.get(s, self.transport)

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
        if self.node is not None:
            self._node_step(info, dense)
            self._flat_to_params()
            return
        intra = self.nodes.intra if self.nodes is not None and self.nodes.intra.world_size > 1 else None
        if intra is not None:
            intra.reduce(self.grad, dst=0).wait()  # the leader holds the node's sum
        if self.pushes:
            self._push_pull(info, dense)
        if intra is not None:
            intra.broadcast(self.flat, src=0).wait()
        if self.nodes is not None:
            self.nodes.fold_stats()
        self._flat_to_params()

    def _node_step(self, info: CompressInfo | None, dense: bool) -> None:
        """The step of a node whose workers may die (elastic, ``--workers-per-node``): the node's
        sum into its leader, the leader's push and pull, the parameters handed on. When a worker
        of the node dies on the way, the survivors meet again (:meth:`ElasticNode.regroup`) and
        take the newest parameters one of them holds (:meth:`ElasticNode.recover`): this step's,
        and it is done; or the step before, and each survivor sums its own gradient again and the
        leader, the node's new one if the old one was lost, pushes it (the servers answer a round
        the old one had pushed without applying it again)."""
        node = self.node
        assert node is not None
        own = self.grad.clone()  # a reduce leaves scratch in the others' copies
        held = self.clock - 1  # the step whose parameters this worker holds
        regrouped = False
        while True:
            try:
                if regrouped:
                    regrouped, held = False, node.recover(held, self.flat)
                    if held == self.clock:
                        break
                    if held != self.clock - 1:
                        raise WorkerFailure(f"worker {node.me}: at step {self.clock}, its node's newest parameters "
                                            f"are of step {held}")
                    self.grad.copy_(own)
                if held < self.clock:
                    node.reduce(self.grad)
                    if node.is_leader:
                        self._push_pull(info, dense)
                        held = self.clock
                inject_kill_in("node-broadcast", node.me)  # fault injection for tests
                node.broadcast(self.flat)
                break
            except NodeLoss:
                node.regroup()
                if node.is_leader and not self.pushes and self.takes_over:
                    self._follow_takeovers()
                self.pushes, regrouped = node.is_leader, True
        node.fold_stats()

    def _push_pull(self, info: CompressInfo | None, dense: bool) -> None:
        """Send every server its gradient shard (with this step's clock and learning rate);
        receive its parameters."""
        assert self.optimizer is not None
        self._clock_header[0] = self.clock
        self._clock_header[1:] = torch.tensor([float(self.optimizer.param_groups[0]["lr"])], dtype=torch.float64).view(torch.int64)
        if self.takes_over:
            if self.push is not None and info is not None:  # one message per shard, its residual keyed by it
                self._messages = []
                for shard, (lo, hi) in enumerate(self.bounds):
                    info.key = shard
                    self._messages.append(self.push.encode(self.grad[lo:hi], info, dense=dense))
            self._push_pull_elastic()
            return
        handles: list[Handle] = []
        for shard, (server, (lo, hi)) in enumerate(zip(self.servers, self.bounds, strict=True)):
            handles.append(self.transport.send(self._header(shard), server))
            if self.push is None or info is None:
                handles.append(self.transport.send(self.grad[lo:hi], server))
            else:
                info.key = shard
                handles += send_message(self.transport, self.push.encode(self.grad[lo:hi], info, dense=dense), server)
            handles.append(self.transport.recv(self.flat[lo:hi], server))
        with self._waiting_for(self.servers):
            for h in handles:
                h.wait()

    @contextmanager
    def _waiting_for(self, servers: Iterable[int]) -> Iterator[None]:
        """Marks ``servers`` (global ranks) waited for from now on, for the silence watch."""
        self._awaited = dict.fromkeys(servers, time.monotonic())
        try:
            yield
        finally:
            self._awaited = {}

    def _header(self, s: int) -> torch.Tensor:
        """This push's header for server ``s``: the clock and learning rate; a worker that joined
        asynchronous servers sends each its own clock for it (:attr:`_offsets`)."""
        if not self._offsets.get(s):
            return self._clock_header
        header = self._clock_header.clone()
        header[0] += self._offsets[s]
        return header

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
            to = self._to(s)
            try:  # a connection already closed fails here, not at the wait
                pending[s] = (into, [to.send(self._header(s), server), *self._send_push(to, ranges, server),
                                     to.recv(into, server)])
            except Exception as exc:
                if not is_comm_error(exc):
                    raise
                lost.append((s, exc))
        def wait_all() -> None:
            for s, (_, handles) in pending.items():
                try:
                    for h in handles:
                        h.wait()
                except Exception as exc:
                    if not is_comm_error(exc):
                        raise
                    lost.append((s, exc))

        with self._waiting_for(self.servers[s] for s in pending):
            if self.asynchronous or len(pending) < 2 or self._store_client() is None:
                wait_all()
            else:  # the live servers may wait for workers that wait for this one (see _offer_answers)
                with blocked():
                    wait_polling(wait_all, self._offer_answers, ANSWER_POLL_S)
        for s, (into, _) in pending.items():
            if s not in dict(lost) and len(self.layout.owned[s]) > 1:
                scatter_ranges(self._spare, self.layout.owned[s], into)
        if not lost:
            self.flat, self._spare = self._spare, self.flat
            return
        for s in pending:  # the live servers' answers; the lost ones' ranges keep the last parameters
            if s not in dict(lost):
                scatter_ranges(self.flat, self.layout.owned[s], gather_ranges(self._spare, self.layout.owned[s]))
        if self.asynchronous:
            self._take_over_async(dict(lost))
        else:
            for s, exc in lost:
                self._take_over(s, exc)
        self._spare.copy_(self.flat)

    def _send_push(self, to: Transport, ranges: list[tuple[int, int]], server: int) -> list[Handle]:
        """Start sending ``server`` this step's push of ``ranges``: their gradient, or
        (compressed) the message of each shard they lie in (:meth:`ShardServer._recv_push`)."""
        if self.push is None:
            return [to.send(gather_ranges(self.grad, ranges), server)]
        return [h for k in shards_touched(self.bounds, ranges) for h in send_message(to, self._messages[k], server)]

    def _pushed(self) -> torch.Tensor:
        """What this step's pushes carry, as one flat vector: the gradient, or (compressed) what
        each shard's message decodes to, what its server would have summed. A push redone on the
        servers that take a lost one over sends this, so the error feedback, which counted it
        sent, neither loses nor repeats any of it."""
        if self.push is None:
            return self.grad
        pushed = torch.empty_like(self.grad)
        for k, (lo, hi) in enumerate(self.bounds):
            if k not in self._decoders:
                self._decoders[k] = PushDecoder.of(self.settings.compression.spec, hi - lo, self.settings.run.seed)
            pushed[lo:hi] = self._decoders[k].decode(self._messages[k])
        return pushed

    def _take_over(self, s: int, exc: BaseException) -> None:
        """Server ``s`` is lost while this step's pushes were out (its connection reset): once it
        is declared dead, the workers agree (:meth:`_agree`) and send every live server a
        takeover: the servers split its ranges between them (:class:`ShardLayout`), start them
        from the parameters of the last step it answered (from one worker) with fresh optimizer
        state, redo this step on them with every live worker's gradient, and answer the new
        parameters. No step is lost or applied twice."""
        store = self._await_dead(s, exc)
        leader = self._agree(store, s)
        if leader is None:  # it answered others this step: its answer taken from them, all take it over next step
            return
        gained = self.layout.take_over(s)
        self.lost_servers[s] = time.time()
        self._server_links.pop(s, None)
        me, numel = self.transport.rank, self.flat.numel()
        log.warning("worker %d: lost server %d at step %d; servers %s take over its parameters", me, s, self.clock,
                    [t for t, pieces in gained.items() if pieces])
        message = torch.tensor([s, leader, self.clock, numel], dtype=torch.int64)
        self._send_takeover(gained, lambda t: message, values=me == leader, redo=True)

    def _send_takeover(self, gained: dict[int, list[tuple[int, int]]], message: Any, values: bool,
                       redo: bool) -> None:
        """Announce a takeover to every live server (``gained``: the pieces each gains): a
        :data:`TAKEOVER` header and ``message(t)``, server ``t``'s fields; to a server that gains
        pieces, with ``values`` this worker's copy of them, with ``redo`` this step's gradient of
        them, and then receive their parameters after it."""
        handles: list[Handle] = []
        answers: dict[int, torch.Tensor] = {}
        pushed = self._pushed() if redo else None
        for t, pieces in gained.items():
            server, to = self.servers[t], self._to(t)
            header = self._header(t).clone()
            header[0] = TAKEOVER
            handles += [to.send(header, server), to.send(message(t), server)]
            if not pieces:
                continue
            if values:
                handles.append(to.send(gather_ranges(self.flat, pieces).contiguous(), server))
            if pushed is not None:
                handles.append(to.send(gather_ranges(pushed, pieces).contiguous(), server))
                answers[t] = torch.empty(sum(hi - lo for lo, hi in pieces))
                handles.append(to.recv(answers[t], server))
        for h in handles:
            h.wait()
        for t, copy in answers.items():
            scatter_ranges(self.flat, gained[t], copy)

    def _await_dead(self, s: int, exc: BaseException) -> Any:
        """Wait until server ``s``, whose exchange failed with ``exc``, is declared dead in the
        rendezvous store (the launcher declares a process that exited), at most ``--timeout``
        seconds (``exc`` is raised then, or at once without a store). Returns the store."""
        store = self._store_client()
        deadline = time.monotonic() + self.settings.run.timeout
        while store is None or not declared_dead(store, self.servers[s]):
            if store is None or time.monotonic() > deadline:
                raise exc
            time.sleep(0.02)
        return store

    def _take_over_async(self, failed: dict[int, BaseException]) -> None:
        """Asynchronous servers ``failed`` (index -> the error of this step's exchange) are lost:
        no step is common to the workers, so each takes over on its own. Once a server is
        declared dead, its place in the run's order of takeovers is settled in the store (the
        first worker to report it appends it; a lost server does not return in async runs), and
        every worker applies the takeovers in that order (:meth:`_announce`), so that the
        workers' and servers' layouts agree. This step's push to a failed server is redone on
        the servers that take its ranges over."""
        store = None
        for s, exc in failed.items():
            store = self._await_dead(s, exc)
        order = {s: self._takeover_place(store, s) for s in failed}
        while self._takeovers <= max(order.values()):
            n = self._takeovers
            lost = int(store.get(ASYNC_TAKEOVER_KEY.format(n)).decode())
            if lost not in self.layout.live():
                raise WorkerFailure(f"worker {self.transport.rank}: takeover {n} of server {lost}, which it "
                                    "does not push to")
            self._announce(lost, n, redo=lost in failed)
            self._takeovers += 1

    @staticmethod
    def _takeover_place(store: Any, s: int) -> int:
        """Server ``s``'s place in the run's order of asynchronous takeovers, appended by the
        first worker that asks (one atomic compare-and-set per place)."""
        n = 0
        while True:
            got = store.compare_set(ASYNC_TAKEOVER_KEY.format(n), "", str(s))
            if (got.decode() if isinstance(got, bytes) else str(got)) == str(s):
                return n
            n += 1

    def _announce(self, lost: int, n: int, redo: bool) -> None:
        """Takeover ``n``, of asynchronous server ``lost``: tell every live server, send those
        that take its ranges over this worker's copy of their pieces (the first copy to reach a
        server starts them, with a fresh optimizer state) and, with ``redo``, this step's
        gradient of the pieces, pushed again; receive their parameters after it. A server holds
        that answer back as it holds pushes (``--max-staleness``, counted on the pieces), so with
        ``--max-staleness 0`` every worker gets the pieces after every worker's push redone."""
        gained = self.layout.take_over(lost)
        self.lost_servers[lost] = time.time()
        log.warning("worker %d: lost server %d at its push %d; servers %s take over its parameters",
                    self.transport.rank, lost, self.clock, [t for t, pieces in gained.items() if pieces])
        self._send_takeover(gained, lambda t: torch.tensor([lost, n, int(self._header(t)[0]) if redo else NO_REDO,
                                                            self.flat.numel()], dtype=torch.int64),
                            values=True, redo=redo)

    def _agree(self, store: Any, s: int) -> int | None:
        """The live workers agree on taking over server ``s`` at this step: each registers its
        step, and all must have found the loss at the same one. A server that died as it
        answered a step, to some workers only, is found lost at that step by the others and at
        the next by those it answered; these offer its answer in the store (:meth:`_offer_answer`),
        and those behind take it (None is returned), push the next step, and find the loss again
        there with the others. Returns the worker that sends the parameters (the first live one)."""
        me, life = self.transport.rank, self._life(store, s)
        store.set(TAKEOVER_KEY.format(life, me), str(self.clock))
        answer = ANSWER_KEY.format(life, self.clock)
        deadline = time.monotonic() + self.settings.run.timeout
        while True:
            if store.check([answer]):
                self._take_answer(store, s, answer)
                return None
            live = self._live_pushers(store)
            seen = {w: int(store.get(TAKEOVER_KEY.format(life, w)).decode()) for w in live
                    if store.check([TAKEOVER_KEY.format(life, w)])}
            if self.clock - 1 in seen.values():  # they are behind (see above)
                self._offer_answer(store, s)
            if len(seen) == len(live) and set(seen.values()) == {self.clock}:
                return live[0]
            if not set(seen.values()) <= {self.clock - 1, self.clock, self.clock + 1}:
                raise WorkerFailure(f"worker {me}: lost server {s} at step {self.clock}, the others at steps {seen}")
            if time.monotonic() > deadline:
                raise WorkerFailure(f"worker {me}: lost server {s} at step {self.clock}; workers "
                                    f"{sorted(w for w in live if seen.get(w) != self.clock)} never reported it there")
            time.sleep(0.02)

    def _live_pushers(self, store: Any) -> list[int]:
        """The workers that push to the servers, not declared dead: every worker, or with
        ``--workers-per-node`` each node's lowest live one, its leader (the servers' rule,
        :meth:`ShardServer._succeed`)."""
        live = [w for w in range(self.num_workers) if not declared_dead(store, w)]
        if self.nodes is None:
            return live
        nodes = self.nodes.map
        return [w for w in live if min(m for m in live if nodes.node_of(m) == nodes.node_of(w)) == w]

    def _follow_takeovers(self) -> None:
        """A worker that leads its node now (its leader was lost) pushes to the servers as they
        are: the servers' takeovers it did not push (their marks in the store, in the servers'
        order) change its layout as they changed the leader's."""
        store, taken = self._store_client(), []
        for s in self.layout.live():  # (a live server's life names no takeover)
            if store.check([key := TAKEN_OVER_KEY.format(self._life(store, s))]):
                taken.append((int(store.get(key).decode()), s))
        for _, s in sorted(taken):
            gained = self.layout.take_over(s)
            self.lost_servers.setdefault(s, time.time())
            self._server_links.pop(s, None)
            log.warning("worker %d: leads its node now; server %d was lost, servers %s hold its parameters",
                        self.transport.rank, s, [t for t, pieces in gained.items() if pieces])

    def _life(self, store: Any, s: int) -> str:
        """Which death of server ``s`` (see :func:`server_life`)."""
        return server_life(store, s, self.servers[s])

    def _offer_answers(self, _waited: float) -> None:
        """While a synchronous step's answers are slow to come: a server declared dead may have
        died as it answered the step before, to this worker and not to others. Those wait for
        its answer (:meth:`_agree`) before they push this step, and the live servers wait for
        their push before they answer this one: offer it (:meth:`_offer_answer`)."""
        store = self._store_client()
        for s in self.layout.live():
            if declared_dead(store, self.servers[s]):
                self._offer_answer(store, s)

    def _offer_answer(self, store: Any, s: int) -> None:
        """Offer, in the store, this worker's copy of server ``s``'s ranges: its answer of the step
        before this one (the first offer stands; they are all the same)."""
        key = ANSWER_KEY.format(self._life(store, s), self.clock - 1)
        if key in self._offered:
            return
        self._offered.add(key)
        values = gather_ranges(self.flat, self.layout.owned[s]).contiguous().cpu()
        store.compare_set(key, "", values.view(torch.uint8).numpy().tobytes())

    def _take_answer(self, store: Any, s: int, key: str) -> None:
        """Take server ``s``'s answer of this step from the worker that offered it (see :meth:`_agree`)."""
        owned = self.layout.owned[s]
        values = torch.frombuffer(bytearray(store.get(key)), dtype=torch.uint8).view(self.flat.dtype)
        if values.numel() != sum(hi - lo for lo, hi in owned):
            raise WorkerFailure(f"worker {self.transport.rank}: server {s}'s answer offered with {values.numel()} "
                                f"values, its ranges {owned} hold {sum(hi - lo for lo, hi in owned)}")
        scatter_ranges(self.flat, owned, values.to(self.flat.device))
        log.warning("worker %d: server %d was lost as it answered step %d; its answer taken from a worker it reached",
                    self.transport.rank, s, self.clock)

    def server_back(self, server: int, membership: Any, members: list[int]) -> None:
        """Server ``server`` (its rank in the run) was started again after its loss, and the
        workers and servers admitted it back after this step (``members``: the workers then):
        open the link with it (:func:`~distrain.algorithms.parameter_server.elastic.return_link`);
        the first member sends it the parameters of its range, which every worker holds from
        this step's pull (the servers that took it over send their optimizer state), and from
        the next step on every worker pushes that range to it again."""
        s = server - self.num_workers
        if s in self.layout.live():
            raise WorkerFailure(f"worker {self.transport.rank}: server {s} returned, but it was never taken over here")
        ranks = [*members, *(self.servers[t] for t in self.layout.live()), server]
        try:
            link, _ = return_link(membership, server, ranks, self.transport.rank, self.settings,
                                  self.transport.link_model)
        except LinkMissed as exc:
            if exc.ranks != [server]:
                raise
            log.warning("worker %d: server %d was lost again as it returned after step %d; the others keep its "
                        "parameters", self.transport.rank, s, self.clock)
            self.returns_missed[s] = time.time()
            return
        if self.transport.rank == ranks[0]:
            for h in self._send_start(link, s, follows=False):
                h.wait()
        self.layout.give_back(s)
        self._server_links[s] = link
        self.returned_servers[s] = time.time()
        log.warning("worker %d: server %d returned after step %d; it serves its parameters again", self.transport.rank,
                    s, self.clock)

    def join(self) -> int:
        """This worker was started again and the servers admitted it (its transport is their
        link, :func:`servers_link`, over the live servers): take every live server's parameters
        of the step after which they admitted it, with the ranges it owns when a takeover is in
        force, and that step (returned), where this worker's clock goes on from. The servers hold
        the optimizer state; a worker keeps none of its own but its error-feedback residuals (and
        momentum, under momentum correction), which start again from zero."""
        me, steps, owned = self.transport.rank, {}, {}
        for server in [r for r in self.transport.ranks if r != me]:  # type: ignore[attr-defined]
            s = server - self.num_workers
            steps[s], owned[s] = self._recv_holding(self.transport, s)
        if self.asynchronous:  # each server's clock for it: its slowest pusher's, which may differ by one
            if max(steps.values()) - min(steps.values()) > 1:
                raise WorkerFailure(f"worker {me}: the servers admitted it at clocks {steps}, more than one apart")
            self.clock = max(steps.values())
            self._offsets = {s: step - self.clock for s, step in steps.items()}
        elif len(set(steps.values())) != 1:
            raise WorkerFailure(f"worker {me}: the servers admitted it after different steps {sorted(set(steps.values()))}")
        else:
            self.clock = next(iter(steps.values()))
        self.layout.owned = owned
        if self.asynchronous and self.takes_over:  # the takeovers so far, which the servers' ranges show
            store = self._store_client()
            while store.check([ASYNC_TAKEOVER_KEY.format(self._takeovers)]):
                self._takeovers += 1
        if sum(self.layout.numel(s) for s in owned) != self.flat.numel():
            raise WorkerFailure(f"worker {me}: the live servers' ranges {owned} do not cover the {self.flat.numel()} "
                                "parameters")
        if not self.layout.whole():
            log.info("worker %d: joined while servers %s hold a lost server's parameters", me, sorted(owned))
        self._flat_to_params()
        self._started = True
        self.rejoined.add(me)
        self._known_lost = set(range(self.num_workers)) - set(self.live_workers())  # lost before it joined
        if self._spare is not None:
            self._spare.copy_(self.flat)
        return self.clock

    def _recv_holding(self, transport: Transport, s: int) -> tuple[int, list[tuple[int, int]]]:
        """Server ``s``'s parameters as it sends them to a joiner or at the end
        (:meth:`ShardServer._holding_message`): ``[step, numel, k]``, the ``k`` ranges it holds (0:
        its own shard), their values, written into :attr:`flat`. Returns the step and the ranges."""
        header = torch.zeros(3, dtype=torch.int64)
        server = self.servers[s]
        transport.recv(header, server).wait()
        step, numel, k = (int(v) for v in header.tolist())
        ranges = [self.bounds[s]]
        if k:
            table = torch.zeros(k, 2, dtype=torch.int64)
            transport.recv(table, server).wait()
            ranges = [(int(lo), int(hi)) for lo, hi in table.tolist()]
        if numel != sum(hi - lo for lo, hi in ranges) or not all(0 <= lo < hi <= self.flat.numel() for lo, hi in ranges):
            raise WorkerFailure(f"worker {self.transport.rank}: server {s} announced {numel} parameters for its "
                                f"ranges {ranges}")
        values = torch.empty(numel)
        transport.recv(values, server).wait()
        scatter_ranges(self.flat, ranges, values)
        return step, ranges

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
        """Tell every server this worker's training is over (they serve until every worker has).
        Asynchronous servers then answer every worker with their final parameters, once every
        worker has ended: the workers stopped at different pulls, and each ends with the model
        every push went into (a node's leader hands it on inside the node)."""
        if self._ended or self._final_pulled:
            return
        self._ended = True
        stop = torch.tensor([STOP, 0], dtype=torch.int64)
        if self.pushes:
            if self.asynchronous:
                self._final_parameters(stop)
            else:
                self._send_stop(stop)
        if self.node is not None:  # its node's workers wait for one another (see ElasticNode.end)
            self.node.end(self.clock, self.flat, lambda: self._send_stop_for_lost_leader(stop))
        if self.asynchronous:
            self._final_pulled = True
            intra = self.nodes.intra if self.nodes is not None and self.nodes.intra.world_size > 1 else None
            if intra is not None:
                intra.broadcast(self.flat, src=0).wait()
            self._flat_to_params()

    def _send_stop(self, stop: torch.Tensor) -> None:
        """Tell every live synchronous server that this worker's (or its node's) training is over."""
        for i, s in enumerate(self.layout.live()):
            self._to(s).send(stop, self.servers[s]).wait()
            if i == 0:
                inject_kill_in("node-stop", self.transport.rank)  # fault injection for tests

    def _send_stop_for_lost_leader(self, stop: torch.Tensor) -> None:
        """Its node's leader was lost after the last step, maybe before it told every server that
        the node's training is over, and this worker leads the node now: tell each server that
        did not hear it from the leader, once it took this worker for the node's pusher (a STOP
        it does not expect would never be received)."""
        assert self.node is not None
        if self.takes_over:
            self._follow_takeovers()
        store, me, deadline = self._store_client(), self.node.me, time.monotonic() + self.settings.run.timeout
        for s in self.layout.live():
            key = NODE_ROW_KEY.format(s, self.node.node)
            while (said := store.get(key).decode() if store.check([key]) else None) not in ("stop", str(me)):
                if time.monotonic() > deadline:
                    raise WorkerFailure(f"worker {me}: server {s} neither heard the end of node {self.node.node}'s "
                                        f"training from its lost leader nor took this worker for it within "
                                        f"{self.settings.run.timeout:g} s")
                time.sleep(0.02)
            if said == str(me):
                self._to(s).send(stop, self.servers[s]).wait()

    def _final_parameters(self, stop: torch.Tensor) -> None:
        """Asynchronous: send every live server ``stop`` and receive its final parameters with the
        ranges it holds (:meth:`_recv_holding`), so that pieces of a lost server it took over reach
        a worker that ended before it saw the loss. Where servers may be taken over, one lost on the way (declared dead) is passed
        over; ranges nobody took over keep this worker's last pull of them (logged)."""
        dead: dict[int, BaseException] = {}
        for s in self.layout.live():  # every server first: each answers once every worker ended on all
            try:
                self._to(s).send(stop, self.servers[s]).wait()
            except Exception as exc:
                if not (self.takes_over and is_comm_error(exc)):
                    raise
                dead[s] = exc
        covered = 0
        for s in [s for s in self.layout.live() if s not in dead]:
            try:
                _, ranges = self._recv_holding(self._to(s), s)
            except Exception as exc:
                if not (self.takes_over and is_comm_error(exc)):
                    raise
                dead[s] = exc
                continue
            covered += sum(hi - lo for lo, hi in ranges)
        for s, exc in dead.items():
            self._await_dead(s, exc)
            self.lost_servers.setdefault(s, time.time())
        if covered != self.flat.numel():
            log.warning("worker %d: servers %s were lost after its last push, before any worker took their "
                        "parameters over; it ends on its own last pull of them", self.transport.rank, sorted(dead))

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
            # every server lost on the way, returned or not (when this worker took it over)
            self.lost_servers = {**{r - self.num_workers: t for r, t in lost.items() if r >= self.num_workers},
                                 **self.lost_servers}
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
        new = {r: t for r in range(self.num_workers)
               if r not in self._known_lost and (t := dead_since(store, r)) is not None}
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

    def resume_at(self, step: int) -> None:
        if self.asynchronous:  # the servers' clock for every worker of a set is the set's step
            self.clock, self._offsets = step, {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.clock = int(state.get("clock", 0))
        if self.push is not None and "compressor" in state:
            self.push.compressor.load_state_dict(state["compressor"])

    def close(self) -> None:
        if getattr(self, "_silence", None) is not None:  # (set up)
            self._silence.close()
        if self.nodes is not None:
            self.nodes.close()
        if self.node is not None:
            self.node.fold_stats()
