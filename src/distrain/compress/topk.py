"""Global top-k: keep the k = ratio * numel largest magnitudes of the whole tensor."""

from __future__ import annotations

import torch

from distrain.compress.base import CompressInfo, SparseCompressor, kept


def topk_indices(flat: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest magnitudes of a 1-D tensor."""
    if k >= flat.numel():
        return torch.arange(flat.numel(), device=flat.device)
    return flat.abs().topk(k, sorted=False).indices


class TopK(SparseCompressor):
    """Keep the ``ratio`` fraction of largest-magnitude elements (at least one).

    Args:
        ratio: kept fraction, 0 < ratio <= 1.

    Example::

        >>> payload, ctx = TopK(0.25).compress(torch.tensor([0.1, -3.0, 2.0, 0.5]), CompressInfo())
        >>> TopK(0.25).decompress(payload, ctx)
        tensor([ 0., -3.,  0.,  0.])
    """

    name = "topk"

    def select(self, flat: torch.Tensor, ratio: float, info: CompressInfo) -> torch.Tensor:
        return topk_indices(flat, kept(ratio, flat.numel()))
