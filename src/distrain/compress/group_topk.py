"""Group top-k: split the flat tensor into groups and keep the largest magnitudes of each group.

Every group of ``group`` consecutive elements keeps its k = round(ratio * group) (at least 1)
largest magnitudes; a shorter last group keeps round(ratio * its size), at least 1. Unlike global
top-k, every part of the model gets some of the budget each step, and the work is one batched
``topk`` over a (groups, group) view.

The default group, :data:`DEFAULT_GROUP` = 2**18 elements, is large on purpose. Layers differ in
gradient scale by orders of magnitude, and a small group hands every stretch of the flat vector the
same share: with groups of 1024, a ~1M-parameter MLP's output layer (1% of the weights, the
largest gradients) got 1% of the budget where global top-k gives it 10-50%, its residual grew
unsent, and the MLP needed 90 steps to 45% test accuracy against 60 with groups of 2**18 (54-60
for global top-k, 48 dense; BENCHMARKS.md). Large groups still cost one batched ``topk``.
"""

from __future__ import annotations

import torch

from distrain.compress.base import CompressInfo, SparseCompressor, kept

DEFAULT_GROUP = 2**18
"""Elements per group when the spec gives none (``group_topk:RATIO``)."""


def group_topk_indices(flat: torch.Tensor, k_ratio: float, group: int) -> torch.Tensor:
    """Sorted indices (int64) of the kept elements of the 1-D ``flat``."""
    numel = flat.numel()
    full = numel // group
    parts = []
    if full:
        k = kept(k_ratio, group)
        if k == group:
            parts.append(torch.arange(full * group, device=flat.device))
        else:
            local = flat[: full * group].view(full, group).abs().topk(k, dim=1, sorted=False).indices
            local = local.sort(dim=1).values
            offsets = torch.arange(0, full * group, group, device=flat.device).unsqueeze(1)
            parts.append((local + offsets).reshape(-1))
    tail = numel - full * group
    if tail:
        k = kept(k_ratio, tail)
        local = flat[full * group :].abs().topk(k, sorted=False).indices.sort().values
        parts.append(local + full * group)
    if not parts:
        return torch.zeros(0, dtype=torch.int64, device=flat.device)
    return torch.cat(parts) if len(parts) > 1 else parts[0]


class GroupTopK(SparseCompressor):
    """Keep the ``ratio`` fraction of largest magnitudes in every group of ``group`` elements.

    Args:
        ratio: kept fraction per group, 0 < ratio <= 1.
        group: elements per group (>= 1); the flat tensor is split into consecutive groups.
            Smaller groups spread the budget evenly over the tensor; larger ones let it follow
            the largest gradients, as global top-k does.

    Example::

        >>> c = GroupTopK(0.5, group=2)
        >>> payload, ctx = c.compress(torch.tensor([1.0, -2.0, 3.0, 0.5]), CompressInfo())
        >>> c.decompress(payload, ctx)
        tensor([ 0., -2.,  3.,  0.])
    """

    name = "group_topk"

    def __init__(self, ratio: float, group: int = DEFAULT_GROUP) -> None:
        super().__init__(ratio)
        if isinstance(group, bool) or int(group) != group or group < 1:
            raise ValueError(f"group must be an integer >= 1, got {group!r}")
        self.group = int(group)

    def select(self, flat: torch.Tensor, ratio: float, info: CompressInfo) -> torch.Tensor:
        return group_topk_indices(flat, ratio, self.group)

    def kept_count(self, numel: int, ratio: float | None = None) -> int:
        ratio = self.ratio if ratio is None else ratio
        full, tail = divmod(numel, self.group)
        return full * kept(ratio, self.group) + kept(ratio, tail)

    def spec(self) -> str:
        return f"{self.name}:{self.ratio:g}:group={self.group}"
