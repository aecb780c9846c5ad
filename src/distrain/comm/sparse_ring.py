"""Summing sparse vectors over all workers: a sparse ring all-reduce, and an all-gather to compare.

Each worker holds a sparse vector of ``numel`` elements as ``(indices, values)``; every worker
may keep a different number of elements. Both collectives leave every worker with the same dense
sum.

**Ring** (the group top-k patent's method). The index range is split into n chunks. Ring
scatter-reduce: in each of n - 1 rounds every worker sends one chunk to its successor and adds the
chunk it receives into its own copy on matching indices (the union of the indices survives), so
chunks fill in as they travel; then each worker holds one fully reduced chunk. Ring all-gather:
n - 1 more rounds forward the reduced chunks, and each receiver replaces its copy. A chunk whose
fill-in makes the dense encoding smaller switches to it.

**All-gather**. Each worker's whole sparse vector is all-gathered (padded to the longest) by the
backend; every worker then sums all n in rank order. Two collectives instead of 2(n - 1) rounds
of messages, but each worker receives n - 1 whole vectors where the ring's chunks shrink.

**Messages** are a fixed 24-byte header, int64 ``[encoding, count, element_size]``, then one
body whose size the receiver computes from the header (checked first) and the chunk length it
already knows:

* ``DENSE`` (count = chunk length): the values;
* ``SPARSE`` (count = nnz): indices are sorted and split at multiples of ``BLOCK`` = 32768;
  the body is int32 counts per block (padded to 8 bytes), the values, then int16 offsets inside
  the blocks, so an index costs 2 bytes instead of 8.

Every tensor goes through the :class:`~distrain.comm.transport.Transport`, so the byte counters
see exactly what is sent. Only tensors cross the wire. Messages are built and read in host memory
(a sparse vector on the GPU is copied to the CPU first and its sum copied back): gloo's sends and
all-gathers of bytes work on host memory, and the headers are read there anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distrain.comm.transport import Handle, Transport
from distrain.errors import DistrainError

DENSE, SPARSE = 0, 1
BLOCK = 2**15
HEADER_NUMEL = 3
HEADER_BYTES = HEADER_NUMEL * 8


class ProtocolError(DistrainError, ValueError):
    """A peer sent a message that does not fit what this worker expects."""


def blocks(length: int) -> int:
    return -(-length // BLOCK)


def counts_nbytes(length: int) -> int:
    """Bytes of the int32 block counts, padded to 8 so the values after them stay aligned."""
    return 8 * (-(-blocks(length) // 2))


def body_nbytes(encoding: int, count: int, length: int, element_size: int) -> int:
    """Body bytes of a message for a chunk of ``length`` elements."""
    if encoding == DENSE:
        return length * element_size
    return counts_nbytes(length) + count * (element_size + 2)


def message_nbytes(nnz: int, length: int, element_size: int) -> int:
    """Header plus body of the smaller encoding of a chunk with ``nnz`` nonzeros."""
    return HEADER_BYTES + min(body_nbytes(DENSE, length, length, element_size),
                              body_nbytes(SPARSE, nnz, length, element_size))


@dataclass
class Chunk:
    """A slice of a flat vector: dense ``values``, or ``values`` at sorted unique ``indices``."""

    length: int
    values: torch.Tensor
    indices: torch.Tensor | None = None

    @property
    def nnz(self) -> int:
        return self.length if self.indices is None else self.indices.numel()

    def add(self, other: Chunk) -> Chunk:
        """The sum of two chunks of the same slice; indices are the union of both."""
        if self.indices is None and other.indices is None:
            return Chunk(self.length, self.values + other.values)
        if self.indices is None or other.indices is None:
            dense, sparse = (self, other) if self.indices is None else (other, self)
            return Chunk(self.length, dense.values.index_add(0, sparse.indices, sparse.values))
        indices, values = coalesce(torch.cat([self.indices, other.indices]), torch.cat([self.values, other.values]))
        return Chunk(self.length, values, indices).compact()

    def compact(self) -> Chunk:
        """Switch to dense when that is no larger on the wire."""
        if self.indices is None:
            return self
        e = self.values.element_size()
        if body_nbytes(DENSE, self.length, self.length, e) <= body_nbytes(SPARSE, self.nnz, self.length, e):
            return Chunk(self.length, self.to_dense())
        return self

    def to_dense(self) -> torch.Tensor:
        if self.indices is None:
            return self.values
        return torch.zeros(self.length, dtype=self.values.dtype, device=self.values.device).index_add_(
            0, self.indices, self.values)


def coalesce(indices: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted unique indices, with the values of repeated indices summed."""
    unique, inverse = torch.unique(indices, sorted=True, return_inverse=True)
    if unique.numel() == indices.numel():
        order = torch.argsort(indices)
        return indices[order], values[order]
    return unique, torch.zeros(unique.numel(), dtype=values.dtype, device=values.device).index_add_(0, inverse, values)


def split_chunks(indices: torch.Tensor, values: torch.Tensor, numel: int, n: int) -> tuple[list[Chunk], list[int]]:
    """Split a sparse vector into ``n`` chunks by index range; returns the chunks and their starts."""
    indices, values = coalesce(indices.reshape(-1).long(), values.reshape(-1))
    if indices.numel() and (int(indices[0]) < 0 or int(indices[-1]) >= numel):
        raise ValueError(f"indices must be in [0, {numel}), got {int(indices[0])}..{int(indices[-1])}")
    starts = [c * numel // n for c in range(n + 1)]
    cuts = torch.searchsorted(indices, torch.tensor(starts, dtype=indices.dtype, device=indices.device)).tolist()
    chunks = []
    for c in range(n):
        lo, hi = cuts[c], cuts[c + 1]
        chunks.append(Chunk(starts[c + 1] - starts[c], values[lo:hi], indices[lo:hi] - starts[c]).compact())
    return chunks, starts


# -- messages ----------------------------------------------------------------------------------


@dataclass
class Message:
    header: torch.Tensor
    body: torch.Tensor

    @property
    def nbytes(self) -> int:
        return HEADER_BYTES + self.body.numel()


def encode(chunk: Chunk) -> Message:
    """The wire form of a chunk: header and one uint8 body."""
    e = chunk.values.element_size()
    values = chunk.values.contiguous()
    if chunk.indices is None:
        header = torch.tensor([DENSE, chunk.length, e], dtype=torch.int64)
        return Message(header, values.view(torch.uint8))
    block = torch.div(chunk.indices, BLOCK, rounding_mode="floor")
    counts = torch.bincount(block, minlength=counts_nbytes(chunk.length) // 4).to(torch.int32)
    offsets = (chunk.indices - block * BLOCK).to(torch.int16)
    # int32 counts, then the values, then int16 offsets: every part starts aligned for its view.
    body = torch.cat([counts.view(torch.uint8), values.view(torch.uint8), offsets.view(torch.uint8)])
    return Message(torch.tensor([SPARSE, chunk.nnz, e], dtype=torch.int64), body)


def check_header(header: torch.Tensor, length: int, dtype: torch.dtype) -> int:
    """Body bytes announced by ``header`` for a chunk of ``length``; ProtocolError if it does not fit."""
    encoding, count, element_size = (int(v) for v in header.tolist())
    expected = torch.empty((), dtype=dtype).element_size()
    if element_size != expected:
        raise ProtocolError(f"peer sent {element_size}-byte values, expected {expected}-byte {dtype}")
    if encoding == DENSE and count != length:
        raise ProtocolError(f"dense message of {count} values for a chunk of {length}")
    if encoding == SPARSE and not (0 <= count <= length):
        raise ProtocolError(f"sparse message with {count} nonzeros for a chunk of {length}")
    if encoding not in (DENSE, SPARSE):
        raise ProtocolError(f"unknown encoding {encoding}")
    return body_nbytes(encoding, count, length, element_size)


def decode(message: Message, length: int, dtype: torch.dtype) -> Chunk:
    """The chunk a (header-checked) message holds; ProtocolError on inconsistent indices."""
    encoding, count, e = (int(v) for v in message.header.tolist())
    body = message.body
    if encoding == DENSE:
        return Chunk(length, body.view(dtype))
    nb, start = blocks(length), counts_nbytes(length)
    counts = body[: 4 * nb].view(torch.int32).long()
    values = body[start : start + count * e].view(dtype)
    offsets = body[start + count * e :].view(torch.int16).long()
    if bool((counts < 0).any()) or int(counts.sum()) != count or bool((offsets < 0).any()):
        raise ProtocolError("sparse message with inconsistent block counts")
    indices = torch.repeat_interleave(torch.arange(nb, dtype=torch.int64) * BLOCK, counts) + offsets
    if count and (int(indices[-1]) >= length or bool((indices[1:] <= indices[:-1]).any())):
        raise ProtocolError("sparse message with indices out of range or out of order")
    return Chunk(length, values, indices)


def _wait(handles: list[Handle]) -> None:
    for handle in handles:
        handle.wait()


def swap(transport: Transport, outgoing: Message | None, length: int, dtype: torch.dtype) -> Message | None:
    """Send ``outgoing`` to the successor while receiving a message for a ``length`` chunk from the predecessor.

    Header and body leave back to back (point-to-point messages between two workers arrive in
    order), so a round costs one wait for the header and one for the body, not two exchanges.
    """
    sends = []
    if outgoing is not None:
        sends.append(transport.send(outgoing.header, transport.next_rank))
        if outgoing.body.numel():
            sends.append(transport.send(outgoing.body, transport.next_rank))
    incoming = None
    if length:
        header = torch.empty(HEADER_NUMEL, dtype=torch.int64)
        transport.recv(header, transport.prev_rank).wait()
        body = torch.empty(check_header(header, length, dtype), dtype=torch.uint8)
        if body.numel():
            transport.recv(body, transport.prev_rank).wait()
        incoming = Message(header, body)
    _wait(sends)
    return incoming


def send_sparse(transport: Transport, dst: int, indices: torch.Tensor, values: torch.Tensor, numel: int) -> int:
    """Send one sparse vector of ``numel`` elements to group rank ``dst``; returns bytes sent.

    The point-to-point form of the message format, e.g. for a worker pushing a compressed
    gradient shard to the parameter server that owns it (which calls :func:`recv_sparse`).
    """
    chunk, _ = split_chunks(indices.cpu(), values.cpu(), numel, 1)
    message = encode(chunk[0])
    sends = [transport.send(message.header, dst)]
    if message.body.numel():
        sends.append(transport.send(message.body, dst))
    _wait(sends)
    return message.nbytes


def recv_sparse(transport: Transport, src: int, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Receive what :func:`send_sparse` sent from group rank ``src``, as a dense tensor."""
    header = torch.empty(HEADER_NUMEL, dtype=torch.int64)
    _wait([transport.recv(header, src)])
    body = torch.empty(check_header(header, numel, dtype), dtype=torch.uint8)
    if body.numel():
        _wait([transport.recv(body, src)])
    return decode(Message(header, body), numel, dtype).to_dense()


# -- collectives -------------------------------------------------------------------------------


def sparse_ring_allreduce(transport: Transport, indices: torch.Tensor, values: torch.Tensor, numel: int) -> torch.Tensor:
    """Sum every worker's sparse vector (``values`` at ``indices`` of ``numel``) with a ring.

    Returns the dense sum (1-D, ``values.dtype``), bitwise the same on every worker: each chunk is
    summed by one worker and copied to the others.

    Example::

        idx, vals = payload                      # e.g. from GroupTopK(0.01).compress(grad, info)
        total = sparse_ring_allreduce(transport, idx, vals, grad.numel())
        grad.copy_(total.view_as(grad) / transport.world_size)
    """
    n, rank, device = transport.world_size, transport.rank, values.device
    chunks, starts = split_chunks(indices.cpu(), values.cpu(), numel, n)  # messages are built and read on the CPU
    dtype = values.dtype
    if n > 1:
        for k in range(n - 1):  # scatter-reduce
            send_idx, recv_idx = (rank - k) % n, (rank - k - 1) % n
            incoming = swap(transport, encode(chunks[send_idx]) if chunks[send_idx].length else None,
                            chunks[recv_idx].length, dtype)
            if incoming is not None:
                chunks[recv_idx] = chunks[recv_idx].add(decode(incoming, chunks[recv_idx].length, dtype))
        for k in range(n - 1):  # all-gather
            send_idx, recv_idx = (rank + 1 - k) % n, (rank - k) % n
            incoming = swap(transport, encode(chunks[send_idx]) if chunks[send_idx].length else None,
                            chunks[recv_idx].length, dtype)
            if incoming is not None:
                chunks[recv_idx] = decode(incoming, chunks[recv_idx].length, dtype)
    out = torch.empty(numel, dtype=dtype)
    for c, chunk in enumerate(chunks):
        out[starts[c] : starts[c + 1]] = chunk.to_dense()
    return out.to(device)


def sparse_allgather_allreduce(transport: Transport, indices: torch.Tensor, values: torch.Tensor, numel: int,
                               *, same_size: bool = False) -> torch.Tensor:
    """Sum every worker's sparse vector by all-gathering them whole, then adding in rank order.

    Two backend all-gathers: each worker's message size (8 bytes), then the messages, each padded
    to the longest (no padding when every worker keeps the same number of elements). Far fewer
    waits than the ring, more bytes when n is large or the workers' indices overlap. Returns the
    dense sum, bitwise the same on every worker.

    ``same_size=True`` promises that every worker keeps the same number of distinct indices (the
    same compressor and ratio on every worker): the messages then have the same size and the first
    all-gather is skipped, halving the latency-bound rounds. Every message's header is still
    checked against its size.
    """
    n, dtype, device = transport.world_size, values.dtype, values.device
    chunk, _ = split_chunks(indices.cpu(), values.cpu(), numel, 1)  # messages are built and read on the CPU
    message = encode(chunk[0])
    packed = torch.cat([message.header.view(torch.uint8), message.body])
    limit = HEADER_BYTES + body_nbytes(SPARSE, numel, numel, values.element_size())
    if same_size:
        lengths = [packed.numel()] * n
    else:
        size = torch.tensor([packed.numel()], dtype=torch.int64)
        sizes = [torch.empty_like(size) for _ in range(n)]
        transport.all_gather(sizes, size).wait()
        lengths = [int(s) for s in sizes]
    if any(not HEADER_BYTES <= length <= limit for length in lengths):
        raise ProtocolError(f"message sizes {lengths} outside [{HEADER_BYTES}, {limit}] for {numel} elements")
    padded = torch.zeros(max(lengths), dtype=torch.uint8)
    padded[: packed.numel()] = packed
    gathered = [torch.empty_like(padded) for _ in range(n)]
    transport.all_gather(gathered, padded).wait()
    out = torch.zeros(numel, dtype=dtype)
    for buffer, length in zip(gathered, lengths, strict=True):
        header = buffer[:HEADER_BYTES].view(torch.int64)
        if HEADER_BYTES + check_header(header, numel, dtype) != length:
            raise ProtocolError(f"a message of {length} bytes announces another size")
        part = decode(Message(header, buffer[HEADER_BYTES:length]), numel, dtype)
        if part.indices is None:
            out.add_(part.values)
        else:
            out.index_add_(0, part.indices, part.values)
    return out.to(device)


SPARSE_COLLECTIVES = {"ring": sparse_ring_allreduce, "allgather": sparse_allgather_allreduce}
"""``--sparse-collective`` names -> functions ``(transport, indices, values, numel) -> dense sum``."""
