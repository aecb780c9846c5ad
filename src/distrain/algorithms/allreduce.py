"""Synchronous data-parallel SGD: gradients averaged by all-reduce in buckets.

Buckets are filled in reverse parameter order (the order backward produces gradients), and with
gloo's collective each bucket's all-reduce starts from a gradient hook as soon as the bucket is
full, so communication overlaps the rest of the backward pass, as PyTorch DDP does. With
``--ring own`` the buckets go through our ring over point-to-point after backward.

With ``--ring auto`` (the default) a small bucket (at most :data:`DOUBLING_BYTES`; on the CPU)
is summed instead by recursive doubling over point-to-point once backward is done
(:func:`~distrain.comm.ring.doubling_all_reduce`): log2(n) rounds where gloo's ring takes 2(n-1).
A small bucket's all-reduce costs rounds, not bytes: on loopback with 4 workers on 2 cores,
a 14k-float all-reduce took 4.4 ms through gloo's collective and 0.6 ms by doubling, and on
an emulated link each round pays its latency. The large buckets still start during backward.

With ``--compress`` (other than ``none``) the gradients are averaged after backward by
:class:`~distrain.compress.gradients.GradientCompression`: flattened, compressed with error
feedback, summed through the collective the compressor calls for (``--sparse-collective``), and
dense during a density warm-up.

It runs with :class:`AllReduceSettings`, which :mod:`distrain.assemble` makes from the flags.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from distrain.algorithms.base import Algorithm, RunFacts, StepContext, clone_state
from distrain.algorithms.hierarchical import build_hierarchy
from distrain.comm.ring import doubling_all_reduce, ring_all_reduce
from distrain.comm.transport import Handle, Transport
from distrain.compress.gradients import GradientCompression
from distrain.compress.settings import CompressionSettings
from distrain.runtime.faults import NonFinite, all_finite, inject_kill_in


@dataclass(frozen=True, kw_only=True)
class AllReduceSettings:
    """What all-reduce SGD runs with."""

    #: gradient bucket size in MB, and the first bucket's (0: the same)
    bucket_mb: float
    first_bucket_mb: float
    #: ``auto`` (the backend's collective, started during backward, and recursive doubling after
    #: it for small buckets on the CPU), ``gloo`` (the backend's collective only) or ``own`` (our
    #: ring, after backward)
    ring: str
    #: ranks per node for hierarchical aggregation (0: flat)
    workers_per_node: int
    #: a NaN or infinite gradient: ``stop`` the run, or ``skip`` this worker's share of the step
    on_nonfinite: str
    compression: CompressionSettings
    run: RunFacts


#: parameters of at least this many elements on average have their gradients scaled as they are
#: copied into a bucket (one multiply per parameter instead of a pass over the whole bucket)
FUSED_SCALE_NUMEL = 2**15


@dataclass
class Bucket:
    """Parameters whose gradients travel together in one flat buffer."""

    params: list[torch.nn.Parameter]
    flat: torch.Tensor
    sizes: list[int]
    ready: int = 0
    handle: Handle | None = None
    views: list[torch.Tensor] | None = None  # set by bind_grads
    local: torch.Tensor | None = None  # this worker's own gradients, kept when launched (elastic runs)
    #: instead of ``local``: the parameters' own gradient tensors of the step, when they are not
    #: views into ``flat`` (the user's zero_grad(set_to_none=True) made new ones), so nothing is copied
    own: list[torch.Tensor | None] | None = None
    #: whether ``flat`` was divided by the number of workers as the gradients were copied into it
    averaged: bool = False
    #: gathered and launched, to be summed by recursive doubling after backward (``--ring auto``)
    doubling: bool = False

    def bind_grads(self) -> None:
        """Make every parameter's ``.grad`` a view into ``flat`` (DDP's gradient_as_bucket_view):
        backward then accumulates straight into the bucket, and gather/scatter copy nothing."""
        self.views = [chunk.view_as(p) for p, chunk in zip(self.params, self.flat.split(self.sizes), strict=True)]
        for p, view in zip(self.params, self.views, strict=True):
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad)
            p.grad = view

    def _grads_are_views(self) -> bool:
        # zero_grad(set_to_none=True), or anyone assigning .grad, replaces a view by a new tensor.
        # Every step pays this check: the identity test settles it without a call per parameter.
        if self.views is None:
            return False
        for p, view in zip(self.params, self.views, strict=True):
            grad = p.grad
            if grad is not view and (grad is None or grad.data_ptr() != view.data_ptr()):
                return False
        return True

    def gather_grads(self, scale: float = 1.0) -> None:
        """Copy the gradients into ``flat`` (nothing to copy when they are its views). Where they
        are copied and their parameters are large, each is multiplied by ``scale`` on the way,
        as DDP divides while copying into its bucket: the average then needs no second pass over
        the bucket (``averaged``). Small parameters are copied in one ``cat`` and left unscaled,
        since an operation per parameter would cost more than the pass it saves."""
        self.averaged = False
        if self._grads_are_views():
            return
        if scale != 1.0 and self.views is not None and self.flat.numel() >= FUSED_SCALE_NUMEL * len(self.params):
            for p, chunk in zip(self.params, self.flat.split(self.sizes), strict=True):
                if p.grad is None:
                    chunk.zero_()
                else:
                    torch.mul(p.grad.reshape(-1), scale, out=chunk)
            self.averaged = True
            return
        grads = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=self.flat.dtype)
                 for p in self.params]
        torch.cat(grads, out=self.flat)

    def scatter_grads(self) -> None:
        if self._grads_are_views():
            return
        if self.views is not None:  # views were replaced: bind again (flat holds the result)
            for p, view in zip(self.params, self.views, strict=True):
                p.grad = view
            return
        for p, chunk in zip(self.params, self.flat.split(self.sizes), strict=True):
            if p.grad is None:
                p.grad = chunk.view_as(p).clone()
            else:
                p.grad.copy_(chunk.view_as(p))


def make_buckets(params: list[torch.nn.Parameter], bucket_bytes: float,
                 first_bucket_bytes: float | None = None) -> list[Bucket]:
    """Group parameters, last layer first, into buckets of about ``bucket_bytes`` (the first
    one of about ``min(first_bucket_bytes, bucket_bytes)``; None: no smaller first bucket).

    A bucket is closed once it holds at least its size, as DDP's ``compute_bucket_assignment_by_size``
    does, so the same sizes give DDP's buckets. A smaller first bucket starts communicating earlier
    in backward, but costs one more collective (a round of latencies) where little backward is
    left to overlap, as in an MLP whose last big layer finishes last but one.
    """
    if not params:
        return []
    first = bucket_bytes if first_bucket_bytes is None else min(first_bucket_bytes, bucket_bytes)
    groups: list[list[torch.nn.Parameter]] = [[]]
    size = 0
    for p in reversed(params):
        if size >= (first if len(groups) == 1 else bucket_bytes):
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += p.numel() * p.element_size()
    buckets = []
    for group in groups:
        sizes = [p.numel() for p in group]
        flat = torch.empty(sum(sizes), dtype=group[0].dtype, device=group[0].device)
        buckets.append(Bucket(params=group, flat=flat, sizes=sizes))
    return buckets


#: Buckets of at most this many bytes are summed by recursive doubling under ``--ring auto``.
#: Doubling sends log2(n) whole copies where a ring sends 2(n-1)/n of one, so a bucket this
#: small costs at most a few hundred kB more a step (4 workers: 256 kB more) for 2(n-1) -
#: log2(n) rounds of latency less (4 workers: 4 of 6).
DOUBLING_BYTES = 256 * 1024

#: Steps between the members' looks for workers waiting to join (elastic runs with restarts).
ADMISSION_EVERY = 8


class AllReduce(Algorithm):
    """Average gradients over all workers each step (the DDP / C-PSGD baseline)."""

    name = "allreduce"
    compresses = True
    #: When set (elastic runs), each bucket keeps a copy of this worker's own gradients as its
    #: all-reduce starts, so that a step interrupted by a lost peer can be redone without it.
    keep_local = False
    settings: AllReduceSettings

    def __init__(self, settings: AllReduceSettings) -> None:
        super().__init__(settings, settings.compression)

    @property
    def admission_every(self) -> int:
        """The members look for joiners every 8 steps: one store request every step was about a
        sixth of a small model's step with restarts on; a joiner waits at most 16 steps more."""
        return ADMISSION_EVERY

    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, transport: Transport) -> None:
        super().setup(model, optimizer, transport)
        s = self.settings
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buckets = self._make_buckets(self.params)
        self.own_ring = s.ring == "own"
        # --workers-per-node: sum inside nodes, then across node leaders (None: flat all-reduce)
        self.hierarchy = (build_hierarchy(transport, s.workers_per_node, own_ring=self.own_ring,
                                          compressed=s.compression.enabled, timeout=s.run.timeout)
                          if transport.world_size > 1 else None)
        self.compression = (GradientCompression.from_settings(s.compression, self.params, optimizer, seed=s.run.seed,
                                                              own_ring=self.own_ring)
                            if transport.world_size > 1 else None)  # one worker has nothing to send
        if self.compression is not None:  # adaptive: the workers' delays travel in the dense all-reduce
            self.compression.policy = self.adaptive
        self._hooks = []
        if transport.world_size > 1 and self.compression is None:
            for bucket in self.buckets:
                bucket.bind_grads()
        if transport.world_size > 1 and not self.own_ring and self.compression is None:
            self._register_hooks()
        self.checks_gradients = bool(self._hooks)  # buckets leave during backward: check each first
        # The order in which the first backward produces gradients (parameter indices): the
        # buckets are then rebuilt in that order, as DDP does, so each fills as early as it can.
        self._ready_order: list[int] | None = [] if self._hooks else None
        self._launched = 0  # buckets launched in the step in flight
        # --ring auto: small buckets by recursive doubling (gloo on the CPU; a flat ring)
        self.doubling_bytes = (DOUBLING_BYTES if s.ring == "auto" and s.run.device == "cpu" and self.hierarchy is None
                               and self._hooks else 0)
        self._before: dict[str, Any] | None = None  # see state_before_step

    def _make_buckets(self, params: list[torch.nn.Parameter]) -> list[Bucket]:
        s = self.settings
        return make_buckets(params, s.bucket_mb * 2**20, s.first_bucket_mb * 2**20 or None)

    def _register_hooks(self) -> None:
        index = {id(p): i for i, p in enumerate(self.params)}
        for bucket in self.buckets:
            for p in bucket.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._hook_for(bucket, index[id(p)])))

    def _hook_for(self, bucket: Bucket, index: int):  # noqa: ANN202
        def hook(_param: torch.Tensor) -> None:
            if self._ready_order is not None:
                self._ready_order.append(index)
            self._grad_ready(bucket)
        return hook

    def _rebuild_buckets(self, order: list[int]) -> None:
        """Regroup the buckets in the order gradients became ready in the first backward, when
        every worker saw the same complete order (collective: every worker calls this once)."""
        n = len(self.params)
        mine = torch.full((n,), -1, dtype=torch.int64)  # -1: a parameter that got no gradient
        mine[: min(n, len(order))] = torch.tensor(order[:n], dtype=torch.int64)
        inject_kill_in("regroup", self.transport.ids[self.transport.rank])  # fault injection for tests
        rows = self.transport.control_all_gather(mine)
        if any(not torch.equal(row, rows[0]) for row in rows) or sorted(rows[0].tolist()) != list(range(n)):
            return  # the same buckets on every worker, or their all-reduces would not match
        self._regroup(rows[0].tolist())

    def _regroup(self, order: list[int]) -> None:
        """Make the buckets of ``order`` (parameter indices, first ready first)."""
        if order == self._bucket_order():
            return  # e.g. the reversed parameter order: the buckets are right already
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self.buckets = self._make_buckets([self.params[i] for i in reversed(order)])
        for bucket in self.buckets:
            bucket.bind_grads()  # copies this step's averaged gradients into the new buckets
        self._register_hooks()

    def _bucket_order(self) -> list[int]:
        """The parameters' indices in bucket order (the order gradients are expected ready)."""
        index = {id(p): i for i, p in enumerate(self.params)}
        return [index[id(p)] for bucket in self.buckets for p in bucket.params]

    def _grad_ready(self, bucket: Bucket) -> None:
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            bucket.gather_grads(1.0 / self.transport.world_size)
            if not all_finite(bucket.flat):  # a NaN is never averaged into a peer
                if self.settings.on_nonfinite != "skip":
                    raise NonFinite("gradient")
                bucket.flat.zero_()  # this worker's share of the bucket is dropped for this step
            self._launch(bucket)

    @classmethod
    def survives(cls, settings: AllReduceSettings) -> bool:
        """All-reduce on the CPU, flat (compressed or not) or hierarchical, whose survivors redo
        the step (see :attr:`elastic`)."""
        r = settings.run
        return r.device == "cpu" and 1 < r.workers and r.min_workers < r.workers

    #: Survivors of a lost worker redo the step without it. Compressed, each redoes it from its
    #: compressor's state before the step (:meth:`state_before_step`); hierarchical, over the
    #: nodes of the survivors' ids (a node that lost its leader is led by its next member).
    elastic = True

    def state_before_step(self) -> dict[str, Any] | None:
        """The compressor's state (error-feedback residuals, momentum correction's velocity, the
        adaptive policy's) as the step in flight began: compressing moved it, and the redo
        compresses the same gradients again."""
        return None if self._before is None else {**self.state_dict(), "compressor": self._before}

    def keeps_local_gradients(self) -> bool:
        return self.keep_local and self._launched == len(self.buckets)

    def local_gradients(self) -> list[torch.Tensor | None] | None:
        """This worker's own gradients of the step in flight, per parameter (as launched), or
        None where no bucket kept them (nothing launched yet: ``.grad`` still holds them)."""
        if not self.keeps_local_gradients():
            return None
        out: dict[int, torch.Tensor] = {}
        for bucket in self.buckets:
            if bucket.own is not None:
                for p, grad in zip(bucket.params, bucket.own, strict=True):
                    out[id(p)] = torch.zeros_like(p) if grad is None else grad.detach().clone()
                continue
            assert bucket.local is not None
            for p, chunk in zip(bucket.params, bucket.local.split(bucket.sizes), strict=True):
                out[id(p)] = chunk.view_as(p).clone()
        return [out.get(id(p)) for p in self.params]

    def _launch(self, bucket: Bucket) -> None:
        """Start the bucket's all-reduce; ``flat`` must hold its gradients (gather_grads)."""
        self._launched += 1
        if self.keep_local:
            # Views are overwritten by the all-reduce, and unbound grads by scatter_grads: copy them.
            # Grads that replaced bound views are only dropped for the views again: keep those.
            if bucket.views is None or bucket._grads_are_views():
                bucket.own = None
                if bucket.local is None:
                    bucket.local = torch.empty_like(bucket.flat)
                bucket.local.copy_(bucket.flat)
            else:  # flat holds a copy of them; the tensors themselves stay as they are until scattered
                bucket.own = [p.grad for p in bucket.params]
        if bucket.flat.numel() * bucket.flat.element_size() <= self.doubling_bytes:
            bucket.doubling = True  # after backward (the rounds wait on each other)
            return
        bucket.handle = (self.hierarchy or self.transport).all_reduce(bucket.flat)

    def after_backward(self, ctx: StepContext) -> None:
        world = self.transport.world_size
        if world == 1:
            return
        if self.compression is not None:
            if self.keep_local:  # elastic: what a redo of this step starts from
                self._before = clone_state(self.compression.state_dict())
            # ctx.epoch counts the step being finished; the schedule wants the epochs done before it.
            self.compression.average(self.transport, step=ctx.step, epochs_done=ctx.epoch * ctx.step / (ctx.step + 1),
                                     ratio=self.compress_ratio(ctx))
            return
        for bucket in self.buckets:
            if self.own_ring:
                bucket.gather_grads(1.0 / world)
                ring_all_reduce(self.transport, bucket.flat)
            elif bucket.handle is None and not bucket.doubling:  # some parameters got no gradient this step
                bucket.gather_grads(1.0 / world)
                self._launch(bucket)
        for bucket in self.buckets:  # while the large buckets' all-reduces go on
            if bucket.doubling:
                doubling_all_reduce(self.transport, bucket.flat)
                bucket.doubling = False
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
            if not bucket.averaged:
                bucket.flat.div_(world)
            bucket.scatter_grads()
            bucket.ready, bucket.handle = 0, None
        if self._ready_order is not None:  # (its gather may lose a peer: the step's own gradients are kept till after it)
            order, self._ready_order = self._ready_order, None
            self._rebuild_buckets(order)
        self._launched = 0

    def metrics(self) -> dict[str, float]:
        return {} if self.compression is None else self.compression.metrics()

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {} if self.compression is None else {"compressor": self.compression.state_dict()}
        if self._hooks and self._ready_order is None:  # the buckets as the first step regrouped them
            state["bucket_order"] = torch.tensor(self._bucket_order(), dtype=torch.int64)
        return state

    def replica_state(self) -> list[torch.Tensor]:
        # The buckets' order (-1s before the first step regrouped them): a worker that joins must
        # fill and launch the same buckets as the others.
        if not self._hooks or self._ready_order is not None:
            return [torch.full((len(self.params),), -1, dtype=torch.int64)]
        return [torch.tensor(self._bucket_order(), dtype=torch.int64)]

    def load_replica_state(self, tensors: list[torch.Tensor]) -> None:
        [order] = tensors
        if self._hooks and bool((order >= 0).all()):
            self._ready_order = None
            self._regroup(order.tolist())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.compression is not None and "compressor" in state:
            self.compression.load_state_dict(state["compressor"])
        if "bucket_order" in state and self._hooks:
            # The buckets of the run this one continues: where a gradient sits in a bucket decides
            # the order gloo adds the workers' values in (with 3 or more), so other buckets would
            # round differently and the resumed run would drift from the uninterrupted one.
            self._ready_order = None
            self._regroup(state["bucket_order"].tolist())

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for bucket in self.buckets:  # pending work holds its group's connections open
            bucket.handle, bucket.doubling = None, False
        if self.hierarchy is not None:
            self.hierarchy.close()
