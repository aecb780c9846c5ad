"""The sparse ring's message format: exact round trips, switch to dense, malformed messages rejected."""

from __future__ import annotations

import math

import pytest
import torch

from distrain.comm.sparse_ring import (
    BLOCK,
    DENSE,
    HEADER_BYTES,
    SPARSE,
    Chunk,
    Message,
    ProtocolError,
    check_header,
    decode,
    encode,
    split_chunks,
)


def sparse_chunk(length: int, nnz: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> Chunk:
    g = torch.Generator().manual_seed(seed)
    indices = torch.randperm(length, generator=g)[:nnz].sort().values
    return Chunk(length, torch.randn(nnz, generator=g).to(dtype), indices)


@pytest.mark.parametrize("length,nnz,dtype", [(10, 0, torch.float32), (100, 7, torch.float32),
                                              (3 * BLOCK + 5, 900, torch.float32), (BLOCK, 1, torch.float64),
                                              (1001, 33, torch.float16)])
def test_sparse_message_round_trips_exactly(length, nnz, dtype):
    chunk = sparse_chunk(length, nnz, dtype=dtype)
    message = encode(chunk)
    assert int(message.header[0]) == SPARSE and int(message.header[1]) == nnz
    e = chunk.values.element_size()
    assert check_header(message.header, length, dtype) == message.body.numel()
    counts_bytes = 8 * math.ceil(math.ceil(length / BLOCK) / 2)  # int32 per block, padded to 8
    assert message.nbytes == HEADER_BYTES + counts_bytes + nnz * (e + 2)
    back = decode(Message(message.header.clone(), message.body.clone()), length, dtype)
    assert torch.equal(back.indices, chunk.indices) and torch.equal(back.values, chunk.values)


def test_fill_in_switches_to_dense_only_when_smaller():
    assert Chunk(100, torch.ones(60), torch.arange(60)).compact().indices is not None  # 8 + 360 < 400
    assert Chunk(100, torch.ones(66), torch.arange(66)).compact().indices is None      # 8 + 396 >= 400
    a = Chunk(100, torch.ones(40), torch.arange(0, 80, 2))
    b = Chunk(100, torch.ones(40), torch.arange(1, 81, 2))
    total = a.add(b)
    assert total.indices is None and torch.equal(total.values, torch.cat([torch.ones(80), torch.zeros(20)]))
    dense = encode(total)
    assert int(dense.header[0]) == DENSE and dense.nbytes == HEADER_BYTES + 400


def test_add_sums_on_matching_indices_and_keeps_the_union():
    a = Chunk(1000, torch.tensor([1.0, 2.0, 3.0]), torch.tensor([5, 10, 700]))
    b = Chunk(1000, torch.tensor([10.0, 20.0]), torch.tensor([10, 999]))
    total = a.add(b)
    assert total.indices.tolist() == [5, 10, 700, 999] and total.values.tolist() == [1.0, 12.0, 3.0, 20.0]


def test_split_chunks_coalesces_and_splits_by_index_range():
    chunks, starts = split_chunks(torch.tensor([9, 0, 4, 4, 7]), torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]), 10, 3)
    assert starts == [0, 3, 6, 10]
    dense = torch.cat([c.to_dense() for c in chunks])
    assert dense.tolist() == [2.0, 0, 0, 0, 7.0, 0, 0, 5.0, 0, 1.0]


@pytest.mark.parametrize("header,words", [
    ([2, 3, 4], "encoding"), ([SPARSE, 101, 4], "nonzeros"), ([SPARSE, -1, 4], "nonzeros"),
    ([DENSE, 99, 4], "dense message"), ([SPARSE, 3, 8], "8-byte"),
])
def test_bad_headers_are_rejected_before_allocating(header, words):
    with pytest.raises(ProtocolError, match=words):
        check_header(torch.tensor(header), 100, torch.float32)


def test_inconsistent_bodies_are_rejected():
    message = encode(sparse_chunk(100, 5))
    counts = message.body[:4].view(torch.int32)
    counts[0] = 4  # says 4 nonzeros, header says 5
    with pytest.raises(ProtocolError, match="counts"):
        decode(message, 100, torch.float32)
    message = encode(Chunk(100, torch.ones(2), torch.tensor([3, 50])))
    message.body[-2:].view(torch.int16)[0] = 150  # index past the chunk
    with pytest.raises(ProtocolError, match="out of range"):
        decode(message, 100, torch.float32)
