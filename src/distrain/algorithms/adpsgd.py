"""AD-PSGD: asynchronous decentralized SGD with pairwise model averaging (Lian et al. 2018).

Each worker keeps its own model and loops with no global barrier: read the model, compute a
gradient on it, add the update (see ``gossip.py``: the gradient is computed outside the lock,
reads and writes of the shared model are inside it). Meanwhile its communication thread
averages the model with a random neighbour in ``--topology``: both end with ``(x_i + x_j) / 2``
(plus whatever update each made while the exchange was in flight).

No deadlock by construction: the topology must be bipartite (``ring`` on an even number of
workers, or ``bipartite`` for any number); the side holding worker 0 is *active*, the other
*passive*. Only active workers start exchanges, each time with a random passive neighbour;
passive workers serve requests from any active neighbour, one at a time. No two workers can
then wait on each other in a cycle. Active workers start at most one exchange per local step
(so a fast worker averages more often), and exchanges overlap the next step's computation.

Wire protocol, on a process group of its own (``gossip_group``; never interleaved with the main
thread's collectives), through its own Transport (bytes, delays, emulated links): one message
each way per exchange, a header ``[kind, *counts, *done]`` (int64, ``1 + 2n`` values) followed
by the model in the same buffer:

    active -> passive   REQUEST (or DONE: the same, and this active worker will not call again)
    passive -> active   REPLY

One message rather than a header and then the model: every message costs CPU on both sides
(the backend's send, receive and event loop, the Transport's bookkeeping), which matters when
the workers share a host's cores. Measured with two workers exchanging a 55 kB model back to
back on a loaded 2-core host: the passive worker's CPU time per exchange fell from 2.2-2.5 ms
(header and model apart, most of it in gloo's event-loop thread) to 0.7 ms.

Shutdown: a worker whose budget is used keeps averaging (an active one at about one exchange per
step time) until it knows every worker is done; then an active worker makes one last exchange,
marked DONE, with each passive neighbour and stops, and a passive worker stops once every active
neighbour has said DONE (averagings after everyone is done only bring the models closer). An
active worker only sends DONE once it knows all are done, and a passive one tells its callers
what it knows, so the knowledge spreads until everyone stops; after that, nothing changes the
models, and the loop takes the consensus (an all-reduce on the main group).

A lost worker that the launcher starts again (``--max-restarts``) joins again (see
``rejoin.py``): the members admit it as soon as one of them sees it ask, each of its neighbours
opens a link with it (HELLO: ``[HELLO, seconds since the start in microseconds, *counts, *done]``
and the neighbour's model) and calls it, or waits for its calls, over that link from then on; it
keeps its id, and so its side. Every worker closes the run to joiners before its gossip ends, and
waits for the links it is opening, so nobody stops while a neighbour that joined still gossips.

Example::

    distrain train --algorithm adpsgd                      # ring of 4: workers 0, 2 active
    distrain train --algorithm adpsgd --network straggler  # the slow worker delays nobody
    distrain train --algorithm adpsgd --workers 5 --topology bipartite --budget time --time-budget 60
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from distrain.algorithms.gossip import (
    GOSSIP_BACKSTOP_S,
    AsyncGossip,
    GossipEngine,
    GossipSettings,
    LeftBehind,
    PeerTimeout,
    SharedModel,
    Waiter,
    gossip_group,
    survivors_link,
)
from distrain.algorithms.rejoin import POLL_S, Admissions, await_entry, open_pair
from distrain.comm.transport import Handle, Transport
from distrain.errors import ConfigError, WorkerFailure
from distrain.runtime.faults import is_comm_error
from distrain.runtime.health import Liveness
from distrain.topology import Graph, bipartite_sets, build_topology

#: How often a wait for a peer's answer looks at its heartbeat (seconds).
SILENCE_POLL_S = 0.5

log = logging.getLogger(__name__)

REQUEST, REPLY, DONE, HELLO = 1, 2, 3, 4


def bipartite_graph(topology: str, n: int) -> Graph:
    """The topology on ``n`` workers; ConfigError naming ``--topology`` unless it is bipartite."""
    graph = build_topology(topology, n)
    try:
        bipartite_sets(graph)
    except ValueError as exc:
        raise ConfigError("--topology", f"adpsgd needs a bipartite topology (active and passive workers): {exc}; "
                                        "use --topology bipartite") from None
    return graph


class Message:
    """One gossip message: an int64 header and a model vector in one byte buffer (one send).

    Example::

        msg = Message(header_len=9, numel=1000, dtype=torch.float32)
        msg.header.copy_(header); msg.body.copy_(model)
        transport.send(msg.buffer, peer)
    """

    def __init__(self, header_len: int, numel: int, dtype: torch.dtype) -> None:
        head = 8 * header_len  # int64; a multiple of 8, so the body's view is aligned
        self.buffer = torch.empty(head + numel * dtype.itemsize, dtype=torch.uint8)
        self.header = self.buffer[:head].view(torch.int64)
        self.body = self.buffer[head:].view(dtype)

    @property
    def kind(self) -> int:
        return int(self.header[0])


class PairwiseGossip(GossipEngine):
    """The communication thread of one AD-PSGD worker (usable on its own, e.g. in tests).

    Args:
        state: the shared model and progress of this worker.
        transport: a Transport on a process group of all workers, used by this engine only.
        graph: a connected bipartite graph over the group's ranks.
        seed: seeds the choice of partners (each worker draws its own sequence).
        liveness: where lost peers are declared and looked up (``None``: a lost peer fails the
            run, as in a synchronous algorithm).
        peer_timeout: the ceiling: an exchange with a peer whose heartbeat goes on stamping
            is given up after twice this many seconds.

    A peer whose connection closes, that does not answer while its heartbeat is stale (killed,
    hung, cut off: noticed a few seconds after its last stamp, ``Liveness.stale_after``), or (a
    caller of a passive worker) that stays silent for as long with a stale heartbeat, is
    dropped: declared dead in the store, counted as done, and never called or waited for again.
    With ``liveness``, waits run on a :class:`~distrain.algorithms.gossip.Waiter` so that giving
    up on a hung peer leaves the others' connections open (the group's gloo timeout is only a
    backstop); a worker that finds itself declared dead (it hung past the timeout and resumed)
    leaves with a one-line message.

    Example::

        engine = PairwiseGossip(state, Transport(gossip_group(60)), build_topology("ring", 4), seed=0).start()
        ...                      # state.apply_step(...) per local step
        state.finish()           # this worker's budget is used
        engine.join(timeout=60)  # returns once every worker is done
    """

    def __init__(self, state: SharedModel, transport: Transport, graph: Graph, seed: int = 0,
                 liveness: Liveness | None = None, peer_timeout: float = 120.0,
                 admissions: Admissions | None = None, entering: bool = False) -> None:
        super().__init__(state)
        self.liveness, self.peer_timeout = liveness, peer_timeout
        if graph.n != transport.world_size:
            raise ValueError(f"the graph has {graph.n} workers, the group {transport.world_size}")
        self.transport = transport
        self.transports = [transport]
        active, _ = bipartite_sets(graph)
        self.active = transport.rank in active
        self.neighbours = list(graph.neighbors[transport.rank])  # all on the other side
        # A worker that joined again (``entering``) gossips with a neighbour once it opened their link.
        self.peers = [] if entering else list(self.neighbours)
        self.rng = random.Random(seed * 1_000_003 + transport.rank)
        self.header_len = 1 + 2 * state.world
        self.mine, self.theirs = self._messages()  # what this worker sends, what it receives
        self.exchanges = 0  # exchanges this worker started (active) or served (passive)
        self._graveyard: list[Message] = []  # buffers of abandoned exchanges (see _lose)
        self._calling: set[int] = set(self.peers)  # passive: callers that have not said DONE
        self._heard = dict.fromkeys(self.neighbours, time.monotonic())  # passive: when each was last heard from
        self._ended = threading.Event()  # the gossip thread has ended
        self.waiter = Waiter("distrain-adpsgd-wait") if liveness is not None else None
        self.admissions = admissions
        self.links: dict[int, Transport] = {}  # peers that joined again (or, joining, every peer): their link
        self.inbox: queue.SimpleQueue[tuple[int, Message, threading.Event]] = queue.SimpleQueue()  # passive

    def _messages(self) -> tuple[Message, Message]:
        return tuple(Message(self.header_len, self.state.x.numel(), self.state.x.dtype) for _ in range(2))  # type: ignore[return-value]

    def _threads(self) -> list[tuple[str, Any]]:
        if not self.neighbours:
            return []
        watch = [("distrain-adpsgd-watch", self._watch)] if self.liveness is not None else []
        if self.admissions is not None:
            watch.append(("distrain-adpsgd-admit", self._admit_joiners))
        if self.active:
            return [("distrain-adpsgd-active", self._run_active), *watch]
        return [("distrain-adpsgd-passive", self._run_passive), *watch]

    def _via(self, peer: int) -> Transport:
        """The transport to ``peer``: the gossip group's, or the link opened when one of us joined."""
        return self.links.get(peer, self.transport)

    def _wait(self, handles: list[Handle], peer: int) -> None:
        """Wait for an exchange with ``peer``. With liveness: on the waiter, giving up (PeerTimeout)
        once the wait outlasted a heartbeat's staleness and the peer's heartbeat stopped (killed,
        hung, cut off: a few seconds), or after twice ``peer_timeout`` whatever its heartbeat says
        (a peer alive but stuck in an exchange with another)."""
        if self.waiter is None or self.liveness is None:
            for handle in handles:
                handle.wait()
            return

        def wait_all() -> None:
            for handle in handles:
                handle.wait()

        # On giving up, the abandoned job keeps its buffers (and any late message) to itself.
        gave_up = self.waiter.bounded(wait_all, self.liveness, [peer], 2 * self.peer_timeout, SILENCE_POLL_S)
        if gave_up is None:
            return
        reason = (f"silent for {gave_up.waited:.0f} s, no heartbeat" if gave_up.silent
                  else f"timed out after {2 * self.peer_timeout:g} s (twice --peer-timeout)")
        raise PeerTimeout(f"worker {peer} did not answer: {reason}")

    # -- active side --

    def _run_active(self) -> None:
        try:
            gossiped = 0  # the first exchange follows the first step
            while True:
                steps, _ = self.wait_for_round(gossiped)
                if self.state.all_done and self._may_stop():
                    break
                peer = self._pick()
                if peer is None:  # a link with a joiner is being opened
                    continue
                try:
                    self._call(peer)
                    gossiped = steps
                except Exception as exc:
                    # No averaging came of this step: another peer is called at once (our training
                    # thread may be waiting for an averaging, --max-lag, and take no step until then).
                    self._lose(peer, exc)
            for peer in list(self.peers):
                try:
                    self._call(peer, DONE)
                except Exception as exc:
                    self._lose(peer, exc)
        finally:
            self._ended.set()

    def _pick(self) -> int | None:
        """A random neighbour to call; None after a short wait while there is none yet but a link
        is being opened."""
        with self.state.lock:
            if self.peers:
                return self.rng.choice(self.peers)
            if not self._opening:
                raise WorkerFailure(f"worker {self.transport.rank}: every neighbour was lost; nobody left to "
                                    "average with")
            self.state.lock.wait(timeout=0.5)
            return None

    def _may_stop(self) -> bool:
        """Every worker is done as far as this one knows: close the run to joiners (admitting those
        already agreed on, who are not done) and wait for the links being opened; True when every
        worker is still done."""
        if self.admissions is not None:
            self.admissions.close(self._welcome, self._live)
        with self.state.lock:
            while self._opening and self.error is None:
                self.state.lock.wait(timeout=0.5)
        return self.state.all_done

    def _lose(self, peer: int, exc: BaseException) -> None:
        """Drop ``peer`` after a failed exchange, if peers can be dropped and it looks gone."""
        if self.liveness is None or not is_comm_error(exc):
            raise exc
        if self.transport.rank in self.liveness.dead_ranks():  # we were the silent one (e.g. SIGSTOP)
            raise LeftBehind(self.transport.rank) from exc
        self.liveness.declare_dead(peer)  # before counting it done: see AsyncGossip._survivors
        # A receive that timed out may still be posted in the backend and land later: give it the
        # old buffers to write into, and use new ones from now on.
        self._graveyard += [self.mine, self.theirs]
        self.mine, self.theirs = self._messages()
        if peer in self.peers:
            self.peers.remove(peer)
        self.state.mark_lost(peer)
        log.warning("worker %d: lost worker %d (%s); going on without it", self.transport.rank, peer,
                    str(exc).strip().splitlines()[0][:120] if str(exc).strip() else type(exc).__name__)

    def _call(self, peer: int, kind: int = REQUEST) -> None:
        t = self._via(peer)
        mine, theirs = self.mine, self.theirs
        mine.header.copy_(self.state.progress_header(kind))
        self.state.read(out=mine.body)
        handles = [t.recv(theirs.buffer, peer), t.send(mine.buffer, peer)]  # the receive first (see comm/ring.py)
        self._wait(handles, peer)
        if theirs.kind != REPLY:
            raise WorkerFailure(f"worker {t.rank}: expected a reply from worker {peer}, got message kind {theirs.kind}")
        self.state.merge(theirs.header[1:])
        self._average()

    def _average(self, theirs: Message | None = None) -> None:
        sent = self.mine.body
        mean = (theirs or self.theirs).body.add_(sent).mul_(0.5)
        self.state.mix(sent, mean)
        self.exchanges += 1

    # -- passive side --

    def _run_passive(self) -> None:
        t = self.transport
        calling = self._calling  # active neighbours that have not said DONE
        if self.liveness is not None:
            self._serve_listened(calling)
            return
        errors = 0
        try:
            while calling:
                try:
                    src = t.recv_any(self.theirs.buffer)
                except Exception as exc:
                    # A caller's connection closed under our any-source receive (it died): the
                    # others' connections still work, and the watch finds who it was. A timeout
                    # is different: gloo closes every connection then.
                    errors += 1
                    if self.liveness is None or not is_comm_error(exc) or "timed out" in str(exc).lower() \
                            or errors > 3 * len(self.peers):
                        raise
                    self._graveyard.append(self.theirs)
                    self.theirs = self._messages()[1]
                    continue
                errors = 0
                self._heard[src] = time.monotonic()
                if self._serve(src, calling):
                    self._drop_lost_callers(calling)
        finally:
            self._ended.set()

    def _serve_listened(self, calling: set[int]) -> None:
        """The passive loop with liveness: one receiving thread per caller feeds an inbox, and
        this thread answers one message at a time. (Not an any-source receive: when a caller
        dies or leaves mid-message, gloo can leave such a receive posted, and it swallows the
        next message of another caller.)"""
        inbox = self.inbox
        for caller in sorted(calling):
            self._start_listening(caller)
        checked = time.monotonic()
        try:
            while True:
                if not calling and not self._opening:  # nobody calls any more: unless a worker joins, done
                    self._may_stop()
                    if not calling:
                        break
                # Once a second, busy or not: a caller that died is declared dead at once (by the
                # launcher, or by a peer), and its DONE will never come. Checked only when idle,
                # a passive worker that another caller keeps busy waited for the peer timeout.
                if time.monotonic() - checked >= 1.0:
                    self._drop_lost_callers(calling)
                    checked = time.monotonic()
                    if not calling:
                        continue
                try:
                    src, theirs, served = inbox.get(timeout=1.0)
                except queue.Empty:
                    continue
                self._heard[src] = time.monotonic()
                try:
                    changed = self._serve(src, calling, theirs)
                finally:
                    served.set()
                if changed:
                    self._drop_lost_callers(calling)
        finally:
            self._ended.set()

    def _start_listening(self, caller: int) -> None:
        threading.Thread(target=self._listen, args=(caller, self.inbox), name=f"distrain-adpsgd-listen-{caller}",
                         daemon=True).start()

    def _listen(self, caller: int, inbox: queue.SimpleQueue[tuple[int, Message, threading.Event]]) -> None:
        """Receive ``caller``'s messages until its DONE, each into this thread's buffer once the
        last was served (a caller sends again only after our reply). A closed connection ends
        it: the watch then finds the caller silent."""
        theirs = self._messages()[1]
        try:
            while True:
                self._via(caller).recv(theirs.buffer, caller).wait()
                served = threading.Event()
                inbox.put((caller, theirs, served))
                if theirs.kind != REQUEST:
                    return
                served.wait()
                if caller in self.state.lost:
                    return
        except Exception as exc:  # noqa: BLE001 - the caller is gone
            log.info("worker %d: no more messages from worker %d (%s)", self.transport.rank, caller,
                     str(exc).strip()[:120])

    def _drop_lost_callers(self, calling: set[int]) -> None:
        """Callers given up on (by the watch, or by another worker): no DONE will come from them."""
        if self.liveness is not None:
            with self.state.lock:
                candidates = calling - self.state.lost  # before the store is read: see current_deaths
            for peer in set(self.state.current_deaths(self.liveness.dead_ranks())) & candidates:
                self.state.mark_lost(peer)
        with self.state.lock:
            calling -= self.state.lost

    def _watch(self) -> None:
        """A second thread: once a second, leave if the others declared this worker dead (it hung
        and resumed), and (passive) give up on callers silent for longer than a heartbeat's
        staleness whose heartbeat stopped too (killed, hung, cut off). A caller given up on
        counts as done; our next replies say so, so the others can finish without it."""
        assert self.liveness is not None
        live = Liveness(self.liveness.host, self.liveness.port, self.liveness.world_size)  # its own store client
        me = self.transport.rank
        while not self._ended.wait(1.0):
            if me in live.dead_ranks():
                self.error = self.error or LeftBehind(me)
                with self.state.lock:
                    self.state.lock.notify_all()
                return
            if self.active:
                continue
            now = time.monotonic()
            quiet = {p: now - self._heard[p] for p in list(self._calling)
                     if p not in self.state.lost and now - self._heard[p] > live.stale_after}
            for peer in live.silent(list(quiet)) if quiet else []:
                live.declare_dead(peer)  # before counting it done: see AsyncGossip._survivors
                self.state.mark_lost(peer)
                log.warning("worker %d: lost worker %d (silent for %.0f s, no heartbeat); going on without it",
                            self.transport.rank, peer, quiet[peer])

    def _serve(self, src: int, calling: set[int], theirs: Message | None = None) -> bool:
        """Answer the request in ``theirs`` (default ``self.theirs``); True when something changed
        in who is still calling."""
        t = self._via(src)
        theirs = theirs or self.theirs
        kind = theirs.kind
        dropped = src in self.state.lost  # back after we gave up on it: answered, never averaged
        if (src not in calling and not dropped) or kind not in (REQUEST, DONE):
            raise WorkerFailure(f"worker {t.rank}: unexpected message kind {kind} from worker {src}")
        if not dropped:
            self.state.merge(theirs.header[1:])
        self.mine.header.copy_(self.state.progress_header(REPLY))
        self.state.read(out=self.mine.body)
        try:
            self._wait([t.send(self.mine.buffer, src)], src)
        except Exception as exc:
            calling.discard(src)
            self._lose(src, exc)
            return True
        if not dropped:  # a dropped worker learns from our header that it counts as done
            self._average(theirs)
        if kind == DONE:
            calling.discard(src)
            return True
        return bool(self.state.lost)


    # -- joins: a lost worker started again (see distrain.algorithms.rejoin) --

    def _live(self) -> list[int]:
        assert self.liveness is not None
        return [r for r in range(self.state.world) if r not in self.liveness.dead_ranks()]

    def _admit_joiners(self) -> None:
        """A member's thread: a few times a second, admit the workers that asked to join."""
        assert self.admissions is not None and self.liveness is not None
        live = self.liveness.another()

        def alive() -> list[int]:
            return [r for r in range(self.state.world) if r not in live.dead_ranks()]

        while not self._ended.wait(POLL_S):
            self.admissions.steps = self.state.own_steps
            self.admissions.poll(self._welcome, alive)

    def _welcome(self, joiner: int, epoch: int) -> None:
        """``joiner`` was admitted in ``epoch``: it trains again, and a neighbour opens a link with
        it and hands it its model there (on a thread of its own)."""
        self.state.revive(joiner, epoch)
        log.info("worker %d: worker %d joins again", self.transport.rank, joiner)
        if joiner not in self.neighbours:
            return
        with self.state.lock:
            self._opening.add(joiner)
        self.spawn(f"distrain-adpsgd-link-{joiner}", lambda: self._hand_over(joiner, epoch))

    def _hand_over(self, joiner: int, epoch: int) -> None:
        """Open the link with ``joiner`` and send it this worker's model and what it knows of every
        worker's progress (HELLO); from then on call it (active) or wait for its calls (passive)."""
        assert self.admissions is not None and self.liveness is not None
        live = self.liveness.another()
        try:
            membership = self.admissions.membership
            if not await_entry(membership, joiner, epoch, live, self.peer_timeout):
                raise PeerTimeout(f"worker {joiner} was admitted but did not come within {self.peer_timeout:g} s")
            link = open_pair(membership, epoch, (self.transport.rank, joiner), self.transport.rank,
                             self.state.world, self.peer_timeout, self.transport.link_model, joiner=joiner)
            hello = Message(self.header_len + 1, self.state.x.numel(), self.state.x.dtype)
            hello.header.copy_(self.state.progress_header(HELLO, round((time.perf_counter() - self.t0) * 1e6)))
            self.state.read(out=hello.body)
            self._wait([link.send(hello.buffer, joiner)], joiner)
            self._linked(joiner, link)
        except Exception as exc:  # noqa: BLE001 - it died again, or never came
            self._lose_joiner(joiner, exc, live)
        finally:
            self._opened(joiner)

    def _linked(self, peer: int, link: Transport) -> None:
        """The link with ``peer`` is open: gossip with it over the link from now on."""
        self.links[peer] = link
        self.transports.append(link)
        with self.state.lock:
            self._heard[peer] = time.monotonic()
            if self.active:
                self.peers.append(peer)
            else:
                self._calling.add(peer)
                self._start_listening(peer)
            self.state.lock.notify_all()

    def lost_at_start(self, lost: set[int]) -> None:
        """Workers lost as the run started, before the gossip groups were made: nobody calls
        them or waits for their calls (the others opened their link without them)."""
        for peer in sorted(lost):
            self.state.mark_lost(peer)
            if peer in self.peers:
                self.peers.remove(peer)
            self._calling.discard(peer)
            self._heard.pop(peer, None)

    def enter(self, epoch: int) -> None:
        """This worker joined again, admitted in ``epoch``: open a link with every live neighbour
        (each opens its side once it admitted it) and take the first model handed over
        (:attr:`has_model` is set then)."""
        assert self.liveness is not None and self.admissions is not None
        dead = self.liveness.dead_ranks()
        for r in dead:
            if r != self.transport.rank:
                self.state.mark_lost(r)
        with self.state.lock:
            self._opening.update(n for n in self.neighbours if n not in dead)
        for n in sorted(self._opening):
            self.spawn(f"distrain-adpsgd-link-{n}", lambda n=n: self._take_over(n, epoch))

    def _take_over(self, peer: int, epoch: int) -> None:
        """Open the link with neighbour ``peer`` and receive its HELLO: the first one's model
        becomes this worker's; every one's progress is merged."""
        assert self.admissions is not None and self.liveness is not None
        live = self.liveness.another()
        try:
            link = open_pair(self.admissions.membership, epoch, (self.transport.rank, peer), self.transport.rank,
                             self.state.world, self.peer_timeout, self.transport.link_model)
            hello = Message(self.header_len + 1, self.state.x.numel(), self.state.x.dtype)
            self._wait([link.recv(hello.buffer, peer)], peer)
            if hello.kind != HELLO:
                raise WorkerFailure(f"worker {self.transport.rank}: expected worker {peer}'s model, got message "
                                    f"kind {hello.kind}")
            self._take_handed(peer, hello.header, hello.body)
            self._linked(peer, link)
        except Exception as exc:  # noqa: BLE001
            self._lose_joiner(peer, exc, live)
        finally:
            self._opened(peer)


@dataclass(frozen=True, kw_only=True)
class ADPSGDSettings(GossipSettings):
    """What AD-PSGD runs with: the gossip settings and its topology."""

    #: who averages with whom: a bipartite topology (see :func:`bipartite_graph`)
    topology: str


class ADPSGD(AsyncGossip):
    """Asynchronous decentralized SGD (see the module docstring)."""

    name = "adpsgd"
    settings: ADPSGDSettings

    def build_engine(self, transport: Transport) -> PairwiseGossip:
        g = self.settings
        self.graph = bipartite_graph(g.topology, transport.world_size)  # under torchrun: WORLD_SIZE
        liveness = self.liveness(transport.world_size)
        admissions = self.admissions(liveness, transport)
        if self.entered is not None:  # no group to enter: links with each neighbour (see rejoin.py)
            return PairwiseGossip(self.state, transport, self.graph, seed=g.run.seed, liveness=liveness,
                                  peer_timeout=g.peer_timeout, admissions=admissions, entering=True)
        came = self.meet_before_groups(liveness, transport)
        if liveness is not None and self.started_without:  # some were lost as the run started
            engine = PairwiseGossip(self.state, survivors_link(liveness, came, transport, g.run.timeout), self.graph,
                                    seed=g.run.seed, liveness=liveness, peer_timeout=g.peer_timeout,
                                    admissions=admissions)
            engine.lost_at_start(self.started_without)
            return engine
        group = gossip_group(GOSSIP_BACKSTOP_S if liveness is not None else g.peer_timeout)  # see Waiter
        return PairwiseGossip(self.state, Transport(group, link_model=transport.link_model), self.graph,
                              seed=g.run.seed, liveness=liveness, peer_timeout=g.peer_timeout, admissions=admissions)

    def close(self) -> None:
        if isinstance(self.engine, PairwiseGossip) and self.engine.waiter is not None:
            self.engine.waiter.close()
        super().close()

    def info(self) -> dict[str, Any]:
        if self.engine is None:
            return {"budget": self.settings.budget}
        active, passive = bipartite_sets(self.graph)
        return {"topology": self.graph.name, "active": active, "passive": passive, "budget": self.settings.budget}

    def metrics(self) -> dict[str, float]:
        out = super().metrics()
        if isinstance(self.engine, PairwiseGossip):
            out["exchanges"] = self.engine.exchanges
        return out


__all__ = ["ADPSGD", "ADPSGDSettings", "PairwiseGossip"]
