"""Optimizers by name (SGD, Adam, LARS) and the learning-rate schedule (linear scaling, warm-up,
decay), for distrain's own loop, the parameter servers and the DDP baselines."""

from distrain.optim.optimizers import LARS, OPTIMIZERS, build_optimizer
from distrain.optim.schedule import DECAYS, LRSchedule, scaled_lr

__all__ = ["DECAYS", "LARS", "LRSchedule", "OPTIMIZERS", "build_optimizer", "scaled_lr"]
