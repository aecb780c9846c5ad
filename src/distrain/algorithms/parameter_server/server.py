"""The server side: one process owns a shard of the parameters and its optimizer state.

See :mod:`distrain.algorithms.parameter_server` for how the pieces fit.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from distrain.algorithms.hierarchical import node_process_groups
from distrain.algorithms.parameter_server.elastic import (
    admissions,
    came_to_start,
    return_link,
    server_life,
    servers_link,
    servers_return,
    survivors_transport,
)
from distrain.algorithms.parameter_server.layout import (
    ShardLayout,
    assemble_range,
    positions,
    ranges_of,
    shard_bounds,
    shard_of,
    shards_touched,
)
from distrain.algorithms.parameter_server.server_optim import (
    RoundMomentumSGD,
    follow_pushers,
    merged_optimizer,
    momentum_corrected,
    optimizer_settings,
    server_optimizer,
    shrunk_optimizer,
    sliced_state,
)
from distrain.algorithms.parameter_server.settings import ServerSettings, elastic_servers
from distrain.algorithms.parameter_server.wire import (
    HEADER,
    NO_REDO,
    NODE_ROW_KEY,
    STATE,
    STOP,
    TAKEN_OVER_KEY,
    TAKEOVER,
    TAKEOVER_FIELDS,
    TAKEOVER_STATE_KEY,
    check_start_header,
    physical_memory,
    recv_state,
    send_state,
)
from distrain.comm.store_group import StoreGroup
from distrain.comm.transport import Handle, Transport, blocked
from distrain.compress.pushes import PushDecoder
from distrain.errors import WorkerFailure
from distrain.runtime.faults import (
    FaultWatch,
    inject_kill_in,
    injected_answers,
    is_comm_error,
    kill_now,
    maybe_injected_kill,
    store_client,
)
from distrain.runtime.health import SilenceWatch, declare_dead, declared_dead
from distrain.runtime.membership import (
    SERVERS_RETURN_KEY,
    LinkMissed,
    Membership,
    RunEnded,
    meet_before_groups,
)
from distrain.runtime.totals import RunTotals
from distrain.topology import NodeMap

if TYPE_CHECKING:
    from distrain.emulation import Emulation


log = logging.getLogger(__name__)

#: How often an asynchronous server looks in the store for workers asking to join (seconds).
JOIN_POLL_S = 0.1
#: The optimizer state of a shard put together from several servers' files (:func:`saved_server_state`).
SHARD_STATE_KEY = "shard_state"
#: What an exchange with a pusher returns when its worker was lost and its node's next worker
#: leads it now (:meth:`ShardServer._with_worker`, hierarchical).
SUCCEEDED = object()


class ShardServer:
    """One server process: owns a shard of the parameters and its optimizer state.

    Args:
        settings: what the server runs with (workers, servers, mode, compression, checkpoints).
        transport: this server's transport over the world.
        run_dir: where it saves its checkpoints; None: it saves none (``wrap()``, whose user
            saves the workers' state).
        like: the workers' optimizer, whose class and hyperparameters the server steps its shard
            with (:func:`server_optimizer`).
        source: the worker that sends the start header and the shard (worker 0 at the start; the
            first member when a lost server returns, :func:`serve_again`).
    """

    def __init__(self, settings: ServerSettings, transport: Transport, run_dir: str | Path | None,
                 like: torch.optim.Optimizer, source: int = 0) -> None:
        self.settings = settings
        self.transport = transport
        self.run_dir = Path(run_dir) if run_dir is not None else None
        #: the workers this server waits for now, each since when (monotonic): a worker that
        #: stays silent through its heartbeat's staleness is stopped (:class:`SilenceWatch`)
        self._awaited: dict[int, float] = {}
        self.num_workers = settings.run.workers
        self.index = transport.rank - self.num_workers
        k = settings.workers_per_node  # hierarchical: only node leaders push, each its node's sum
        self.nodes = NodeMap(self.num_workers, k) if k else None
        self.pushers = self.nodes.leaders if self.nodes is not None else list(range(self.num_workers))
        #: hierarchical, elastic: rows whose node's leader was lost and whose new leader has not
        #: pushed a round since (it may push again the round the old one pushed: see _row_header)
        self._succeeded: set[int] = set()
        self.lost_pushers: list[int] = []  # workers lost during the run (elastic runs)
        header = torch.zeros(HEADER, dtype=torch.int64)
        transport.recv(header, source).wait()
        try:
            numel, self.total_steps, self.steps_per_epoch = check_start_header(header.tolist(), len(self.pushers),
                                                                                physical_memory())
        except WorkerFailure as exc:
            raise WorkerFailure(f"server {self.index}: {exc} (from worker {source})") from None
        self.shard = torch.nn.Parameter(torch.empty(numel))
        transport.recv(self.shard.data, source).wait()
        follows = torch.zeros(1, dtype=torch.int64)
        transport.recv(follows, source).wait()  # 1: worker 0 sends the optimizer state to resume from
        loaded = recv_state(transport, source) if int(follows) == 1 else None
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
        if self.joins is not None and servers_return(settings):  # the launcher may start a lost server again
            self.joins.store.set(SERVERS_RETURN_KEY, "1")
        self.layout: ShardLayout | None = None  # every server's ranges, from the first takeover on
        # Asynchronous takeovers: each one's lost server and the pieces this server gained (in the
        # run's order of takeovers), the pieces taken over so far, and how many takeovers each
        # pusher announced (its pushes and pulls cover this server's shard and those pieces).
        self._like = like
        self._gains: list[tuple[int, list[tuple[int, int]]]] = []
        self._gain_lock = threading.Lock()  # the inbox threads learn the pieces' sizes
        self._pieces: dict[int, Piece] = {}
        self.versions = [0] * len(self.pushers)
        self._weights = [1.0] * len(self.pushers)  # each pusher's last push's staleness weight
        self._held: list[tuple[int, int, int]] = []  # takeover answers held back: (row, takeover, push)
        self._proposed = False  # this server proposed the step every worker stops at (SIGTERM)
        c = settings.compression
        self.decoder = PushDecoder.of(c.spec, numel, settings.run.seed) if c.enabled else None
        #: compressed pushes after a takeover: a decoder per shard of the run's layout (its size)
        self._decoders: dict[int, PushDecoder] = {}
        self.started, self.cpu_started = time.perf_counter(), time.process_time()
        self.earlier = RunTotals()  # what the earlier segments of a resumed run did

    def optimizer_state(self) -> dict[str, Any]:
        """This server's optimizer state, update count, the steps it served and each pusher's
        last clock (what ``wrap()``'s ``state_dict()`` holds)."""
        clocks = list(self.clocks) if self.settings.ps_mode == "async" else [self.steps] * len(self.pushers)
        return {"optimizer": self.optimizer.state_dict(), "updates": self.updates, "steps": self.steps,
                "clocks": clocks, **self._takeover_state()}

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

    def _recv_push(self, out: torch.Tensor, worker: int, transport: Transport | None = None,
                   ranges: list[tuple[int, int]] | None = None) -> Handle | None:
        """Receive ``worker``'s gradient push into ``out``: a handle to wait for when dense, else
        decoded here (a compressed push's size is known only once its header arrived).
        ``ranges``: the ranges of the parameters the push covers, in order (:meth:`push_ranges`;
        None: this server's own shard)."""
        transport = transport or self.transport
        if self.decoder is None:
            return transport.recv(out, worker)
        if ranges is None:
            out.copy_(self.decoder.recv(transport, worker))
            return None
        # After a takeover: one message per shard the ranges lie in, compressed over that whole
        # shard (the worker's error feedback is keyed by it); this server keeps its ranges of it.
        assert self.layout is not None
        bounds = self.layout.bounds
        decoded = {k: self._decoder(k).recv(transport, worker) for k in shards_touched(bounds, ranges)}
        offset = 0
        for lo, hi in ranges:
            k = shard_of(bounds, (lo, hi))
            out[offset : offset + hi - lo].copy_(decoded[k][lo - bounds[k][0] : hi - bounds[k][0]])
            offset += hi - lo
        return None

    def _decoder(self, k: int) -> PushDecoder:
        """The decoder of compressed pushes of the run's shard ``k`` (made at first use)."""
        assert self.decoder is not None and self.layout is not None
        with self._gain_lock:
            if k not in self._decoders:
                lo, hi = self.layout.bounds[k]
                self._decoders[k] = self.decoder if k == self.index else PushDecoder.of(
                    self.settings.compression.spec, hi - lo, self.settings.run.seed)
            return self._decoders[k]

    def push_ranges(self, version: int = 0) -> list[tuple[int, int]] | None:
        """The ranges of the parameters a push covers, in the order of its values: None while no
        takeover is in force here; synchronous, the ranges this server owns; asynchronous, its
        shard, then the pieces of the first ``version`` takeovers its pusher announced."""
        with self._gain_lock:
            if self.layout is None:
                return None
            if self.settings.ps_mode == "sync":
                return list(self.layout.owned[self.index])
            return [self.layout.bounds[self.index], *(r for _, pieces in self._gains[:version] for r in pieces)]

    def _step(self, grad: torch.Tensor, lr: float, weight: float = 1.0) -> None:
        """One optimizer step on ``grad`` (the averaged or pushed gradient) at the workers'
        learning rate ``lr``, counted ``weight``."""
        step_shard(self.optimizer, self.shard, self.lr_factor, grad, lr, weight)
        self.updates += 1

    def run(self, start_step: int = 0, watch: Any = None) -> None:
        """Serve until every pushing worker has sent :data:`STOP`."""
        self.watch = watch
        self.steps = start_step
        # an elastic run survives a worker that hangs too: asked to, the launcher stops it
        silence = SilenceWatch(lambda: self._awaited, f"server {self.index}").start() \
            if elastic_servers(self.settings) else None
        try:
            if self.settings.ps_mode == "sync":
                self._run_sync(start_step)
            else:
                self._run_async()
        finally:
            if silence is not None:
                silence.close()

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
        live = [i for i, w in enumerate(pushers) if w not in self.lost_pushers]  # rows of the workers still pushing
        while True:
            maybe_injected_kill(self.transport.rank, step)  # fault injection for tests
            if self.watch is not None:
                self.watch.step = step
            for i in list(live):
                self._row_header(i, live, step, grads, headers)
            clocks = headers[live, 0]
            if bool((clocks == STOP).all()):
                break
            if bool((clocks == TAKEOVER).any()):
                grads = self._take_over(live, headers, step, grads)
                continue
            if not bool((clocks == step + 1).all()):
                raise WorkerFailure(f"server {self.index}: step {step + 1} expected, workers "
                                    f"{[pushers[i] for i in live]} sent clocks {clocks.tolist()} (-1: training ended)")
            ranges = self.push_ranges()
            for i in list(live):
                while self._with_worker(i, live, step, grads, lambda i=i, grads=grads, ranges=ranges: (
                        h := self._recv_push(grads[i], pushers[i], self._peer(i), ranges)) and h.wait()) is SUCCEEDED:
                    self._row_header(i, live, step, grads, headers)  # its node's new leader pushes the step again
                    if i in live and int(headers[i, 0]) != step + 1:
                        raise WorkerFailure(f"server {self.index}: step {step + 1} expected, worker {pushers[i]} "
                                            f"sent clock {int(headers[i, 0])}")
            lr = float(headers[live, 1].clone().view(torch.float64).mean())
            self._step(grads.sum(0).div_(self.num_workers), lr)
            cut = injected_answers(self.transport.rank, step + 1)  # fault injection for tests (None: all)
            handles = {i: self._with_worker(i, live, step, grads,
                                            lambda i=i: self._peer(i).send(self.shard.data, pushers[i]))
                       for i in list(live)[:cut]}
            for i, h in handles.items():
                if h is not None and h is not SUCCEEDED:  # (a node's new leader asks for this answer again)
                    self._with_worker(i, live, step, grads, h.wait)
            if cut is not None:  # once the answered ones pushed again (so they hold the answer), die
                for i in handles:
                    self._peer(i).recv(torch.zeros(2, dtype=torch.int64), pushers[i]).wait()
                kill_now()
            step = self.steps = step + 1
            if self.joins is not None:  # workers (or servers) started again join after this round
                self._admit_joiners(step, live)
                if grads.shape[1] != self.shard.numel():  # it gave a returned server its range back
                    grads = torch.zeros(len(pushers), self.shard.numel())
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
        if self.nodes is not None:  # a node's worker that leads it later takes the takeovers it did not push
            store = self._store_client()
            life = server_life(store, lost, self.num_workers + lost)
            store.compare_set(TAKEN_OVER_KEY.format(life), "", str(self.settings.servers - len(self.layout.live())))
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
        the step, and from the next round on wait for its push again. Servers started again
        return first (:meth:`_give_back`), so a worker admitted at the same step meets them too."""
        assert self.joins is not None
        growth = self.joins.planned_growth(step)
        if growth is None or growth.at != step:
            return
        change = self.joins.admit(growth, step, time.perf_counter(), [self.pushers[i] for i in live],
                                  servers_from=self.num_workers)
        for server in change.returned:  # (the workers admitted with it are not there yet)
            self._give_back(server, [m for m in change.members if m not in change.joined], step)
        for worker in change.joined:
            i = self.pushers.index(worker)
            if i in live:  # its loss was never seen here: its row would count twice
                raise WorkerFailure(f"server {self.index}: worker {worker} joined after step {step}, but this "
                                    "server was still serving its earlier process")
            if not self._meet_joiner(worker, step):
                continue  # lost again before it took its parameters: the others are served as they were
            live.append(i)
            live.sort()
            log.info("server %d: worker %d joined after step %d; serving %d", self.index, worker, step, len(live))

    def _meet_joiner(self, worker: int, step: int) -> bool:
        """Open the link of the live servers with ``worker``, admitted after round ``step``
        (:func:`servers_link`), and send it ``[step, numel, k]``, the ``k`` ranges this server
        owns when a takeover is in force (0: its own shard), and its parameters; from the next
        round on its push comes over that link. False when it died again before its link opened
        (every server sees it gone there) or while this server sent it its parameters: it stays
        lost, and the workers read that from its dead mark."""
        servers = self.layout.live() if self.layout is not None else list(range(self.settings.servers))
        inject_kill_in("link", self.transport.rank)  # fault injection for tests
        try:
            link = servers_link(self.joins, worker, self.transport.rank, self.settings, self.transport.link_model,
                                servers)
        except LinkMissed as exc:
            self._joiner_lost(worker, step, [r - self.num_workers for r in exc.ranks if r != worker])
            return False
        version = self._started_takeovers()  # asynchronous: its pushes cover them (sync: none)
        try:
            for h in [link.send(t, worker) for t in self._holding_message(step, version)]:
                h.wait()
        except Exception as exc:
            if not is_comm_error(exc):
                raise
            link.close()
            self._joiner_lost(worker, step)
            return False
        self.versions[self.pushers.index(worker)] = version
        self._links[self.pushers.index(worker)] = link
        self._opened.append(link)
        if worker in self.lost_pushers:
            self.lost_pushers.remove(worker)
        return True

    def _joiner_lost(self, worker: int, step: int, servers: list[int] | None = None) -> None:
        """``worker``, admitted after round ``step``, never took its parameters: it was lost again,
        or ``servers`` were lost as it came (it leaves then: the workers take them over next round)."""
        declare_dead(self._store_client(), worker)  # (its last life's mark may stand: then that one)
        if servers:
            log.warning("server %d: server(s) %s lost as worker %d, admitted after step %d, came; it leaves, "
                        "serving the others", self.index, servers, worker, step)
            return
        log.warning("server %d: worker %d, admitted after step %d, was lost again before it took its parameters; "
                    "serving the others", self.index, worker, step)

    def _give_back(self, server: int, members: list[int], step: int) -> None:
        """Server ``server`` (its rank in the run) was started again after its loss and admitted
        back after round ``step``: open the link with it, the workers and the other servers
        (:func:`return_link`), send it the pieces of its range this server took over with their
        optimizer state, and serve the rest of this server's ranges from the next round on."""
        returned = server - self.num_workers
        if self.layout is None or returned in self.layout.live():
            raise WorkerFailure(f"server {self.index}: server {returned} returned after step {step}, but its "
                                "parameters were never taken over here")
        ranks = [*members, *(self.num_workers + t for t in self.layout.live()), server]
        try:
            link, _ = return_link(self.joins, server, ranks, self.transport.rank, self.settings,
                                  self.transport.link_model)
        except LinkMissed as exc:
            if exc.ranks != [server]:
                raise
            log.warning("server %d: server %d was lost again as it returned after step %d; keeping its parameters",
                        self.index, returned, step)
            return
        self._opened.append(link)
        held = list(self.layout.owned[self.index])
        pieces = self.layout.give_back(returned)[self.index]
        send_state(link, {"pieces": pieces, "state": sliced_state(self.optimizer, self.shard, positions(held, pieces)),
                          "bounds": self.layout.bounds, "owned": self.layout.owned}, server)
        if pieces:
            self.shard, self.optimizer = shrunk_optimizer(self.optimizer, self.shard,
                                                          positions(held, self.layout.owned[self.index]))
        if self.layout.whole():  # every server serves its own shard again
            self.layout = None
        log.warning("server %d: server %d returned after step %d; it takes back parameters %s from here with their "
                    "optimizer state", self.index, returned, step, pieces)

    def take_back(self, ranks: list[int], step: int) -> None:
        """This server was started again after its loss and admitted back after round ``step``
        (``ranks``: its link's, the member workers, the live servers, then itself): take the
        optimizer state of its range from the servers that took it over (its parameters came
        from the first member, :func:`serve_again`), and the layout, and serve the members from
        the next round on."""
        bounds: list[tuple[int, int]] = []
        owned: dict[int, list[tuple[int, int]]] = {}
        state: dict[str, Any] = {}
        covered = 0
        for peer in [r for r in ranks if r >= self.num_workers and r != self.transport.rank]:
            message = recv_state(self.transport, peer)
            bounds = [tuple(b) for b in message["bounds"]]  # type: ignore[misc]
            owned = {int(t): [tuple(r) for r in ranges] for t, ranges in message["owned"].items()}  # type: ignore[misc]
            pieces = [tuple(r) for r in message["pieces"]]
            at = positions([bounds[self.index]], pieces) if pieces else None  # type: ignore[arg-type]
            for key, value in message["state"].items():
                if isinstance(value, torch.Tensor) and at is not None and value.numel() == at.numel() and value.dim() == 1:
                    state.setdefault(key, torch.zeros_like(self.shard.data))[at] = value
                else:
                    state.setdefault(key, value)
            covered += 0 if at is None else at.numel()
        if covered != self.shard.numel() or owned.get(self.index) != [bounds[self.index]]:
            raise WorkerFailure(f"server {self.index}: the servers gave back {covered} of its {self.shard.numel()} "
                                f"parameters ({owned})")
        if state:
            self.optimizer.state[self.shard] = state
        self.layout = ShardLayout(bounds)  # type: ignore[arg-type]
        self.layout.owned = owned
        if self.layout.whole():
            self.layout = None
        self.lost_pushers = [w for w in self.pushers if w not in ranks]
        self.resume_step = self.steps = step
        log.warning("server %d: back after step %d with its parameters and their optimizer state; serving %d workers",
                    self.index, step, self.live_pushers)

    def _row_header(self, i: int, live: list[int], step: int, grads: torch.Tensor, headers: torch.Tensor) -> None:
        """Pusher row ``i``'s next header into ``headers[i]`` (its row leaves ``live`` when its
        worker is lost). A node's new leader may first push again the round ``step`` its lost
        leader had pushed and been answered (hierarchical, elastic): it gets that round's
        parameters, the push is not applied again."""
        while True:
            if self._with_worker(i, live, step, grads, lambda: self._recv_header(headers[i], self.pushers[i],
                                                                                 self._peer(i))) is SUCCEEDED:
                continue
            if i in live and self.nodes is not None and int(headers[i, 0]) == STOP and elastic_servers(self.settings):
                self._store_client().set(NODE_ROW_KEY.format(self.index, i), "stop")  # (its successor asks)
            if i not in live or int(headers[i, 0]) != step or i not in self._succeeded:
                self._succeeded.discard(i)
                return
            log.info("server %d: worker %d pushed step %d again, which its node's lost leader had pushed; answered, "
                     "not applied", self.index, self.pushers[i], step)
            again = torch.empty(self.shard.numel())
            self._with_worker(i, live, step, grads, lambda again=again: (
                self._peer(i).recv(again, self.pushers[i]).wait(), self._peer(i).send(self.shard.data, self.pushers[i]).wait()))

    def _with_worker(self, i: int, live: list[int], step: int, grads: torch.Tensor, fn: Any) -> Any:
        """``fn()``, an exchange with pusher row ``i`` (its result; None once the worker is lost);
        in an elastic run a worker whose process died (its connection reset) is lost: declared
        dead, its row zeroed, the others served; hierarchical, a node that has workers left is
        led by the next of them (:meth:`_succeed`): :data:`SUCCEEDED` is returned then."""
        if i not in live:
            return None
        try:
            self._awaited = {self.pushers[i]: time.monotonic()}  # (for the silence watch)
            return fn()
        except Exception as exc:
            if not self._survives(exc):
                raise
            worker = self.pushers[i]
            grads[i].zero_()
            store = self._store_client()
            declare_dead(store, worker)
            self.lost_pushers.append(worker)
            successor = self._succeed(i)
            if successor is None:
                live.remove(i)
            left = len(live) if self.nodes is None else sum(not declared_dead(store, w) for w in range(self.num_workers))
            log.warning("server %d: lost worker %d at step %d; serving the other %d%s", self.index, worker, step + 1,
                        left, "" if successor is None else f" (worker {successor} leads its node now)")
            if left < max(1, self.settings.run.min_workers):
                raise WorkerFailure(f"server {self.index}: lost worker {worker} at step {step + 1}; {left} "
                                    f"left, fewer than --min-workers {self.settings.run.min_workers}") from exc
            return None if successor is None else SUCCEEDED
        finally:
            self._awaited = {}

    def _succeed(self, i: int) -> int | None:
        """Hierarchical: the next live worker of row ``i``'s node, now its leader and pusher (the
        node's workers choose the same: the lowest not declared dead; one lost too is found so at
        its first exchange here), or None (flat, or nobody left on the node)."""
        if self.nodes is None:
            return None
        store = self._store_client()
        node = self.nodes.node_of(self.pushers[i])
        left = [w for w in self.nodes.members(node) if w not in self.lost_pushers and not declared_dead(store, w)]
        if not left:
            return None
        self.pushers[i] = left[0]
        self._succeeded.add(i)
        store.set(NODE_ROW_KEY.format(self.index, i), str(left[0]))
        return left[0]

    def lose_at_start(self, workers: list[int]) -> None:
        """Take ``workers``, lost as the run started (they never came to its start, and the
        launcher declared them dead), for lost before the first step: the others are served."""
        if not workers:
            return
        self.lost_pushers.extend(workers)
        left = self.live_pushers
        log.warning("server %d: lost worker(s) %s as the run started; serving the other %d", self.index, workers, left)
        if left < max(1, self.settings.run.min_workers):
            raise WorkerFailure(f"server {self.index}: lost worker(s) {workers} as the run started; {left} left, "
                                f"fewer than --min-workers {self.settings.run.min_workers}")
        if self.settings.ps_mode == "async":
            self._rounds_follow_pushers()

    def _survives(self, exc: BaseException) -> bool:
        """Whether an exchange with a worker that failed with ``exc`` leaves the others served:
        an elastic run, and the worker's process died (its connection reset)."""
        return elastic_servers(self.settings) and is_comm_error(exc)

    @property
    def live_pushers(self) -> int:
        """How many pushers the servers have not lost."""
        return len(self.pushers) - len(self.lost_pushers)

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
        """Apply pushes in arrival order; hold back answers to workers too far ahead. Each
        pusher's messages arrive in a thread of its own (:class:`Inbox`), so that a worker whose
        process died is found at once (its receive fails) in an elastic run: declared dead, it
        holds nobody back, and rounds count the live pushers (:meth:`RoundMomentumSGD.resize`)."""
        n, limit, every = len(self.pushers), self.settings.max_staleness, self.settings.checkpoint_every
        clocks = self.clocks  # from a state sent at the start or a checkpoint, else zeros
        saved = min(clocks) if every else 0  # the last step whose set this server saved
        ended = [w in self.lost_pushers for w in self.pushers]  # (lost as the run started: lose_at_start)
        pulled = [self.updates] * n  # self.updates when each pusher last got the parameters (a resumed run: its start)
        waiting: deque[int] = deque()  # rows of the pushers whose answer is held back
        inbox = Inbox(self, [i for i in range(n) if not ended[i]])
        looked = time.monotonic()  # when this server last looked for workers asking to join
        heard = [looked] * n  # when each pusher's last message came (for the silence watch)
        self._awaited = {self.pushers[i]: looked for i in range(n) if not ended[i]}
        try:
            while not all(ended) or self._admit_async(clocks, ended, pulled, inbox, closing=True):
                maybe_injected_kill(self.transport.rank, self.steps)  # fault injection for tests
                message = inbox.next(JOIN_POLL_S if self.joins is not None else None)
                if self.joins is not None and (message is None or time.monotonic() - looked > JOIN_POLL_S):
                    looked = time.monotonic()
                    self._admit_async(clocks, ended, pulled, inbox)
                if message is None:
                    continue
                i, worker = message.row, self.pushers[message.row]
                heard[i] = time.monotonic()
                if message.failed is not None:
                    self._lose_async(i, message.failed, clocks[i], ended, waiting)
                elif message.takeover is not None:
                    self._take_over_async(message, clocks[i])
                elif message.clock == STATE:
                    send_state(self._peer(i), self.optimizer_state(), worker)
                elif message.clock == STOP and not ended[i] and i not in waiting:
                    ended[i] = True
                elif message.clock != clocks[i] + 1 or ended[i]:
                    raise WorkerFailure(f"server {self.index}: unexpected push (worker {worker}, clock {message.clock})")
                else:
                    clocks[i] = message.clock
                    self.steps = max(self.steps, message.clock)
                    stale_rounds = (self.updates - pulled[i]) // max(1, self.live_pushers)
                    self._weights[i] = 1 / (1 + stale_rounds)
                    self._apply_push(i, message.grad.div_(self.num_workers), message.lr)
                    waiting.append(i)
                    self._stop_requested(message.clock)
                if message.failed is None:
                    inbox.release(i)
                self._awaited = {self.pushers[j]: heard[j] for j in range(n) if not ended[j]}
                # a worker that has ended (or was lost) holds nobody back
                slowest = min((c for c, done in zip(clocks, ended, strict=True) if not done), default=None)
                if every and slowest is not None and slowest // every > saved // every:
                    saved = slowest // every * every
                    self._save_async(saved)
                for j in [j for j in waiting if slowest is None or clocks[j] - slowest <= limit]:
                    waiting.remove(j)
                    pulled[j] = self.updates
                    try:
                        self._peer(j).send(self._values(self.versions[j]), self.pushers[j]).wait()
                    except Exception as exc:
                        self._lose_async(j, exc, clocks[j], ended, waiting)  # (raises unless survived)
                for held in [h for h in self._held if self._pieces_caught_up(h, clocks, ended, limit)]:
                    if held not in self._held:  # its pusher was lost on the way
                        continue
                    self._held.remove(held)
                    j, m, _ = held
                    try:
                        self._peer(j).send(self._pieces[m].param.data, self.pushers[j]).wait()
                    except Exception as exc:
                        self._lose_async(j, exc, clocks[j], ended, waiting)
        finally:
            self._awaited = {}
            inbox.close()
        if waiting or self._held:
            raise WorkerFailure(f"server {self.index}: workers "
                                f"{[self.pushers[j] for j in [*waiting, *(h[0] for h in self._held)]]} still waiting "
                                "at the end")
        final = self._holding_message(self.steps, len(self._gains))
        for i, worker in enumerate(self.pushers):  # every worker ends on the final parameters (it waits in end())
            if worker in self.lost_pushers:
                continue
            try:
                for h in [self._peer(i).send(t, worker) for t in final]:
                    h.wait()
            except Exception as exc:
                if not self._survives(exc):
                    raise
                log.warning("server %d: worker %d left before the final parameters reached it", self.index, worker)
        self.save(self.steps)

    def _admit_async(self, clocks: list[int], ended: list[bool], pulled: list[int], inbox: Inbox,
                     closing: bool = False) -> bool:
        """Asynchronous, where lost workers are started again: admit the workers waiting to join
        now (no common step), agreed in the store by whichever server or worker looked first
        (:meth:`~distrain.runtime.membership.Membership.growth_now`); each server opens its link
        with a joiner, sends it its parameters and the clock it goes on from, and receives its
        pushes from then on. ``closing``: every pusher has ended; close the run to joiners unless some were
        admitted already (then serve them). Returns whether any joined."""
        if self.joins is None:
            return False
        if not closing and self._started_takeovers() < len(self._gains):
            return False  # a takeover's pieces are still starting (their first copy queued): a joiner gets them next time
        growth = self.joins.close_growth() if closing else self.joins.growth_now()
        if growth is None:
            return False
        live = [w for w in self.pushers if w not in self.lost_pushers]
        change = self.joins.admit(growth, self.steps, time.perf_counter(), live, servers_from=self.num_workers)
        for worker in change.joined:
            i = self.pushers.index(worker)
            if not ended[i]:  # its loss was never seen here: its pushes would count twice
                raise WorkerFailure(f"server {self.index}: worker {worker} joined again, but this server was still "
                                    "serving its earlier process")
            # It goes on from the clock of this server's slowest live pusher, the round it is in:
            # pushing the next one, it neither holds the others back nor counts stale (each
            # server's, which may differ by one between servers: the worker keeps one per server).
            others = [c for j, (c, done) in enumerate(zip(clocks, ended, strict=True)) if not done and j != i]
            clocks[i] = min(others) if others else self.steps
            if not self._meet_joiner(worker, clocks[i]):
                continue  # lost again before it took its parameters: it stays ended here
            ended[i], pulled[i] = False, self.updates
            self._rounds_follow_pushers()
            inbox.add(i)
            log.info("server %d: worker %d joined at its push %d; serving %d", self.index, worker, clocks[i],
                     self.live_pushers)
        return any(not ended[self.pushers.index(w)] for w in change.joined)

    def _rounds_follow_pushers(self) -> None:
        """Asynchronous: a round of the servers' SGD momentum is the live pushers' pushes, and
        Adam steps each push at the learning rate and beta1 of that many (:func:`follow_pushers`)."""
        for holder in [self, *self._pieces.values()]:
            factor = follow_pushers(holder.optimizer, self._like, max(1, self.live_pushers))
            if factor is not None:
                holder.lr_factor = factor

    def _apply_push(self, i: int, grad: torch.Tensor, lr: float) -> None:
        """Step pusher row ``i``'s push (its gradient over ``--workers``): this server's shard,
        then each piece of a lost server it took over that the pusher announced, in order."""
        weight = self._weights[i]
        main = self.shard.numel()
        self._step(grad[:main], lr, weight)
        offset = main
        for m in range(self.versions[i]):
            piece = self._pieces.get(m)
            if piece is not None:
                piece.step(grad[offset : offset + piece.numel], lr, weight)
                offset += piece.numel

    def _values(self, version: int) -> torch.Tensor:
        """What a pusher that announced ``version`` takeovers pulls: the shard, then the pieces."""
        pieces = [self._pieces[m].param.data for m in range(version) if m in self._pieces]
        return torch.cat([self.shard.data, *pieces]) if pieces else self.shard.data

    def _holding(self, version: int) -> tuple[list[tuple[int, int]], torch.Tensor]:
        """The ranges this server holds after the first ``version`` takeovers (empty: its own
        shard, no takeover) and their parameters (:meth:`_values`)."""
        if self.layout is None or self.settings.ps_mode == "sync":
            return (list(self.layout.owned[self.index]) if self.layout is not None else []), self.shard.data
        taken = [r for m in range(version) if m in self._pieces for r in self._gains[m][1]]
        return [self.layout.bounds[self.index], *taken], self._values(version)

    def _started_takeovers(self) -> int:
        """How many of the run's takeovers this server has started the pieces of (or gained none
        in), in order: a pusher whose pushes cover them all can be served."""
        version = 0
        while version < len(self._gains) and (version in self._pieces or not self._gains[version][1]):
            version += 1
        return version

    def _holding_message(self, step: int, version: int) -> list[torch.Tensor]:
        """What a worker receives as it joins, or at the end (asynchronous): ``[step, numel, k]``,
        the ``k`` ranges this server holds after the first ``version`` takeovers (0: its own
        shard) and their parameters (:meth:`ParameterServer._recv_holding`)."""
        ranges, values = self._holding(version)
        return [torch.tensor([step, values.numel(), len(ranges)], dtype=torch.int64),
                *([torch.tensor(ranges, dtype=torch.int64)] if ranges else []), values]

    def push_numel(self, version: int) -> int:
        """The size of a push from a pusher that announced ``version`` takeovers."""
        with self._gain_lock:
            return self.shard.numel() + sum(hi - lo for _, pieces in self._gains[:version] for lo, hi in pieces)

    def gain(self, m: int, lost: int, numel: int) -> list[tuple[int, int]]:
        """The pieces of lost server ``lost``'s ranges this server takes over in the run's
        takeover ``m`` (``numel``: the model's parameters): worked out by the first pusher's
        inbox thread to announce it (the same for every server: :meth:`ShardLayout.take_over`)."""
        with self._gain_lock:
            if self.layout is None:
                self.layout = ShardLayout(shard_bounds(numel, self.settings.servers))
            if self.layout.numel(self.index) != self.shard.numel() and not self._gains:
                raise WorkerFailure(f"server {self.index}: a takeover announced for a model of {numel} parameters, "
                                    f"whose shard here would not be its {self.shard.numel()}")
            if m == len(self._gains) and lost != self.index and lost in self.layout.live():
                self._gains.append((lost, self.layout.take_over(lost)[self.index]))
            elif m >= len(self._gains) or self._gains[m][0] != lost:
                raise WorkerFailure(f"server {self.index}: takeover {m} of server {lost} announced out of the "
                                    f"run's order ({[g[0] for g in self._gains]} so far)")
            return self._gains[m][1]

    def _take_over_async(self, message: Message, clock: int) -> None:
        """A pusher announced takeover ``m`` of a lost server (:meth:`ParameterServer._announce`):
        the first announcement that reaches this server starts the pieces it gains from the
        pusher's copy, with an optimizer state of their own, fresh; a push redone (this server
        applied it to its shard, the lost one never answered it) is stepped on the pieces and
        answered once every live pusher's redone push or later one reached them (as
        ``--max-staleness`` holds pushes back: see :meth:`_pieces_caught_up`)."""
        assert message.takeover is not None
        lost, m, redone, values = message.takeover
        i, worker = message.row, self.pushers[message.row]
        if self.versions[i] != m:
            raise WorkerFailure(f"server {self.index}: worker {worker} announced takeover {m} after "
                                f"{self.versions[i]} of them")
        self.versions[i] = m + 1
        pieces = self._gains[m][1]
        if not pieces:
            return
        if m not in self._pieces:  # made as the shard's optimizer was, for the run's pushers, then the live ones
            self._pieces[m] = Piece(values, self._like, self.settings, len(self.pushers))
            self._rounds_follow_pushers()
            log.warning("server %d: took over parameters %s of lost server %d at worker %d's push %d (from its copy); "
                        "their optimizer state starts from zero", self.index, pieces, lost, worker, clock)
        if redone == NO_REDO:
            return
        if redone != clock:
            raise WorkerFailure(f"server {self.index}: worker {worker} redid its push {redone} on a lost server's "
                                f"parameters after its push {clock}")
        self._pieces[m].step(message.grad.div_(self.num_workers), message.lr, self._weights[i])
        self._held.append((i, m, redone))

    def _pieces_caught_up(self, held: tuple[int, int, int], clocks: list[int], ended: list[bool], limit: int) -> bool:
        """Whether the answer ``held`` (row, takeover, push redone) may go: every live pusher's
        pushes reached the pieces up to ``limit`` behind it (one that has not announced the
        takeover yet has its last push still to redo on them)."""
        _, m, redone = held
        return all(done or (clock if version > m else clock - 1) >= redone - limit
                   for clock, done, version in zip(clocks, ended, self.versions, strict=True))

    def _lose_async(self, i: int, exc: BaseException, clock: int, ended: list[bool], waiting: deque[int]) -> None:
        """Pusher row ``i``'s receive or answer failed: in an elastic run, if its process died,
        the others are served without it (else the failure stops the run)."""
        if ended[i] and self.pushers[i] in self.lost_pushers:
            return
        if not self._survives(exc):
            raise exc
        worker = self.pushers[i]
        ended[i] = True
        if i in waiting:
            waiting.remove(i)
        self._held = [h for h in self._held if h[0] != i]
        self.lost_pushers.append(worker)
        declare_dead(self._store_client(), worker)
        live = self.live_pushers
        self._rounds_follow_pushers()
        log.warning("server %d: lost worker %d after its push %d; serving the other %d", self.index, worker, clock,
                    live)
        if live < max(1, self.settings.run.min_workers):
            raise WorkerFailure(f"server {self.index}: lost worker {worker} after its push {clock}; {live} left, "
                                f"fewer than --min-workers {self.settings.run.min_workers}") from exc

    def _save_async(self, step: int) -> None:
        """The set of ``step``, once every live worker has pushed that step: each worker saves its
        own file there as it finishes it. Faster workers' pushes of later steps (at most
        ``--max-staleness`` ahead) are in the parameters and the momentum already, and a run
        resumed from the set applies them again from where each worker stood; with
        ``--max-staleness 0`` nobody is ahead, and the set is the synchronous run's. Not while
        this server holds a lost server's pieces (their state is not saved: no resume there)."""
        if not self._gains:
            self.save(step)

    def save(self, step: int) -> None:
        if self.run_dir is None:
            return
        from distrain.runtime.checkpoint import MEMBERS_KEY, SET_SIZE_KEY, CheckpointStore

        world = self.transport.world_size
        store = CheckpointStore(self.run_dir, self.transport.rank, world)
        # after a loss the set is written by the processes still serving and training
        lost_servers = [] if self.layout is None else [self.num_workers + t for t in range(self.settings.servers)
                                                        if t not in self.layout.live()]
        lost = set(self.lost_pushers)
        if self.nodes is not None and elastic_servers(self.settings):  # hierarchical: workers that push nothing here
            lost |= {w for w in range(self.num_workers) if declared_dead(self._store_client(), w)}
        members = [r for r in range(world) if r not in lost and r not in lost_servers]
        store.save(step, {"shard": self._holding(len(self._gains))[1], "optimizer": self.optimizer.state_dict(),
                          "step": step,
                          "model_name": self.settings.model, "algorithm_name": "ps",
                          "world_size": world, SET_SIZE_KEY: world, "steps_per_epoch": self.steps_per_epoch,
                          "total_steps": self.total_steps, "totals": self.totals().state_dict(),
                          **self._takeover_state(),
                          **({MEMBERS_KEY: members} if lost or lost_servers else {})})

    def _takeover_state(self) -> dict[str, Any]:
        """What a synchronous server's checkpoint (and ``wrap()``'s state) saved while a takeover
        is in force holds besides the values (its ``shard``: the ranges it holds, concatenated),
        under :data:`TAKEOVER_STATE_KEY`: the run's shards (``bounds``), the ranges it holds and
        their optimizer state (the shard and the pieces step under one optimizer), from which a
        resumed run gives every server its own shard back (:func:`saved_server_state`). Empty
        while no takeover is in force, and asynchronous (their sets are not saved while one is)."""
        if self.layout is None or self.settings.ps_mode != "sync":
            return {}
        return {TAKEOVER_STATE_KEY: {
            "bounds": torch.tensor(self.layout.bounds, dtype=torch.int64),
            "ranges": torch.tensor(self.layout.owned[self.index], dtype=torch.int64).reshape(-1, 2),
            "state": optimizer_state_of(self.optimizer, self.shard)}}

    def load(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's state (see :meth:`save` and :func:`saved_server_state`)."""
        if state["shard"].numel() != self.shard.numel():
            raise WorkerFailure(f"server {self.index}: its checkpoint holds {state['shard'].numel()} parameters, not "
                                f"the {self.shard.numel()} of its shard")
        self.shard.data.copy_(state["shard"])
        if SHARD_STATE_KEY not in state:
            self.optimizer.load_state_dict(state["optimizer"])
        elif state[SHARD_STATE_KEY]:
            self.optimizer.state[self.shard] = dict(state[SHARD_STATE_KEY])
        if self.settings.ps_mode == "async":  # every worker goes on from its own file of the set, at its step
            self.steps = int(state["step"])
            self.clocks = [self.steps] * len(self.pushers)

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

    watch = FaultWatch(dist.get_rank(), role="server", timeout=settings.run.timeout)
    watch.run(_serve, settings, run_dir, like, emulation, gather_totals, watch)


def serve_again(settings: ServerSettings, run_dir: str | Path | None, like: torch.optim.Optimizer,
                emulation: Emulation, rank: int, *, gather_totals: bool = True) -> None:
    """A parameter server started again after its loss (``--max-restarts``; ``rank``: its rank in
    the run): ask to return in the store, and once the workers and servers admit it after a
    round, take its range back (parameters from the first member worker, optimizer state from
    the servers that took it over) and serve until the workers' training ends, as :func:`serve`."""
    watch = FaultWatch(rank, role="server", world=settings.run.workers + settings.servers, timeout=settings.run.timeout)
    watch.run(_serve_again, settings, run_dir, like, emulation, rank, gather_totals, watch)


def _serve_again(settings: ServerSettings, run_dir: str | Path | None, like: torch.optim.Optimizer,
                 emulation: Emulation, rank: int, gather_totals: bool, watch: FaultWatch) -> None:
    store = store_client(settings.run.timeout)
    try:
        membership = Membership.enter(store, rank, reopen=False, timeout=settings.run.timeout)
        emulation.start()
        link, ranks = return_link(membership, rank, None, rank, settings, emulation.link_model)
    except RunEnded as exc:  # the workers finished before it could return: nothing left to do
        log.warning("%s; it leaves", exc)
        return
    start, cpu_start = time.perf_counter(), time.process_time()
    server = ShardServer(settings, link, run_dir, like, source=ranks[0])
    server.started, server.cpu_started = start, cpu_start
    server.joins = membership  # where later joiners ask, in the epoch it was admitted in
    members, steps = membership._members_of(membership.epoch)
    step = max(steps.values())
    server.take_back(ranks, step)
    for worker in [m for m in members if m not in ranks]:  # workers admitted at the same step
        if server._meet_joiner(worker, step):
            log.info("server %d: worker %d joined after step %d", server.index, worker, step)
    server.run(step, watch)
    control = server.control_transport()
    if gather_totals:
        control.control_all_gather(torch.tensor(server.totals().row, dtype=torch.float64))
    control.control_barrier()


def _serve(settings: ServerSettings, run_dir: str | Path | None, like: torch.optim.Optimizer, emulation: Emulation,
           gather_totals: bool, watch: FaultWatch) -> None:
    from distrain.runtime.checkpoint import CheckpointStore, finished_for

    transport = Transport(link_model=emulation.link_model)  # servers' links are emulated too
    state = None
    if run_dir is not None:
        store = CheckpointStore(run_dir, transport.rank, transport.world_size)
        resume = store.resolve(settings.resume)
        state = saved_server_state(store, resume, settings.run.workers) if resume is not None else None
    if state is not None and finished_for(state, settings.epochs):
        return  # the workers found the run finished too, and leave before anything collective
    if settings.workers_per_node:  # the workers create their node groups: collective over the world
        if elastic_servers(settings):
            meet_before_groups(store_client(settings.run.timeout), transport.rank, transport.world_size,
                               settings.run.timeout, "its node groups", "nodes")
        node_process_groups(settings.run.workers, settings.workers_per_node, settings.run.timeout)
    emulation.start()
    start, cpu_start = time.perf_counter(), time.process_time()
    # who came (a worker lost as the run starts is lost before the first step; the first that came starts the servers)
    came = came_to_start(store_client(settings.run.timeout) if elastic_servers(settings) else None, transport.rank,
                         settings)
    server = ShardServer(settings, transport, run_dir, like, source=min(came))
    server.started, server.cpu_started = start, cpu_start  # waiting for the workers' start counts too
    server.lose_at_start([w for w in server.pushers if w not in came])
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


def optimizer_state_of(optimizer: torch.optim.Optimizer, param: torch.nn.Parameter) -> dict[str, Any]:
    """``optimizer``'s state of ``param``, a server's one parameter: per-element tensors and
    scalars (such as Adam's step count)."""
    return dict(optimizer.state.get(param, {}))


def saved_server_state(store: Any, step: int, workers: int) -> dict[str, Any]:
    """This server's state in ``step``'s checkpoint set (``store``: its CheckpointStore; ranks
    from ``workers`` on are servers): its own file, or, where the set was saved while servers
    held a lost one's ranges (the lost one wrote no file), its shard's parameters and optimizer
    state put together from the servers' files (:func:`~.layout.assemble_range`, with
    :data:`SHARD_STATE_KEY`): each server of the resumed run serves its own shard again."""
    rank, members = store.rank, store.members(step)
    own = store.load(step) if rank in members else None
    if own is not None and TAKEOVER_STATE_KEY not in own:
        return own
    files = {r: own if r == rank else store.load(step, r) for r in members if r >= workers}
    held = [f[TAKEOVER_STATE_KEY] for f in files.values() if TAKEOVER_STATE_KEY in f]
    if not held:
        raise WorkerFailure(f"server {rank - workers}: checkpoint step {step} has no file of it and no server's "
                            "file holds its parameters")
    bounds = ranges_of(held[0]["bounds"])
    parts: list[tuple[list[tuple[int, int]], torch.Tensor, dict[str, Any]]] = []
    for r in sorted(files, key=lambda r: r != rank):  # its own file first: scalar state is the first part's
        f = files[r]
        if TAKEOVER_STATE_KEY in f:
            parts.append((ranges_of(f[TAKEOVER_STATE_KEY]["ranges"]), f["shard"], f[TAKEOVER_STATE_KEY]["state"]))
        else:  # a server that held its own shard only
            parts.append(([bounds[r - workers]], f["shard"], f["optimizer"]["state"].get(0, {})))
    try:
        values, state = assemble_range(parts, bounds[rank - workers])
    except ValueError as exc:
        raise WorkerFailure(f"server {rank - workers}: checkpoint step {step}: {exc}") from None
    base = own if own is not None else next(iter(files.values()))
    kept = {key: value for key, value in base.items() if key not in ("optimizer", TAKEOVER_STATE_KEY, "totals")}
    log.info("server %d: its parameters of step %d put together from the servers' files (a takeover was in force)",
             rank - workers, step)
    # a server lost before the set was saved left no counters of its own (its earlier ones died with it)
    return {**kept, "shard": values, SHARD_STATE_KEY: state, **({"totals": own["totals"]} if own is not None else {})}


def step_shard(optimizer: torch.optim.Optimizer | RoundMomentumSGD, param: torch.nn.Parameter, lr_factor: float,
               grad: torch.Tensor, lr: float, weight: float = 1.0) -> None:
    """One step of a server's ``optimizer`` over ``param`` on ``grad`` at the workers' learning
    rate ``lr`` (times ``lr_factor``), counted ``weight``."""
    if isinstance(optimizer, RoundMomentumSGD):
        optimizer.step(grad.mul_(weight), lr)
    else:
        param.grad.copy_(grad)
        for group in optimizer.param_groups:
            group["lr"] = lr * lr_factor * weight
        optimizer.step()


class Piece:
    """Parameters of a lost server that an asynchronous server took over, stepped with an
    optimizer of their own (the workers' as the server's own shard is, its state fresh)."""

    def __init__(self, values: torch.Tensor, like: torch.optim.Optimizer, settings: ServerSettings,
                 pushers: int) -> None:
        self.param = torch.nn.Parameter(values.clone())
        self.param.grad = torch.zeros_like(self.param)
        self.numel = self.param.numel()
        self.optimizer, self.lr_factor = server_optimizer(
            like, self.param, asynchronous=True, pushers=pushers, max_staleness=settings.max_staleness,
            corrected=momentum_corrected(settings.compression, like))

    def step(self, grad: torch.Tensor, lr: float, weight: float) -> None:
        step_shard(self.optimizer, self.param, self.lr_factor, grad, lr, weight)


class Message:
    """One pusher's message to an asynchronous server (:class:`Inbox`): a push (its clock,
    learning rate and gradient), a request for the optimizer state, its STOP, a takeover of a
    lost server (``takeover``: the lost server, the takeover's place in the run's order, the push
    redone, the pusher's copy of the pieces; ``grad``: the redone push's, or None), or the
    failure of its receive."""

    __slots__ = ("clock", "failed", "grad", "lr", "row", "takeover")

    def __init__(self, row: int, header: torch.Tensor | None = None, grad: torch.Tensor | None = None,
                 failed: BaseException | None = None,
                 takeover: tuple[int, int, int, torch.Tensor] | None = None) -> None:
        self.row, self.grad, self.failed, self.takeover = row, grad, failed, takeover
        self.clock = int(header[0]) if header is not None else 0
        self.lr = float(header[1:].clone().view(torch.float64)) if header is not None else 0.0


class Inbox:
    """An asynchronous server's receives: a thread per pusher receives its header and push into
    a buffer of its own and hands the :class:`Message` to the serving thread, then waits for
    :meth:`release` before it receives the next one into the same buffer. A receive from one
    peer fails when that peer's process dies (its connection resets), where a receive from any
    peer would wait on; the thread then hands over the failure and ends. A thread ends after its
    pusher's STOP, too."""

    def __init__(self, server: ShardServer, rows: list[int]) -> None:
        self.server = server
        self._queue: queue.Queue[Message] = queue.Queue()
        self._free: dict[int, threading.Event] = {}
        self._closed = False
        for i in rows:
            self.add(i)

    def add(self, i: int) -> None:
        """Receive pusher row ``i``'s messages (at the start, or once it joined again: over its link)."""
        self._free[i] = threading.Event()
        threading.Thread(target=self._receive, args=(i, self._free[i]), daemon=True,
                         name=f"distrain-ps-inbox-{self.server.pushers[i]}").start()

    def _receive(self, i: int, free: threading.Event) -> None:
        server, worker = self.server, self.server.pushers[i]
        transport = server._peer(i)
        header = torch.zeros(2, dtype=torch.int64)
        version = server.versions[i]  # the takeovers its pushes cover
        grad = torch.zeros(server.push_numel(version))
        while not self._closed:
            takeover: tuple[int, int, int, torch.Tensor] | None = None
            try:
                transport.recv(header, worker).wait()
                clock = int(header[0])
                if clock == TAKEOVER:
                    takeover, redone = self._receive_takeover(transport, worker)
                elif clock not in (STATE, STOP):
                    handle = server._recv_push(grad, worker, transport, server.push_ranges(version))
                    if handle is not None:
                        handle.wait()
            except Exception as exc:  # noqa: BLE001 - the serving thread decides
                self._queue.put(Message(i, failed=exc))
                return
            self._queue.put(Message(i, header.clone(), grad if takeover is None else redone, takeover=takeover))
            if clock == STOP:
                return
            free.wait()
            free.clear()
            if takeover is not None:  # its pushes cover the pieces of this takeover from now on
                version = takeover[1] + 1
                grad = torch.zeros(server.push_numel(version))

    def _receive_takeover(self, transport: Transport, worker: int) -> tuple[tuple[int, int, int, torch.Tensor],
                                                                              torch.Tensor | None]:
        """The rest of a takeover announcement (:meth:`ParameterServer._announce`): its fields,
        the pusher's copy of the pieces this server gains, and the push redone on them."""
        fields = torch.zeros(TAKEOVER_FIELDS, dtype=torch.int64)
        transport.recv(fields, worker).wait()
        lost, m, redone, numel = (int(v) for v in fields.tolist())
        size = sum(hi - lo for lo, hi in self.server.gain(m, lost, numel))
        values, grad = torch.empty(size), None
        if size:
            transport.recv(values, worker).wait()
            if redone != NO_REDO:
                grad = torch.empty(size)
                transport.recv(grad, worker).wait()
        return (lost, m, redone, values), grad

    def next(self, timeout: float | None = None) -> Message | None:
        """The next message from any pusher (None: none within ``timeout`` seconds)."""
        with blocked():
            try:
                return self._queue.get(timeout=timeout)
            except queue.Empty:
                return None

    def release(self, i: int) -> None:
        """Pusher row ``i``'s message is served: its thread may receive the next one."""
        self._free[i].set()

    def close(self) -> None:
        """Let threads waiting for a release end (one still receiving ends with the process)."""
        self._closed = True
        for event in self._free.values():
            event.set()
