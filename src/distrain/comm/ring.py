"""Collectives over point-to-point messages, so every byte is ours to count and shape.

A ring all-reduce is a ring reduce-scatter (n-1 rounds: send one chunk to the successor, add
the chunk received from the predecessor) followed by a ring all-gather (n-1 rounds: forward the
fully reduced chunk, replace the copy). Each worker sends 2(n-1)/n of the tensor in total.

A recursive-doubling all-reduce (:func:`doubling_all_reduce`) takes log2(n) rounds instead of
2(n-1), each a swap of the whole tensor with one partner, so it suits small tensors, whose
all-reduce costs latency rather than bandwidth.
"""

from __future__ import annotations

import torch

from distrain.comm.transport import Transport


def swap(transport: Transport, outgoing: torch.Tensor, incoming: torch.Tensor) -> None:
    """Send to the successor while receiving from the predecessor; both sides know the sizes."""
    handles = []
    # Receive first: with gloo, when both ends of a pair post their send before their receive,
    # the two directions take turns (a 2-worker ring on a capped link took twice its bound).
    if incoming.numel():
        handles.append(transport.recv(incoming, transport.prev_rank))
    if outgoing.numel():
        handles.append(transport.send(outgoing, transport.next_rank))
    for handle in handles:
        handle.wait()


def ring_reduce_scatter(transport: Transport, chunks: list[torch.Tensor]) -> int:
    """Sum ``chunks`` (one per rank, in place) so this rank ends with one fully reduced chunk.

    Returns the index of the chunk this rank holds reduced: ``(rank + 1) % n``.
    """
    n, rank = transport.world_size, transport.rank
    scratch = torch.empty(max(c.numel() for c in chunks), dtype=chunks[0].dtype)
    for k in range(n - 1):
        send_idx, recv_idx = (rank - k) % n, (rank - k - 1) % n
        incoming = scratch[: chunks[recv_idx].numel()]
        swap(transport, chunks[send_idx], incoming)
        chunks[recv_idx].add_(incoming.view_as(chunks[recv_idx]))
    return (rank + 1) % n


def ring_all_gather(transport: Transport, chunks: list[torch.Tensor]) -> None:
    """Starting from ``chunks[(rank + 1) % n]`` being final on each rank, make all chunks final."""
    n, rank = transport.world_size, transport.rank
    for k in range(n - 1):
        send_idx, recv_idx = (rank + 1 - k) % n, (rank - k) % n
        swap(transport, chunks[send_idx], chunks[recv_idx])


def ring_all_reduce(transport: Transport, flat: torch.Tensor) -> None:
    """Sum a contiguous 1-D tensor over all ranks in place, with a ring of point-to-point sends."""
    if transport.world_size == 1:
        return
    if not flat.is_contiguous() or flat.dim() != 1:
        raise ValueError("ring_all_reduce needs a contiguous 1-D tensor")
    chunks = list(flat.tensor_split(transport.world_size))
    ring_reduce_scatter(transport, chunks)
    ring_all_gather(transport, chunks)


def doubling_all_reduce(transport: Transport, flat: torch.Tensor) -> None:
    """Sum ``flat`` over all ranks in place by recursive doubling (Thakur, Rabenseifner and
    Gropp 2005): in round k each rank swaps its partial sum with the rank whose index differs in
    bit k and adds what it received; log2(n) rounds where a ring takes 2(n-1), each sending the
    whole tensor (so it suits a small one). With n not a power of two, the first 2r ranks
    (r = n - 2^floor(log2 n)) pair up first: each even one hands its tensor to the odd one next to
    it, sits out the rounds and takes the sum back at the end (two rounds more).

    Every rank ends with the same bits: a round's two partners add the same two tensors, and
    floating-point addition is commutative (a + b is b + a exactly).

    Example::

        grad = torch.cat([p.grad.reshape(-1) for p in params])
        doubling_all_reduce(transport, grad)  # every rank: the sum over ranks
    """
    n, rank = transport.world_size, transport.rank
    if n == 1:
        return
    if not flat.is_contiguous() or flat.dim() != 1:
        raise ValueError("doubling_all_reduce needs a contiguous 1-D tensor")
    power = 1 << (n.bit_length() - 1)
    extra = n - power
    incoming = torch.empty_like(flat)
    if rank < 2 * extra:
        if rank % 2 == 0:  # hands its tensor to rank + 1 and takes the sum back from it
            transport.send(flat, rank + 1).wait()
            transport.recv(flat, rank + 1).wait()
            return
        transport.recv(incoming, rank - 1).wait()
        flat.add_(incoming)
        index = rank // 2
    else:
        index = rank - extra
    bit = 1
    while bit < power:
        partner = index ^ bit
        peer = 2 * partner + 1 if partner < extra else partner + extra
        transport.exchange(flat, incoming, peer).wait()
        flat.add_(incoming)
        bit <<= 1
    if rank < 2 * extra:
        transport.send(flat, rank - 1).wait()
