"""The Transport seam: every tensor that crosses between workers, counted and timed."""

from distrain.comm.ring import (
    doubling_all_reduce,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)
from distrain.comm.transport import Handle, Transport, TransportStats, ring_share

__all__ = ["Handle", "Transport", "TransportStats", "doubling_all_reduce", "ring_all_gather", "ring_all_reduce", "ring_reduce_scatter", "ring_share"]
