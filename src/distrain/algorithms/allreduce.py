"""Synchronous data-parallel SGD: gradients averaged by all-reduce in buckets.

Buckets are filled in reverse parameter order (the order backward produces gradients), and with
gloo's collective each bucket's all-reduce starts from a gradient hook as soon as the bucket is
full, so communication overlaps the rest of the backward pass, as PyTorch DDP does. With
``--ring own`` the buckets go through our ring over point-to-point after backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distrain.algorithms.base import Algorithm, StepContext
from distrain.comm.ring import ring_all_reduce
from distrain.comm.transport import Handle, Transport


@dataclass
class Bucket:
    """Parameters whose gradients travel together in one flat buffer."""

    params: list[torch.nn.Parameter]
    flat: torch.Tensor
    sizes: list[int]
    ready: int = 0
    handle: Handle | None = None

    def gather_grads(self) -> None:
        grads = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=self.flat.dtype)
                 for p in self.params]
        torch.cat(grads, out=self.flat)

    def scatter_grads(self) -> None:
        for p, chunk in zip(self.params, self.flat.split(self.sizes), strict=True):
            if p.grad is None:
                p.grad = chunk.view_as(p).clone()
            else:
                p.grad.copy_(chunk.view_as(p))


def make_buckets(params: list[torch.nn.Parameter], bucket_bytes: float) -> list[Bucket]:
    """Group parameters, last layer first, into buckets of about ``bucket_bytes``."""
    if not params:
        return []
    groups: list[list[torch.nn.Parameter]] = [[]]
    size = 0
    for p in reversed(params):
        if size >= bucket_bytes:
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


class AllReduce(Algorithm):
    """Average gradients over all workers each step (the DDP / C-PSGD baseline)."""

    name = "allreduce"

    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, transport: Transport) -> None:
        super().setup(model, optimizer, transport)
        params = [p for p in model.parameters() if p.requires_grad]
        self.buckets = make_buckets(params, self.config.algo.bucket_mb * 2**20)
        self.own_ring = self.config.algo.ring == "own"
        self._hooks = []
        if transport.world_size > 1 and not self.own_ring:
            for bucket in self.buckets:
                for p in bucket.params:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._hook_for(bucket)))

    def _hook_for(self, bucket: Bucket):  # noqa: ANN202
        return lambda _param: self._grad_ready(bucket)

    def _grad_ready(self, bucket: Bucket) -> None:
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        bucket.gather_grads()
        bucket.handle = self.transport.all_reduce(bucket.flat)

    def after_backward(self, ctx: StepContext) -> None:
        world = self.transport.world_size
        if world == 1:
            return
        for bucket in self.buckets:
            if self.own_ring:
                bucket.gather_grads()
                ring_all_reduce(self.transport, bucket.flat)
            elif bucket.handle is None:  # some parameters got no gradient this step
                self._launch(bucket)
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
            bucket.flat.div_(world)
            bucket.scatter_grads()
            bucket.ready, bucket.handle = 0, None

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
