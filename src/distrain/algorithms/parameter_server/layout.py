"""Which server owns which ranges of the flat parameter vector, before and after a takeover, and after a lost server returns.

See :mod:`distrain.algorithms.parameter_server` for how the pieces fit.
"""

from __future__ import annotations

from typing import Any

import torch


def shard_bounds(numel: int, servers: int) -> list[tuple[int, int]]:
    """``servers`` contiguous [lo, hi) ranges of nearly equal size covering ``numel`` elements."""
    base, extra = divmod(numel, servers)
    bounds, lo = [], 0
    for s in range(servers):
        hi = lo + base + (1 if s < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


class ShardLayout:
    """Which ranges of the flat parameter vector each server owns: its own shard at first, and
    pieces of lost servers' ranges after takeovers. Workers and servers each keep a copy and
    apply the same takeovers in the same order, so the copies agree; a server's shard is its
    ranges concatenated in order.

    Example::

        layout = ShardLayout(shard_bounds(10, 3))   # [(0, 4)], [(4, 7)], [(7, 10)]
        layout.take_over(1)                          # {0: [(4, 6)], 2: [(6, 7)]}
        layout.owned[2]                              # [(7, 10), (6, 7)]
        layout.give_back(1)                          # {0: [(4, 6)], 2: [(6, 7)]}: server 1 returned
        layout.whole()                               # True
    """

    def __init__(self, bounds: list[tuple[int, int]]) -> None:
        self.bounds = list(bounds)
        self.owned = {s: [b] for s, b in enumerate(bounds)}

    def live(self) -> list[int]:
        return sorted(self.owned)

    def numel(self, server: int) -> int:
        return sum(hi - lo for lo, hi in self.owned[server])

    def take_over(self, lost: int) -> dict[int, list[tuple[int, int]]]:
        """Split ``lost``'s ranges over the live servers (each range in nearly equal pieces, in
        server order); returns the pieces each live server gained."""
        ranges = self.owned.pop(lost)
        live = self.live()
        gained: dict[int, list[tuple[int, int]]] = {s: [] for s in live}
        for lo, hi in ranges:
            for s, (a, b) in zip(live, shard_bounds(hi - lo, len(live)), strict=True):
                if b > a:
                    gained[s].append((lo + a, lo + b))
                    self.owned[s].append((lo + a, lo + b))
        return gained

    def give_back(self, server: int) -> dict[int, list[tuple[int, int]]]:
        """``server`` returned after its loss: it owns its own range again. Returns the pieces of
        that range each live server gives up (in the order it held them); a server whose pieces
        came from several takeovers gives each back."""
        a, b = self.bounds[server]
        given: dict[int, list[tuple[int, int]]] = {}
        for s in self.live():
            kept: list[tuple[int, int]] = []
            given[s] = []
            for lo, hi in self.owned[s]:
                inside = (max(lo, a), min(hi, b))
                if inside[0] < inside[1]:
                    given[s].append(inside)
                kept += [(x, y) for x, y in ((lo, min(hi, a)), (max(lo, b), hi)) if x < y]
            self.owned[s] = kept
        self.owned[server] = [(a, b)]
        return given

    def whole(self) -> bool:
        """Whether every server owns exactly its own range (no takeover in force)."""
        return self.owned == {s: [r] for s, r in enumerate(self.bounds)}


def shard_of(bounds: list[tuple[int, int]], piece: tuple[int, int]) -> int:
    """The shard of ``bounds`` that ``piece`` (a range a server owns) lies in: every range is
    inside one, as takeovers and returns only split or cut ranges."""
    lo, hi = piece
    for k, (a, b) in enumerate(bounds):
        if a <= lo and hi <= b:
            return k
    raise ValueError(f"range {piece} is not inside one shard of {bounds}")


def shards_touched(bounds: list[tuple[int, int]], ranges: list[tuple[int, int]]) -> list[int]:
    """The shards of ``bounds`` that ``ranges`` lie in, in order: a compressed push carries one
    message per shard (its error feedback keyed by the shard), whichever servers hold it."""
    return sorted({shard_of(bounds, r) for r in ranges})


def positions(held: list[tuple[int, int]], ranges: list[tuple[int, int]]) -> torch.Tensor:
    """Where the elements of ``ranges`` (each inside one of ``held``) sit in ``held``
    concatenated (a server's shard): an index tensor, in the order of ``ranges``."""
    parts = []
    for lo, hi in ranges:
        offset = 0
        for x, y in held:
            if x <= lo and hi <= y:
                parts.append(torch.arange(offset + lo - x, offset + hi - x))
                break
            offset += y - x
        else:
            raise ValueError(f"range {(lo, hi)} is not inside one of {held}")
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def ranges_of(saved: torch.Tensor) -> list[tuple[int, int]]:
    """The [lo, hi) ranges of a checkpoint's (n, 2) int64 tensor of them."""
    return [(int(lo), int(hi)) for lo, hi in saved.tolist()]


def gather_ranges(flat: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """``flat``'s ``ranges`` concatenated (a view when there is one)."""
    if len(ranges) == 1:
        return flat[ranges[0][0] : ranges[0][1]]
    return torch.cat([flat[lo:hi] for lo, hi in ranges])


def scatter_ranges(flat: torch.Tensor, ranges: list[tuple[int, int]], values: torch.Tensor) -> None:
    """Write ``values`` (``ranges`` concatenated) into ``flat``."""
    offset = 0
    for lo, hi in ranges:
        flat[lo:hi].copy_(values[offset : offset + hi - lo])
        offset += hi - lo


def assemble_range(parts: list[tuple[list[tuple[int, int]], torch.Tensor, dict[str, Any]]],
                   target: tuple[int, int]) -> tuple[torch.Tensor, dict[str, Any]]:
    """The parameters of ``target`` (a [lo, hi) range of the flat vector) and their optimizer
    state, put together from ``parts``: each the ranges some server held, their values
    concatenated, and the optimizer state of those values (what the servers of a run whose
    lost server's ranges the others held save, so that the run resumes with every server on
    its own shard). Per-element state (a 1-D tensor as long as the part) is cut to ``target``,
    zeros where a part has none of it yet; other state (such as Adam's step count) is the
    first part's that has it. ValueError unless the parts cover ``target``."""
    lo, hi = target
    values = torch.empty(hi - lo)
    covered = torch.zeros(hi - lo, dtype=torch.bool)
    state: dict[str, Any] = {}
    for ranges, held, held_state in parts:
        offset = 0
        for a, b in ranges:
            x, y = max(a, lo), min(b, hi)
            if x < y:
                cut = slice(offset + x - a, offset + y - a)
                values[x - lo : y - lo] = held[cut]
                covered[x - lo : y - lo] = True
                for key, value in held_state.items():
                    if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == held.numel():
                        state.setdefault(key, torch.zeros(hi - lo, dtype=value.dtype))[x - lo : y - lo] = value[cut]
                    else:
                        state.setdefault(key, value)
            offset += b - a
    if not bool(covered.all()):
        raise ValueError(f"the parts saved cover {int(covered.sum())} of the {hi - lo} parameters of {target}")
    return values, state
