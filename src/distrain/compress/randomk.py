"""Random-k: keep k = ratio * numel elements at indices drawn from a seed every worker shares.

Because every worker draws the same indices (from the run seed, the step and the tensor key),
only the values travel and payloads of different workers can be summed by a plain all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distrain.compress.base import (
    CompressInfo,
    Compressor,
    Payload,
    TensorMeta,
    check_ratio,
    desparsify,
    generator,
    kept,
)


@dataclass(frozen=True)
class RandomKContext:
    meta: TensorMeta
    indices: torch.Tensor


class RandomK(Compressor):
    """Keep a random ``ratio`` fraction of the elements, the same positions on every worker.

    With ``unbiased=True`` the kept values are scaled by numel / k, so the expected
    decompressed tensor is the input. Error feedback wants the raw values instead (the scaled
    operator is not a contraction and its residual grows), which is what ``unbiased=False`` sends.

    Args:
        ratio: kept fraction, 0 < ratio <= 1; every worker must use the same one at each step.
        seed: shared by all workers.
        unbiased: scale the kept values by numel / k.
    """

    name = "randomk"
    summable = True

    def __init__(self, ratio: float, seed: int = 0, unbiased: bool = True) -> None:
        self.ratio = check_ratio(ratio)
        self.seed = int(seed)
        self.unbiased = unbiased

    def indices(self, numel: int, ratio: float, info: CompressInfo, device: torch.device) -> torch.Tensor:
        k = kept(ratio, numel)
        if k == numel:
            return torch.arange(numel, device=device)
        g = generator(self.seed, info.step, info.key)
        return torch.randperm(numel, generator=g)[:k].sort().values.to(device)

    def compress(self, tensor: torch.Tensor, info: CompressInfo) -> tuple[Payload, RandomKContext]:
        flat = tensor.reshape(-1)
        ratio = self.ratio if info.ratio is None else check_ratio(info.ratio)
        indices = self.indices(flat.numel(), ratio, info, flat.device)
        return [flat[indices]], RandomKContext(TensorMeta.of(tensor), indices)

    def decompress(self, payload: Payload, ctx: RandomKContext) -> torch.Tensor:
        values = payload[0]
        if self.unbiased and values.numel():
            values = values * (ctx.meta.numel / values.numel())
        return desparsify(ctx.indices, values, ctx.meta)

    def wire_bytes(self, numel: int, ratio: float | None = None, element_size: int = 4) -> int:
        return kept(self.ratio if ratio is None else ratio, numel) * element_size

    def spec(self) -> str:
        return f"{self.name}:{self.ratio:g}"
