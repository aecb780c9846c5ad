"""Ring collectives over point-to-point messages, so every byte is ours to count and shape.

A ring all-reduce is a ring reduce-scatter (n-1 rounds: send one chunk to the successor, add
the chunk received from the predecessor) followed by a ring all-gather (n-1 rounds: forward the
fully reduced chunk, replace the copy). Each worker sends 2(n-1)/n of the tensor in total.
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
