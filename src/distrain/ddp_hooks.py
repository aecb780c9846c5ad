"""distrain's compression as standard PyTorch DDP communication hooks, for plain-DDP users.

A hook is a function ``hook(state, bucket) -> Future[Tensor]`` registered with
``ddp_model.register_comm_hook(state, hook)``; DDP calls it for every gradient bucket and copies
the future's value (the averaged flat gradient) back into the parameters' gradients.

A backend thread (gloo's) must never need the GIL while the interpreter may be exiting: Python
then ends that thread inside C++ and the process aborts ("terminate called without an active
exception") after a run that went well. It needs the GIL to run or release a Python callback,
and to drop the last reference to a collective's work, whose tensors are Python objects. So the
hook chains no ``Future.then`` callback: it starts each bucket's collectives asynchronously and,
in the call for the iteration's last bucket, waits for all of them and completes every bucket's
future itself; and the state keeps the works of the last iteration, so that the training
thread releases them (at the next iteration, or with the state) rather than the gloo thread
that has just completed them.

Example::

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from distrain.ddp_hooks import GroupTopKState, group_topk_hook

    dist.init_process_group("gloo")          # or "nccl"; e.g. under torchrun
    ddp_model = DDP(model)
    state = GroupTopKState(process_group=None, ratio=0.01, momentum=0.9)
    ddp_model.register_comm_hook(state, group_topk_hook)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1, momentum=0.0)  # the hook has it
    # ... train as usual: loss.backward() now exchanges 1% of each bucket's gradient
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations against the real
# ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]`` objects, not strings.
import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from distrain.compress.base import check_ratio
from distrain.compress.group_topk import DEFAULT_GROUP, group_topk_indices

log = logging.getLogger(__name__)

__all__ = ["GroupTopKState", "group_topk_hook"]


class GroupTopKState:
    """Settings and error-feedback memory of :func:`group_topk_hook`.

    Args:
        process_group: the group to average in; ``None`` means the default (world) group.
        ratio: kept fraction in every group, 0 < ratio <= 1.
        group: elements per group: each bucket's flat gradient is split into groups of this size
            and each group keeps its round(ratio * group) (at least 1) largest magnitudes; default
            2**18 (see :data:`~distrain.compress.group_topk.DEFAULT_GROUP`).
        error_feedback: keep what was dropped and add it to the next step's gradient (per
            bucket), so compressed training converges like uncompressed training.
        start_iter: iterations of plain all-reduce before compression starts. DDP rebuilds its
            buckets after the first iteration, so error-feedback memory kept per bucket index is
            only meaningful from the second one on (as in PyTorch's ``PowerSGDState``).
        momentum: momentum correction (Deep Gradient Compression): each worker applies this
            momentum to its gradient before compressing, and zeroes the velocity of what it sent,
            so a coordinate held back for many steps does not arrive amplified by the optimizer's
            momentum. Build the optimizer without momentum then. At 1% this is what makes a small
            model train (e.g. MNIST-1D's 1-D CNN: 0.96 test accuracy with it, 0.64 without, in
            distrain's own all-reduce). 0 leaves momentum to the optimizer.

    Example::

        state = GroupTopKState(process_group=None, ratio=0.01, momentum=0.9)
        ddp_model.register_comm_hook(state, group_topk_hook)
        optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1, momentum=0.0)
    """

    __slots__ = ["process_group", "ratio", "group", "error_feedback", "start_iter", "momentum", "iter", "residuals",
                 "velocities", "pending", "finished"]

    def __init__(self, process_group: dist.ProcessGroup | None = None, ratio: float = 0.01, group: int = DEFAULT_GROUP,
                 error_feedback: bool = True, start_iter: int = 2, momentum: float = 0.0) -> None:
        # Hyperparameters: fixed for the whole run.
        self.process_group = process_group
        self.ratio = check_ratio(ratio)
        if isinstance(group, bool) or int(group) != group or group < 1:
            raise ValueError(f"group must be an integer >= 1, got {group!r}")
        self.group = int(group)
        self.error_feedback = error_feedback
        if start_iter < 0:
            raise ValueError(f"start_iter must be >= 0, got {start_iter}")
        if error_feedback and start_iter < 2:
            raise ValueError("start_iter must be >= 2 with error feedback: DDP rebuilds its buckets after the "
                             "first iteration, which would mix up the memory kept per bucket")
        self.start_iter = start_iter
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        self.momentum = float(momentum)
        if self.ratio == 1.0:
            warnings.warn("GroupTopKState(ratio=1.0) keeps every element: it sends more than a plain all-reduce",
                          stacklevel=2)
        # Mutable state: changes every iteration.
        self.iter = 0
        self.residuals: dict[int, torch.Tensor] = {}
        self.velocities: dict[int, torch.Tensor] = {}
        # This iteration's buckets whose collectives are in flight, completed at the last bucket;
        # then kept in ``finished`` until the next iteration's are (see the module docstring).
        self.pending: list[_Pending] = []
        self.finished: list[_Pending] = []

    def maybe_increase_iter(self, bucket: dist.GradBucket) -> None:
        if bucket.is_last():
            self.iter += 1
            if self.iter == self.start_iter:
                log.info("group top-k compression starts at iteration %d", self.iter)

    def state_dict(self) -> dict[str, Any]:
        """The mutable state, tensors and ints only (for ``torch.save`` / ``weights_only`` loads)."""
        return {"iter": self.iter, **{f"residual.{k}": r for k, r in self.residuals.items()},
                **{f"velocity.{k}": v for k, v in self.velocities.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iter = int(state["iter"])
        self.residuals = {int(k.split(".", 1)[1]): v for k, v in state.items() if k.startswith("residual.")}
        self.velocities = {int(k.split(".", 1)[1]): v for k, v in state.items() if k.startswith("velocity.")}

    def velocity(self, key: int, grad: torch.Tensor) -> torch.Tensor:
        """Fold ``grad`` into the velocity of bucket ``key`` and return it (not a copy)."""
        velocity = self.velocities.get(key)
        if velocity is None or velocity.shape != grad.shape:  # first use, or DDP rebuilt its buckets
            velocity = grad.clone()
        else:
            velocity.mul_(self.momentum).add_(grad)
        self.velocities[key] = velocity
        return velocity


def one_dimensional_positions(bucket: dist.GradBucket) -> torch.Tensor:
    """Positions (int64) in the bucket's flat buffer of its parameters of at most one dimension."""
    parts, offset = [], 0
    for p in bucket.parameters():
        if p.dim() <= 1:
            parts.append(torch.arange(offset, offset + p.numel()))
        offset += p.numel()
    return torch.cat(parts).to(bucket.buffer().device) if parts else torch.zeros(0, dtype=torch.int64)


class _Pending:
    """One bucket's collectives in flight, and how to turn their result into its averaged gradient."""

    __slots__ = ["works", "finish", "future", "flat"]

    def __init__(self, works: list[Any], finish: Callable[[], None] | None, flat: torch.Tensor) -> None:
        self.works = works
        self.finish = finish  # None: the collective leaves the average in ``flat`` itself
        self.flat = flat
        self.future: torch.futures.Future[torch.Tensor] = (
            torch.futures.Future(devices=[flat.device]) if flat.is_cuda else torch.futures.Future())


def _complete(state: GroupTopKState) -> None:
    """Wait for every bucket's collectives, in order, and complete its future (on this thread)."""
    pending, state.pending = state.pending, []
    try:
        for item in pending:
            for work in item.works:
                work.wait()  # raises if the collective failed
            if item.finish is not None:
                item.finish()
            item.future.set_result(item.flat)
    except Exception as exc:
        for item in pending:
            if not item.future.done():
                item.future.set_exception(exc)
        raise
    finally:
        # A backend thread lets go of a work just after completing it: keeping the works until
        # the next iteration leaves their release, and their tensors', to this thread.
        state.finished = pending


def group_topk_hook(state: GroupTopKState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a bucket's gradient from its group top-k sparsification on every worker.

    Each worker adds its error-feedback residual to the bucket, keeps the largest magnitudes of
    every group (one-dimensional parameters whole), and all-gathers (indices, values); every
    worker then sums the n sparse gradients in rank order and divides by n, so all replicas get
    the same gradient. The collectives of every bucket overlap the rest of the backward pass;
    the call for the last bucket waits for them and completes all the iteration's futures.

    Args:
        state: a :class:`GroupTopKState`.
        bucket: the gradient bucket DDP hands to the hook.

    Returns:
        A future of the averaged flat gradient of the bucket.

    Example::

        state = GroupTopKState(process_group=None, ratio=0.01)
        ddp_model.register_comm_hook(state, group_topk_hook)
    """
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    flat = bucket.buffer()
    key = bucket.index()
    if key == 0:  # DDP hands buckets over in index order: anything pending is from a failed iteration
        state.finished += state.pending
        state.pending = []
    velocity = state.velocity(key, flat) if state.momentum else None
    if state.iter < state.start_iter:
        if velocity is not None:  # the optimizer has no momentum: average the velocities
            flat.copy_(velocity)
        flat.div_(world)
        pending = _Pending([dist.all_reduce(flat, group=group, async_op=True)], None, flat)
    else:
        pending = _start_sparse_exchange(state, bucket, key, velocity, group, world)
    state.pending.append(pending)
    state.maybe_increase_iter(bucket)
    if bucket.is_last():
        _complete(state)
    return pending.future


def _start_sparse_exchange(state: GroupTopKState, bucket: dist.GradBucket, key: int,
                           velocity: torch.Tensor | None, group: Any, world: int) -> _Pending:
    """Compress the bucket (error feedback, momentum masking) and start the all-gathers."""
    flat = bucket.buffer()
    grad = velocity if velocity is not None else flat
    residual = state.residuals.get(key) if state.error_feedback else None
    compensated = grad + residual if residual is not None and residual.shape == grad.shape else grad.clone()
    # One-dimensional tensors (biases, norm scales) travel whole, as in PowerSGD's hook: few
    # elements that sparsification would starve. They are zeroed where top-k picks, so a pick
    # there adds nothing, and every worker sends the same number of elements.
    dense = one_dimensional_positions(bucket)
    selectable = compensated.index_fill(0, dense, 0.0) if dense.numel() else compensated
    top = group_topk_indices(selectable, state.ratio, state.group)
    indices, values = torch.cat([top, dense]), torch.cat([selectable[top], compensated[dense]])
    sent = torch.zeros_like(flat, dtype=torch.bool).index_fill_(0, top, True).index_fill_(0, dense, False)
    if velocity is not None and state.ratio < 1.0:
        velocity.masked_fill_(sent, 0.0)  # momentum factor masking: what was sent stops pushing
    if state.error_feedback:
        compensated.masked_fill_(sent, 0.0).index_fill_(0, dense, 0.0)
        state.residuals[key] = compensated

    # Every worker has the same bucket sizes and ratio, hence the same k: plain all-gathers fit.
    all_indices = [torch.empty_like(indices) for _ in range(world)]
    all_values = [torch.empty_like(values) for _ in range(world)]
    works = [dist.all_gather(all_indices, indices, group=group, async_op=True),
             dist.all_gather(all_values, values, group=group, async_op=True)]

    def average() -> None:
        flat.zero_()
        for idx, val in zip(all_indices, all_values, strict=True):
            flat.index_add_(0, idx, val)
        flat.div_(world)

    return _Pending(works, average, flat)
