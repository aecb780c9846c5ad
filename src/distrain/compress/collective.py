"""The communicator: sum a tensor over all workers through a compressor, with the right collective.

The template of every compressed exchange is ``compensate -> compress -> update memory ->
exchange -> decompress``; the first three happen inside the compressor when it is wrapped in
:class:`~distrain.compress.error_feedback.ErrorFeedback`. Which collective carries the payload
follows from what the compressor declares:

* ``summable`` (none, fp16, bf16, random-k): all-reduce the payload tensors in place;
* ``sparse`` (top-k, group top-k): the sparse ring or the sparse all-gather of
  :mod:`distrain.comm.sparse_ring`, so each worker may keep a different number of elements;
* otherwise (QSGD, int8/int4, SparseLoCo): all-gather the payloads (equal sizes on every worker)
  and sum their decompressions in rank order.
"""

from __future__ import annotations

import torch

from distrain.comm.ring import ring_all_reduce
from distrain.comm.sparse_ring import SPARSE_COLLECTIVES
from distrain.comm.transport import Transport
from distrain.compress.base import CompressInfo, Compressor


def allreduce_compressed(transport: Transport, compressor: Compressor, tensor: torch.Tensor, info: CompressInfo,
                         *, sparse_collective: str = "ring", own_ring: bool = False) -> torch.Tensor:
    """Return the sum over workers of the decompressed ``compressor.compress(tensor)``.

    Every worker gets the same result, of ``tensor``'s shape and dtype. ``tensor`` itself may be
    overwritten (the identity compressor's payload is the tensor).

    Args:
        transport: this worker's transport; all workers call with the same shapes.
        compressor: any compressor, possibly wrapped in error feedback.
        tensor: this worker's tensor (e.g. the flat gradient).
        info: step, key, per-call ratio (sparse compressors accept a different ratio per worker).
        sparse_collective: ``"ring"`` or ``"allgather"`` for sparse payloads.
        own_ring: all-reduce summable payloads with our point-to-point ring instead of the backend.

    Example::

        compressor = build_compressor("group_topk:0.01")
        total = allreduce_compressed(transport, compressor, flat_grad, CompressInfo(step=step))
        flat_grad.copy_(total / transport.world_size)
    """
    payload, ctx = compressor.compress(tensor, info)
    world = transport.world_size
    if compressor.sparse:
        indices, values = payload
        if sparse_collective not in SPARSE_COLLECTIVES:
            raise ValueError(f"sparse_collective must be one of {sorted(SPARSE_COLLECTIVES)}, got {sparse_collective!r}")
        total = SPARSE_COLLECTIVES[sparse_collective](transport, indices, values, tensor.numel())
        return total.view(tensor.shape).to(tensor.dtype)
    if compressor.summable:
        if own_ring:
            for part in payload:
                ring_all_reduce(transport, part)
        else:
            for handle in [transport.all_reduce(part) for part in payload]:
                handle.wait()
        return compressor.decompress(payload, ctx)
    gathered = [[torch.empty_like(part) for _ in range(world)] for part in payload]
    for handle in [transport.all_gather(outs, part) for outs, part in zip(gathered, payload, strict=True)]:
        handle.wait()
    total = compressor.decompress([outs[0] for outs in gathered], ctx).clone()
    for r in range(1, world):
        total.add_(compressor.decompress([outs[r] for outs in gathered], ctx))
    return total
