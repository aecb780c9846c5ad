"""What an algorithm that compresses its traffic takes of ``--compress`` and its companion flags."""

from __future__ import annotations

from dataclasses import dataclass

from distrain.compress.base import Compressor
from distrain.compress.registry import build_compressor
from distrain.compress.warmup import DensityWarmup


@dataclass(frozen=True, kw_only=True)
class CompressionSettings:
    """The compressor spec and how it is applied (made by :mod:`distrain.assemble` from
    ``--compress``, ``--error-feedback``, ``--sparse-collective``, ``--momentum-correction`` and
    the density warm-up flags, whose defaults it has resolved).

    Example::

        settings = CompressionSettings(spec="group_topk:0.01", error_feedback=True, sparse_collective="ring",
                                       momentum_correction=True, density_warmup_epochs=1.0,
                                       density_decay_epochs=2.0)
        compressor = settings.compressor(seed=0)          # ErrorFeedback(GroupTopK(...))
        schedule = settings.warmup(compressor.ratio)      # dense for an epoch, then 1 -> 0.01 over two
    """

    #: the spec, e.g. ``group_topk:0.01`` (see :func:`~distrain.compress.registry.build_compressor`); ``none``: dense
    spec: str
    #: keep what a lossy compressor dropped and add it to the next step
    error_feedback: bool
    #: how sparse payloads are summed: ``ring`` or ``allgather``
    sparse_collective: str
    #: with a sparsifier and SGD, apply the momentum on each worker before compressing
    momentum_correction: bool
    #: epochs of dense training, then epochs over which the kept ratio falls from 1 to its target
    density_warmup_epochs: float
    density_decay_epochs: float
    #: the lowest kept ratio until ``density_hold_until`` epochs (0: none), then a fall to the target
    density_hold: float = 0.0
    density_hold_until: float = 0.0
    #: with momentum correction, zero the velocity of what was sent (DGC's momentum factor masking);
    #: off with the hold, whose moderate ratio sends most useful coordinates at every step
    momentum_masking: bool = True

    @property
    def enabled(self) -> bool:
        """Whether anything is compressed (a spec other than ``none``)."""
        return self.spec.strip() != "none"

    def compressor(self, seed: int, *, residual_device: str | None = None) -> Compressor:
        """The compressor the spec names, in error feedback when it is lossy and that is asked for
        (``seed``: the run's, the same on every worker)."""
        return build_compressor(self.spec, error_feedback=self.error_feedback, seed=seed,
                                residual_device=residual_device)

    def warmup(self, target: float | None) -> DensityWarmup:
        """The density warm-up towards ``target`` (a compressor's ratio, or an adaptive policy's base)."""
        return DensityWarmup(target, self.density_warmup_epochs, self.density_decay_epochs,
                             self.density_hold, self.density_hold_until)
