"""The communicator: sum a tensor over all workers through a compressor, with the right collective.

The template of every compressed exchange is ``compensate -> compress -> update memory ->
exchange -> decompress``; the first three happen inside the compressor when it is wrapped in
:class:`~distrain.compress.error_feedback.ErrorFeedback`. Which collective carries the payload
follows from what the compressor declares:

* ``summable`` (none, fp16, bf16, random-k): all-reduce the payload tensors in place;
* ``sparse`` (top-k, group top-k): the sparse ring or the sparse all-gather of
  :mod:`distrain.comm.sparse_ring`, so each worker may keep a different number of elements;
* ``requantizes`` (int8/int4) on a tensor of at least as many blocks as workers: a ring whose
  every message is quantized (:func:`requantizing_ring`): 2(n-1)/n of the quantized tensor per
  worker, where gathering sends (n-1) times all of it;
* otherwise (QSGD, SparseLoCo, small int8/int4 tensors): all-gather the payloads (equal sizes on
  every worker) and sum their decompressions in rank order.
"""

from __future__ import annotations

import math

import torch

from distrain.comm.ring import ring_all_reduce, swap
from distrain.comm.sparse_ring import SPARSE_COLLECTIVES
from distrain.comm.transport import Transport
from distrain.compress.base import CompressInfo, Compressor, TensorMeta


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
    world = transport.world_size
    quantizer = getattr(compressor, "inner", compressor)
    if getattr(quantizer, "requantizes", False) and world > 1 and math.ceil(tensor.numel() / quantizer.block) >= world:
        payload, ctx = compressor.compress(tensor, info)  # this worker's quantization, with its error feedback
        mine = compressor.decompress(payload, ctx).reshape(-1).to("cpu", torch.float32)  # point-to-point: CPU
        return requantizing_ring(transport, quantizer, mine).view(tensor.shape).to(tensor.device, tensor.dtype)
    payload, ctx = compressor.compress(tensor, info)
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


def requantizing_ring(transport: Transport, quantizer: Compressor, flat: torch.Tensor) -> torch.Tensor:
    """The sum over workers of ``flat`` (1-D float32) with every message quantized by ``quantizer``
    (a per-block quantizer: ``block``, ``compress``/``decompress``): a ring reduce-scatter whose
    partial sums are decoded, added to this worker's chunk and quantized again before each hop,
    then a ring all-gather that passes each chunk's quantized sum on as it came. Every worker
    decodes the same codes, so all get the same result; each sends 2(n-1)/n of the quantized
    tensor (about a quarter of a float32 ring's bytes with int8). Chunks hold whole blocks, so a
    tensor already quantized by the same quantizer loses nothing at its first hop; each later hop
    rounds a partial sum by at most half its block's step."""
    n, rank = transport.world_size, transport.rank
    block = int(quantizer.block)  # type: ignore[attr-defined]
    blocks = math.ceil(flat.numel() / block)
    edges = [min(flat.numel(), blocks * i // n * block) for i in range(n + 1)]
    chunks = [flat[edges[i]:edges[i + 1]].clone() for i in range(n)]

    def size(i: int) -> int:  # the packed payload's bytes for chunk i
        return quantizer.wire_bytes(chunks[i].numel()) if chunks[i].numel() else 0

    def encode(x: torch.Tensor) -> torch.Tensor:  # codes and scales, packed into one message
        if not x.numel():
            return torch.empty(0, dtype=torch.uint8)
        codes, scales = quantizer.compress(x, CompressInfo())[0]
        return torch.cat([codes.view(torch.uint8), scales.float().view(torch.uint8)])

    def decode(packed: torch.Tensor, numel: int) -> torch.Tensor:
        if not numel:
            return torch.empty(0, dtype=torch.float32)
        scale_bytes = 4 * math.ceil(numel / block)
        codes = packed[: packed.numel() - scale_bytes]
        codes = codes if quantizer.bits == 4 else codes.view(torch.int8)  # type: ignore[attr-defined]
        scales = packed[packed.numel() - scale_bytes:].clone().view(torch.float32)
        return quantizer.decompress([codes, scales], TensorMeta(torch.Size([numel]), torch.float32, flat.device))

    for k in range(n - 1):  # reduce-scatter: this worker ends with chunk (rank + 1) % n summed
        send_idx, recv_idx = (rank - k) % n, (rank - k - 1) % n
        incoming = torch.empty(size(recv_idx), dtype=torch.uint8)
        swap(transport, encode(chunks[send_idx]), incoming)
        chunks[recv_idx].add_(decode(incoming, chunks[recv_idx].numel()))
    packed: list[torch.Tensor] = [torch.empty(size(i), dtype=torch.uint8) for i in range(n)]
    packed[(rank + 1) % n] = encode(chunks[(rank + 1) % n])
    for k in range(n - 1):  # all-gather of the summed chunks' codes, forwarded unchanged
        send_idx, recv_idx = (rank + 1 - k) % n, (rank - k) % n
        swap(transport, packed[send_idx], packed[recv_idx])
    return torch.cat([decode(packed[i], chunks[i].numel()) for i in range(n)])
