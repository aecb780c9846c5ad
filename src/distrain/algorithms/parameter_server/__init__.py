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

Wire format (tensors only): at start, worker 0 (the first worker that came, see below) sends each server an int64 header
``[shard_numel, total_steps, steps_per_epoch]`` (checked before the server allocates: at most
``MAX_SHARD_BYTES`` of parameters, and what the server keeps of the shard must fit in its
machine's memory) and the initial shard; each push is an int64
``[clock, lr]`` (the worker's learning rate, a float64's bits) then the float gradient shard, or
with ``--compress`` one message of :mod:`distrain.compress.pushes` (a header announcing the
payload's size, checked by the server before it allocates); each pull is the float parameter
shard. When a worker's training ends it sends ``[-1, 0]`` (:data:`STOP`) to every server, which
serves until every worker has.

Elastic (flat, or hierarchical with synchronous servers; ``--min-workers`` below ``--workers``):
a server whose
receive from a worker fails (the worker's process died: its connection resets) declares it
dead in the store and serves the others; the round in progress completes without that
worker's push (or with it, if it arrived first: a gradient counts once), and every later round
sums the survivors' gradients over ``--workers`` as before, i.e. their average at the learning
rate scaled to the smaller global batch (linear scaling rule). The workers never wait for one
another, so nothing is redone. A worker lost as the run starts (before the servers' start
message, which worker 0 sends, and the workers' first barrier) is lost before the first step:
the workers and the servers first agree in the store on who came
(:func:`~.elastic.came_to_start`), the first worker that came starts the servers, and the
workers meet in the store to start; a server that did not come is left unstarted and taken
over at the first push, as later. The workers look in the store once a second for workers the
servers lost (:meth:`ParameterServer.newly_lost`): the loss becomes a change of members, and
``distrain train`` splits the data again over the survivors (the learning rate stays: the servers
scale it). At the end the survivors and the servers each register as
finished and close the run over those that did (:func:`survivors_transport`). Asynchronous
servers receive from every worker in a thread of its own (:class:`~.server.Inbox`; a receive from
any peer would wait on after one died): a lost worker holds nobody back under ``--max-staleness``,
and a round of :class:`RoundMomentumSGD` is the survivors' pushes from then on, the round in
progress included (:meth:`RoundMomentumSGD.resize`), so that with ``--max-staleness 0`` the run is
still the synchronous one. A lost server is survived in sync mode only. A worker started again
(``--max-restarts``) joins asynchronous servers as soon as it asks: no common step to wait for,
the first server or worker to look in the store proposes the admission
(:meth:`~distrain.runtime.membership.Membership.growth_now`), each server opens its link with it
and sends it its parameters and the clock of its slowest live worker (it then pushes the next
round's gradient: never stale, holding nobody back; two servers' clocks may differ by one, and
the worker keeps one per server). Asynchronous workers end at different pulls: once every worker
has ended, the servers answer each with their final parameters (:meth:`ParameterServer.end`).

Hierarchical (:mod:`.nodes`): a node's workers that lose one of them meet again over a group of
their own and take the newest parameters one of them holds; where the step was not handed on,
they sum their gradients of it again and the node's leader pushes them, the next worker of the
node when the leader was lost: the servers, whose exchange with the leader failed, take it for
the node's pusher (:meth:`ShardServer._succeed`) and answer a round the lost leader had pushed
with its parameters, without applying it again. A node lost whole is dropped as a flat worker is.
Workers do not join hierarchical runs again.

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

A lost server (two servers or more): every worker finds its push or pull
failing, and once the server is declared dead the workers agree in the store that they all lost
it at the same step (it answered nobody; pulls land in a spare buffer, so each worker still holds
the last parameters it answered). The live servers split its ranges between them
(:class:`ShardLayout`), take their pieces' parameters from one worker, redo the step on them with
every worker's gradient and a fresh optimizer state (logged), and serve their shard and pieces as
one from then on: no step lost or applied twice. A server that died as it answered a step to
some workers only is found lost a step later by those it answered; they offer its answer in
the store, the others take it (:meth:`ParameterServer._take_answer`), and all take the server
over at the next step. With compressed pushes each worker still
compresses each shard of the run's layout, its error feedback keyed by the shard; a push to a
server carries the message of every shard it holds pieces of (:func:`.layout.shards_touched`),
which the server decodes and cuts to its pieces, and the step redone on a lost server's pieces
carries what its messages decode to (:meth:`ParameterServer._pushed`), so the residuals neither
lose nor repeat anything. A hung worker (stopped, or its training thread stuck; its connections
stay open) is stopped by the launcher when a server asks: each server's
:class:`~distrain.runtime.health.SilenceWatch` looks at whom it waits for, and a worker waited
for through its heartbeat's staleness with a stale heartbeat is killed, then lost as above; so
is a hung server, two or more of them, that the workers wait for (each worker's own watch), then
taken over. The loss of the only server and, with node groups, the loss of any server still stop
the run (a hung only server holds the workers until ``--timeout``). While the servers hold another's ranges, a worker that joins meets the live servers
only, each sending it the ranges it owns (:meth:`ShardServer._meet_joiner`), and each server's
checkpoint and its answer to :data:`~.wire.STATE` hold its ranges part by part with their
optimizer state (:data:`~.wire.TAKEOVER_STATE_KEY`); the checkpoint sets name the live
processes only, so a run resumes from them with every server on its own shard, put together
from the others' files (:func:`.server.saved_server_state`), and ``wrap()``'s ``state_dict()``
gives every server's state the same way (:meth:`ParameterServer._shard_states`).

Asynchronous servers (``--ps-mode async``) have no common step to agree on: each worker takes a
lost server over on its own (:meth:`ParameterServer._take_over_async`). The first worker to report
the loss appends it to the run's order of takeovers in the store, and every worker announces the
takeovers to the live servers in that order, so that all layouts agree: its copy of the pieces
each server gains, and the push of its step again when that push failed. A server works out its
pieces as the first announcement arrives (:meth:`ShardServer.gain`, in the pusher's inbox thread:
the pushes that follow are longer), starts them from the first copy that reaches it with an
optimizer of their own (:class:`.server.Piece`, fresh state), steps the pushes redone on them, and
holds each answer on them back as it holds pushes, until every live pusher's push reached them
within ``--max-staleness``. Each pusher's pushes and pulls cover the pieces of the takeovers it
announced (``versions``). The final parameters come with the ranges each server holds, so a
worker that ended before it saw a loss takes the pieces too. A lost asynchronous server does not
return.

A lost server started again by the launcher returns (its servers announce in the store that
they take over, :data:`~distrain.runtime.membership.SERVERS_RETURN_KEY`, so that a launcher
restarts servers too): it asks in the store as a joining worker does, and the workers and live
servers admit it after a round (:meth:`Membership.admit
<distrain.runtime.membership.Membership.admit>`, ``Change.returned``). They then open a link with
it (:func:`return_link`); the first member worker sends it its range's parameters of that round
(every worker holds them from its pull) and each live server the pieces of that range it held
with their optimizer state, which it keeps (:meth:`ShardLayout.give_back`,
:func:`~.server_optim.shrunk_optimizer`); from the next round on the workers push that range to
it again. Nothing is reset: the run goes on as if the server had never been lost, but for the
optimizer state the takeover started afresh.

The servers step the workers' optimizer on their shards: the same class and hyperparameters
(:func:`server_optimizer`; one parameter group, or groups that differ only in their
parameters), at the learning rate each push carries, so a scheduler attached to the workers'
optimizer drives the servers too.

Workers run with :class:`PSSettings`, servers with :class:`ServerSettings` (the same and what
only a server uses); :mod:`distrain.assemble` makes them from the flags and starts a server
(``distrain.assemble.serve``).

The package: :mod:`.worker` (:class:`ParameterServer`, the worker side), :mod:`.server`
(:class:`ShardServer`, :func:`serve`), :mod:`.settings`, :mod:`.layout` (who owns which ranges),
:mod:`.server_optim` (the optimizer a server steps), :mod:`.wire` (headers and optimizer state as
tensors), :mod:`.elastic` (going on without a lost worker, admitting it again) and :mod:`.nodes` (a
node's workers going on without a lost one).

Example::

    distrain train --algorithm ps --servers 2 --ps-mode async --max-staleness 2
    distrain train --algorithm ps --servers 2 --compress group_topk:0.01
    distrain train --algorithm ps --servers 2 --workers 8 --workers-per-node 4
"""

from __future__ import annotations

from distrain.algorithms.parameter_server.elastic import (
    admissions,
    return_link,
    servers_link,
    servers_return,
    survivors_transport,
)
from distrain.algorithms.parameter_server.layout import (
    ShardLayout,
    gather_ranges,
    scatter_ranges,
    shard_bounds,
)
from distrain.algorithms.parameter_server.server import ShardServer, serve, serve_again
from distrain.algorithms.parameter_server.server_optim import (
    RoundMomentumSGD,
    async_momentum,
    merged_optimizer,
    server_optimizer,
)
from distrain.algorithms.parameter_server.settings import PSSettings, ServerSettings
from distrain.algorithms.parameter_server.wire import (
    MAX_SHARD_BYTES,
    check_start_header,
    recv_state,
    send_state,
)
from distrain.algorithms.parameter_server.worker import ParameterServer

__all__ = [
    "MAX_SHARD_BYTES", "PSSettings", "ParameterServer", "RoundMomentumSGD", "ServerSettings", "ShardLayout",
    "ShardServer", "admissions", "async_momentum", "check_start_header", "gather_ranges", "merged_optimizer",
    "recv_state", "return_link", "scatter_ranges", "send_state", "serve", "serve_again", "server_optimizer",
    "servers_link", "servers_return", "shard_bounds", "survivors_transport",
]
