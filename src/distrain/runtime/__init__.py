"""What every process of a run relies on besides training itself: crash-safe files."""

from distrain.runtime.files import atomic_write

__all__ = ["atomic_write"]
