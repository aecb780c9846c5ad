"""Parse and print the units of network settings: bandwidths, durations, sizes, factors.

Bandwidths follow ``tc``'s convention, which users of traffic shaping know: ``bit``, ``kbit``,
``mbit``, ``gbit``, ``tbit`` are bits per second, and ``bps``, ``kbps``, ``mbps``, ``gbps``,
``tbps`` are *bytes* per second (``10mbps`` = 80 Mbit/s); case-insensitive, a trailing ``/s`` is
allowed, any other unit is refused. Every parsed value is in bits per second. Durations: ``100us``, ``5ms``, ``1s`` (``0`` alone is allowed). Sizes: ``500KB``,
``10MB``, ``1GB`` (powers of 1000) or ``64KiB``, ``10MiB`` (powers of 1024), or plain bytes.

Example::

    parse_bandwidth("100mbit")   # 100e6 bits/s
    parse_bandwidth("10MBps")    # 80e6 bits/s (10 megabytes per second)
    parse_duration("5ms")        # 0.005 s
    parse_size("10MB")           # 10_000_000 bytes
"""

from __future__ import annotations

import math
import re

from distrain.errors import ConfigError

_NUMBER = r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)"

_BANDWIDTH_UNITS = {
    "bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "bps": 8.0, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
}
_DURATION_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_SIZE_UNITS = {"b": 1, "": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def _split(text: object) -> tuple[float, str] | None:
    if not isinstance(text, str):
        return None
    m = re.fullmatch(_NUMBER + r"\s*([a-z]*)(?:/s)?", text.strip().lower())
    if m is None:
        return None
    value = float(m.group(1))
    return (value, m.group(2)) if math.isfinite(value) else None


def parse_bandwidth(text: object, setting: str = "--bandwidth") -> float:
    """``"100mbit"`` -> 1e8, ``"10mbps"`` -> 8e7 (bits per second); must be > 0."""
    parts = _split(text)
    if parts is None or parts[1] not in _BANDWIDTH_UNITS or parts[0] <= 0:
        raise ConfigError(setting, f"must look like 100mbit or 500kbit (bits/s) or 10mbps (bytes/s), got {text!r}")
    return parts[0] * _BANDWIDTH_UNITS[parts[1]]


def parse_duration(text: object, setting: str = "--latency") -> float:
    """``"5ms"`` -> 0.005 (seconds); must be >= 0."""
    parts = _split(text)
    ok = parts is not None and (parts[1] in _DURATION_UNITS or (parts[1] == "" and parts[0] == 0))
    if not ok:
        raise ConfigError(setting, f"must look like 5ms, 100us or 1s, got {text!r}")
    assert parts is not None
    return parts[0] * _DURATION_UNITS.get(parts[1], 0.0)


def parse_size(text: object, setting: str = "--size") -> int:
    """``"10MB"`` -> 10_000_000 bytes; ``"1MiB"`` -> 1_048_576; must be > 0."""
    parts = _split(text)
    if parts is None or parts[1] not in _SIZE_UNITS or parts[0] <= 0 or parts[0] * _SIZE_UNITS[parts[1]] < 1:
        raise ConfigError(setting, f"must look like 10MB, 512KiB or 1000000 (bytes), got {text!r}")
    return int(parts[0] * _SIZE_UNITS[parts[1]])


def parse_factor(text: object, setting: str = "--slow-worker") -> float:
    """``"4x"`` or ``"4"`` -> 4.0; must be >= 1 (a worker cannot be made faster)."""
    parts = _split(text)
    if parts is None or parts[1] not in ("x", "") or parts[0] < 1:
        raise ConfigError(setting, f"slowdown must look like 4x (a factor >= 1), got {text!r}")
    return parts[0]


def format_bandwidth(bits_per_s: float | None) -> str:
    """1e8 -> ``"100mbit"``; None -> ``"unlimited"``."""
    if bits_per_s is None:
        return "unlimited"
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:g}{unit}"
    return f"{bits_per_s:g}bit"


def tc_rate(bits_per_s: float) -> str:
    """A rate as ``tc`` reads it (bits per second, integer)."""
    return f"{max(1, round(bits_per_s))}bit"
