"""The sparse ring and the sparse all-gather sum every worker's sparse vector, and count exact bytes.

One spawn of 8 processes covers n = 2..8 through subgroups (a spawn costs seconds on 2 cores).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist

from distrain.comm import Transport
from distrain.comm.sparse_ring import BLOCK, sparse_allgather_allreduce, sparse_ring_allreduce
from distrain.compress import group_topk_indices
from tests.harness import run_group

RATIOS = [0.01, 0.05, 0.2, 0.02, 0.3, 0.04, 0.12, 0.08]  # a different k on every worker
# (numel, group, ratio scale, dtype): short vectors, fill-in to dense, empty chunks (numel < n),
# several 32768-element blocks, 8- and 2-byte values.
CASES = [
    (1000, 64, 1.0, torch.float32),
    (997, 16, 3.0, torch.float32),
    (3, 1, 1.0, torch.float32),
    (70001, 1024, 0.5, torch.float32),
    (513, 32, 1.0, torch.float64),
    (600, 8, 1.0, torch.float16),
]
COLLECTIVES = {"ring": sparse_ring_allreduce, "allgather": sparse_allgather_allreduce}


@functools.cache
def sparse_input(rank: int, case: int) -> tuple[torch.Tensor, torch.Tensor]:
    numel, group, scale, dtype = CASES[case]
    g = torch.Generator().manual_seed(1000 * case + rank)
    dense = torch.randn(numel, generator=g).to(dtype)
    indices = group_topk_indices(dense, min(1.0, RATIOS[rank] * scale), group)
    return indices, dense[indices]


def _body(rank: int, world: int) -> dict:
    out: dict = {}
    for n in range(2, world + 1):
        group = dist.new_group(list(range(n)))  # every process takes part in creating every group
        if rank >= n:
            continue
        for case in range(len(CASES)):
            indices, values = sparse_input(rank, case)
            for name, collective in COLLECTIVES.items():
                transport = Transport(group)
                total = collective(transport, indices, values, CASES[case][0])
                key = f"{n}/{case}/{name}"
                out[key + "/total"] = total
                out[key + "/sent"] = torch.tensor(transport.stats.sent)
                out[key + "/received"] = torch.tensor(transport.stats.received)
    return out


def message_bytes(nnz: int, length: int, element_size: int) -> int:
    """Wire format (see comm/sparse_ring.py): 24-byte header, then the smaller of dense values or
    int32 counts per 32768-block (padded to 8 bytes) + values + int16 offsets."""
    counts = 8 * math.ceil(math.ceil(length / BLOCK) / 2)
    return 24 + min(length * element_size, counts + nnz * (element_size + 2))


def expected_sent(n: int, case: int) -> tuple[dict[str, list[int]], bool]:
    """Bytes each worker sends, from the index sets alone; and whether any chunk went dense."""
    numel, _, _, dtype = CASES[case]
    e = torch.empty((), dtype=dtype).element_size()
    sets = [sparse_input(r, case)[0] for r in range(n)]
    starts = torch.tensor([c * numel // n for c in range(n + 1)])
    went_dense = False

    def chunk_message(c: int, workers: list[int]) -> int:
        nonlocal went_dense
        length = int(starts[c + 1] - starts[c])
        if length == 0:
            return 0
        union = torch.unique(torch.cat([sets[w] for w in workers]))
        nnz = int(((union >= starts[c]) & (union < starts[c + 1])).sum())
        went_dense |= message_bytes(nnz, length, e) == 24 + length * e
        return message_bytes(nnz, length, e)

    ring, allgather = [], []
    for r in range(n):
        scatter = sum(chunk_message((r - k) % n, [(r - j) % n for j in range(k + 1)]) for k in range(n - 1))
        gather = sum(chunk_message((r + 1 - k) % n, list(range(n))) for k in range(n - 1))
        ring.append(scatter + gather)
        # two backend all-gathers: every message size (int64), then the messages padded to the longest
        longest = max(message_bytes(sets[w].numel(), numel, e) for w in range(n))
        allgather.append((n - 1) * (8 + longest))
    return {"ring": ring, "allgather": allgather}, went_dense


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_group(_body, 8, timeout=180)


@pytest.mark.timeout(240)
def test_sparse_collectives_equal_dense_sum_of_sparsified_gradients(results):
    for n in range(2, 9):
        for case, (numel, _, _, dtype) in enumerate(CASES):
            reference = torch.zeros(numel, dtype=torch.float64)
            for r in range(n):
                indices, values = sparse_input(r, case)
                reference.index_add_(0, indices, values.double())
            rtol, atol = (1e-2, 1e-2) if dtype == torch.float16 else (1e-5, 1e-6)
            for name in COLLECTIVES:
                key = f"{n}/{case}/{name}"
                got = results[0][key + "/total"]
                assert got.dtype == dtype and got.shape == (numel,)
                assert torch.allclose(got.double(), reference, rtol=rtol, atol=atol), key
                for r in range(1, n):
                    assert torch.equal(results[r][key + "/total"], got), f"{key}: ranks 0 and {r} differ"


@pytest.mark.timeout(240)
def test_sparse_collectives_count_exactly_the_bytes_sent(results):
    went_dense = set()
    for n in range(2, 9):
        for case in range(len(CASES)):
            want, dense = expected_sent(n, case)
            if dense:
                went_dense.add(case)
            for name in COLLECTIVES:
                key = f"{n}/{case}/{name}"
                for r in range(n):
                    sent, received = results[r][key + "/sent"], results[r][key + "/received"]
                    succ, pred = (r + 1) % n, (r - 1) % n
                    assert int(sent.sum()) == int(sent[succ]) == want[name][r], f"{key} rank {r}"
                    assert int(received.sum()) == int(received[pred]) == int(results[pred][key + "/sent"][r])
    assert 1 in went_dense  # fill-in switched the high-density case's chunks to dense
