"""What every process of a run relies on besides the algorithm: crash-safe files, checkpoints,
fault handling (signals, injected faults, non-finite values), peer liveness and the run's totals
across resumed segments. Algorithms, distrain's own loop and ``wrap()`` all use it; it imports
none of them."""

from distrain.runtime.files import atomic_write

__all__ = ["atomic_write"]
