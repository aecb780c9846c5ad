"""Compressed pushes to a parameter server: one self-describing message per gradient shard.

A worker compresses the gradient of each shard (error feedback keyed by the shard) and sends the
server one message: the sparse ring's int64 header ``[encoding, count, element_size]``
(:mod:`distrain.comm.sparse_ring`), then one uint8 body whose size the server computes from the
header and checks against the shard before allocating anything. Encodings:

* ``DENSE``: the shard's float32 values (the density warm-up, or a sparse push whose dense form
  is smaller);
* ``SPARSE``: block-coded indices and float32 values (top-k, group top-k, random-k); ``count``
  is the number of kept elements, which may differ per worker and per step (adaptive ratios);
* ``PACKED``: the payload tensors of a fixed-layout compressor (fp16, bf16, qsgd) back to back;
  ``count`` is the body's bytes, which must be the layout's size for the shard.

The server decodes each push to a dense shard gradient and sums them; what it sends back (the
parameters) stays dense.

Example::

    push = ShardPush(build_compressor("group_topk:0.01"))            # worker
    message = push.encode(grad[lo:hi], CompressInfo(step=step, key=shard, ratio=0.02))
    send_message(transport, message, server)
    decoder = PushDecoder(build_compressor("group_topk:0.01", error_feedback=False), hi - lo)
    grad = decoder.recv(transport, worker)                            # server
"""

from __future__ import annotations

import torch

from distrain.comm.sparse_ring import (
    DENSE,
    HEADER_NUMEL,
    SPARSE,
    Chunk,
    Message,
    ProtocolError,
    check_header,
    decode,
    encode,
    split_chunks,
)
from distrain.comm.transport import Handle, Transport
from distrain.compress.base import CompressInfo, Compressor, TensorMeta
from distrain.compress.momentum_correction import MomentumCorrection
from distrain.compress.registry import build_compressor

PACKED = 2


class ShardPush:
    """The worker side: compress a shard's gradient and encode it as one message.

    Args:
        compressor: e.g. from :func:`~distrain.compress.registry.build_compressor`, usually with
            error feedback (its residuals are kept per ``info.key``, i.e. per shard), or a
            :class:`~distrain.compress.momentum_correction.MomentumCorrection` when the workers
            apply the momentum and the servers step without it.
    """

    def __init__(self, compressor: Compressor) -> None:
        self.compressor = compressor

    def encode(self, shard: torch.Tensor, info: CompressInfo, *, dense: bool = False) -> Message:
        """The push message for ``shard`` (1-D float32); ``dense`` sends it uncompressed (warm-up)."""
        c = self.compressor
        if dense:
            if isinstance(c, MomentumCorrection):  # the server has no momentum: send the velocity
                shard = c.accumulate(shard, info.key)
            return encode(Chunk(shard.numel(), shard.contiguous()))
        payload, ctx = c.compress(shard, info)
        if c.sparse:
            indices, values = payload
        elif c.ratio is not None:  # random-k (indices from a seed), sparseloco: the decoded values
            dense = c.decompress(payload, ctx).reshape(-1)
            indices = dense.nonzero().view(-1)
            values = dense[indices]
        else:
            body = torch.cat([p.contiguous().reshape(-1).view(torch.uint8) for p in payload])
            return Message(torch.tensor([PACKED, body.numel(), 1], dtype=torch.int64), body)
        chunks, _ = split_chunks(indices, values.to(shard.dtype), shard.numel(), 1)
        return encode(chunks[0])


class PushDecoder:
    """The server side: receive and decode one worker's push for a shard of ``numel`` elements.

    Args:
        compressor: the workers' compressor, without error feedback (fixed-layout payloads are
            decompressed by it).
        numel: elements of the shard.
    """

    def __init__(self, compressor: Compressor, numel: int, dtype: torch.dtype = torch.float32) -> None:
        self.compressor, self.numel, self.dtype = compressor, numel, dtype
        self.layout: list[tuple[torch.dtype, int]] = []
        if not compressor.sparse and compressor.ratio is None:
            template, _ = compressor.compress(torch.zeros(numel, dtype=dtype), CompressInfo())
            self.layout = [(t.dtype, t.numel()) for t in template]
        self.packed_nbytes = sum(n * torch.empty((), dtype=d).element_size() for d, n in self.layout)

    @classmethod
    def of(cls, spec: str, numel: int, seed: int = 0) -> PushDecoder:
        """The decoder of pushes that workers compress with ``spec`` (their compressor, built
        without error feedback and with the run's ``seed``) for a shard of ``numel`` elements."""
        return cls(build_compressor(spec, error_feedback=False, seed=seed), numel)

    def body_nbytes(self, header: torch.Tensor) -> int:
        """Body bytes ``header`` announces; ProtocolError unless it fits this shard and compressor."""
        encoding, count, element_size = (int(v) for v in header.tolist())
        if encoding == PACKED:
            if not self.layout or count != self.packed_nbytes or element_size != 1:
                raise ProtocolError(f"packed push of {count} bytes, expected {self.packed_nbytes} "
                                    f"for {self.numel} elements with {self.compressor.name}")
            return count
        if encoding == SPARSE and not self.compressor.sparse and self.compressor.ratio is None:
            raise ProtocolError(f"sparse push, but {self.compressor.name} payloads are not sparse")
        return check_header(header, self.numel, self.dtype)

    def decode(self, message: Message) -> torch.Tensor:
        """The dense shard gradient of a message whose header passed :meth:`body_nbytes`."""
        encoding = int(message.header[0])
        if encoding in (DENSE, SPARSE):
            return decode(message, self.numel, self.dtype).to_dense()
        parts, offset = [], 0
        for dtype, n in self.layout:
            size = n * torch.empty((), dtype=dtype).element_size()
            parts.append(message.body[offset : offset + size].view(dtype))
            offset += size
        meta = TensorMeta(torch.Size([self.numel]), self.dtype, torch.device("cpu"))
        return self.compressor.decompress(parts, meta).reshape(-1)

    def recv(self, transport: Transport, src: int) -> torch.Tensor:
        """Receive one push from group rank ``src`` and return the dense shard gradient."""
        header = torch.empty(HEADER_NUMEL, dtype=torch.int64)
        transport.recv(header, src).wait()
        body = torch.empty(self.body_nbytes(header), dtype=torch.uint8)
        if body.numel():
            transport.recv(body, src).wait()
        return self.decode(Message(header, body))


def send_message(transport: Transport, message: Message, dst: int) -> list[Handle]:
    """Start sending ``message`` (header, then body) to group rank ``dst``; returns the handles."""
    handles = [transport.send(message.header, dst)]
    if message.body.numel():
        handles.append(transport.send(message.body, dst))
    return handles
