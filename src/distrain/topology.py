"""Who talks to whom: communication graphs, their mixing matrices, and the map of workers to nodes.

A :class:`Graph` is undirected and has no self-loops. A mixing matrix ``W`` for a graph is
symmetric and doubly stochastic (rows and columns sum to 1) with ``W[i, j] > 0`` only on the
graph's edges and the diagonal, so gossip ``x_i <- sum_j W[i, j] x_j`` keeps the average of the
workers' models and pulls them towards it. How fast it pulls is the spectral gap ``1 - |lambda_2|``.

Example::

    from distrain.topology import build_topology, mixing_matrix, spectral_gap

    graph = build_topology("ring", 8)
    W = mixing_matrix(graph, "metropolis")
    print(graph.neighbors[0], spectral_gap(W))   # (1, 7) 0.195...
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from distrain.errors import ConfigError

__all__ = [
    "MIXINGS", "TOPOLOGIES", "Graph", "NodeMap", "bipartite", "bipartite_sets", "build_topology",
    "check_connected", "complete", "exponential", "is_connected", "mixing_matrix", "ring",
    "spectral_gap", "torus",
]


@dataclass(frozen=True)
class Graph:
    """An undirected graph on workers ``0..n-1``; ``neighbors[i]`` is sorted and excludes ``i``."""

    name: str
    neighbors: tuple[tuple[int, ...], ...]

    @property
    def n(self) -> int:
        return len(self.neighbors)

    @property
    def degrees(self) -> list[int]:
        return [len(nbrs) for nbrs in self.neighbors]

    @property
    def is_regular(self) -> bool:
        return len(set(self.degrees)) <= 1

    def edges(self) -> list[tuple[int, int]]:
        """Each edge once, as ``(i, j)`` with ``i < j``."""
        return [(i, j) for i, nbrs in enumerate(self.neighbors) for j in nbrs if i < j]


def from_edges(name: str, n: int, edges: list[tuple[int, int]] | set[tuple[int, int]]) -> Graph:
    """A graph from an edge list; duplicate edges and self-loops are dropped."""
    if n < 1:
        raise ValueError(f"a graph needs at least one worker, got {n}")
    nbrs: list[set[int]] = [set() for _ in range(n)]
    for i, j in edges:
        if not (0 <= i < n and 0 <= j < n):
            raise ValueError(f"edge ({i}, {j}) is outside 0..{n - 1}")
        if i != j:
            nbrs[i].add(j)
            nbrs[j].add(i)
    return Graph(name, tuple(tuple(sorted(s)) for s in nbrs))


# -- graphs ----------------------------------------------------------------------------------


def ring(n: int) -> Graph:
    """Each worker talks to its predecessor and successor."""
    return from_edges("ring", n, [(i, (i + 1) % n) for i in range(n)])


def torus_shape(n: int) -> tuple[int, int]:
    """The most square ``rows x cols = n`` with both sides >= 2; ConfigError if there is none."""
    rows = max((r for r in range(2, math.isqrt(n) + 1) if n % r == 0), default=0)
    if rows == 0:
        raise ConfigError("--topology", f"torus needs a worker count that factors as rows x cols with both >= 2 "
                                        f"(4, 6, 8, 9, ...), got {n}; use ring or exponential instead")
    return rows, n // rows


def torus(n: int) -> Graph:
    """A 2-D torus (grid with wrap-around): up to four neighbours, for worker counts that factor."""
    rows, cols = torus_shape(n)
    edges = []
    for r in range(rows):
        for c in range(cols):
            i = r * cols + c
            edges += [(i, r * cols + (c + 1) % cols), (i, ((r + 1) % rows) * cols + c)]
    return from_edges("torus", n, edges)


def exponential(n: int) -> Graph:
    """Neighbours at distance 1, 2, 4, ... (both directions): O(log n) degree, fast mixing."""
    edges = []
    hop = 1
    while hop < n:
        edges += [(i, (i + hop) % n) for i in range(n)]
        hop *= 2
    return from_edges("exponential", n, edges)


def complete(n: int) -> Graph:
    """Everyone talks to everyone (gossip with uniform weights is then exact averaging)."""
    return from_edges("complete", n, [(i, j) for i in range(n) for j in range(i + 1, n)])


def bipartite(n: int) -> Graph:
    """A connected bipartite graph for any n: the ring for even n; for odd n the ring with its
    closing edge ``(n-1, 0)`` moved to ``(n-1, 1)``, so even and odd ranks form the two sides."""
    if n % 2 == 0 or n < 3:
        graph = ring(n)
    else:
        graph = from_edges("bipartite", n, [(i, i + 1) for i in range(n - 1)] + [(n - 1, 1)])
    return Graph("bipartite", graph.neighbors)


TOPOLOGIES: dict[str, Callable[[int], Graph]] = {
    "ring": ring, "torus": torus, "exponential": exponential, "complete": complete, "bipartite": bipartite,
}


def build_topology(name: str, n: int) -> Graph:
    """The graph called ``name`` on ``n`` workers; ConfigError (naming ``--topology``) if it is
    unknown, cannot be built for ``n``, or is disconnected."""
    if name not in TOPOLOGIES:
        raise ConfigError("--topology", f"unknown topology {name!r}; choose one of: {', '.join(TOPOLOGIES)}")
    graph = TOPOLOGIES[name](n)
    check_connected(graph)
    return graph


# -- graph properties ------------------------------------------------------------------------


def _components(graph: Graph) -> list[list[int]]:
    seen: set[int] = set()
    parts = []
    for start in range(graph.n):
        if start in seen:
            continue
        seen.add(start)
        part, frontier = [start], [start]
        while frontier:
            i = frontier.pop()
            for j in graph.neighbors[i]:
                if j not in seen:
                    seen.add(j)
                    part.append(j)
                    frontier.append(j)
        parts.append(sorted(part))
    return parts


def is_connected(graph: Graph) -> bool:
    return len(_components(graph)) == 1


def check_connected(graph: Graph) -> None:
    """ConfigError naming ``--topology`` when some workers can never hear from others."""
    parts = _components(graph)
    if len(parts) > 1:
        shown = "; ".join(str(p) for p in parts[:4])
        raise ConfigError("--topology", f"{graph.name} on {graph.n} workers is disconnected ({len(parts)} "
                                        f"components: {shown}); models would never agree")


def diameter(graph: Graph) -> int:
    """The most hops between two workers (0 for one worker); the graph must be connected."""
    longest = 0
    for start in range(graph.n):
        hops, frontier = {start: 0}, [start]
        while frontier:
            i = frontier.pop(0)
            for j in graph.neighbors[i]:
                if j not in hops:
                    hops[j] = hops[i] + 1
                    frontier.append(j)
        longest = max(longest, *hops.values())
    return longest


def bipartite_sets(graph: Graph) -> tuple[list[int], list[int]]:
    """The two colour classes (active, passive) of a bipartite graph; the first holds worker 0.

    Every edge joins the two sets, so if only active workers start pairwise exchanges and only
    passive ones accept them, no two exchanges can wait on each other in a cycle (AD-PSGD).
    Raises ValueError if the graph has an odd cycle (e.g. a ring of odd size; use
    ``bipartite(n)``).
    """
    colour: dict[int, int] = {}
    for start in range(graph.n):
        if start in colour:
            continue
        colour[start] = 0
        frontier = [start]
        while frontier:
            i = frontier.pop()
            for j in graph.neighbors[i]:
                if j not in colour:
                    colour[j] = 1 - colour[i]
                    frontier.append(j)
                elif colour[j] == colour[i]:
                    raise ValueError(f"{graph.name} on {graph.n} workers is not bipartite: "
                                     f"workers {i} and {j} are neighbours on an odd cycle")
    return ([i for i in range(graph.n) if colour[i] == 0], [i for i in range(graph.n) if colour[i] == 1])


# -- mixing matrices -------------------------------------------------------------------------


def uniform_weights(graph: Graph) -> torch.Tensor:
    """``W[i, j] = 1 / (deg(i) + 1)`` over neighbours and self: doubly stochastic only on regular graphs."""
    if not graph.is_regular:
        raise ConfigError("--mixing", f"uniform weights are doubly stochastic only on regular graphs; "
                                      f"{graph.name} on {graph.n} workers has degrees {sorted(set(graph.degrees))}; "
                                      "use --mixing metropolis")
    W = torch.zeros(graph.n, graph.n, dtype=torch.float64)
    for i, nbrs in enumerate(graph.neighbors):
        W[i, [i, *nbrs]] = 1.0 / (len(nbrs) + 1)
    return W


def metropolis_weights(graph: Graph) -> torch.Tensor:
    """Metropolis-Hastings: ``W[i, j] = 1 / (1 + max(deg i, deg j))`` on edges, the rest on the
    diagonal; symmetric and doubly stochastic on any graph."""
    deg = graph.degrees
    W = torch.zeros(graph.n, graph.n, dtype=torch.float64)
    for i, j in graph.edges():
        W[i, j] = W[j, i] = 1.0 / (1 + max(deg[i], deg[j]))
    W += torch.diag(1.0 - W.sum(dim=1))
    return W


def lazy_metropolis_weights(graph: Graph) -> torch.Tensor:
    """``(I + W_metropolis) / 2``: half the weight stays home, so every eigenvalue is in [0, 1]
    (no disagreement that flips sign each round, which momentum would amplify)."""
    return (torch.eye(graph.n, dtype=torch.float64) + metropolis_weights(graph)) / 2


MIXINGS: dict[str, Callable[[Graph], torch.Tensor]] = {
    "uniform": uniform_weights, "metropolis": metropolis_weights, "lazy": lazy_metropolis_weights,
}


def mixing_matrix(graph: Graph, kind: str = "metropolis") -> torch.Tensor:
    """The mixing matrix ``W`` (float64, n x n) of ``graph``: ``uniform`` or ``metropolis``."""
    if kind not in MIXINGS:
        raise ConfigError("--mixing", f"unknown mixing {kind!r}; choose one of: {', '.join(MIXINGS)}")
    return MIXINGS[kind](graph)


def eigenvalues(W: torch.Tensor) -> torch.Tensor:
    """Eigenvalues of a symmetric mixing matrix, descending (the first is 1)."""
    return torch.linalg.eigvalsh(W.to(torch.float64)).flip(0)


def spectral_gap(W: torch.Tensor) -> float:
    """``1 - max(|lambda_2|, |lambda_n|)``: the fraction of disagreement one gossip round removes
    at least (in norm). 1 for exact averaging, 0 for a disconnected (or periodic) graph."""
    if W.shape[0] == 1:
        return 1.0
    lam = eigenvalues(W)
    return float(1.0 - max(abs(lam[1].item()), abs(lam[-1].item())))


# -- nodes (hierarchical aggregation, emulated fast intra-node links) ------------------------


@dataclass(frozen=True)
class NodeMap:
    """Workers grouped into nodes of ``workers_per_node`` consecutive ranks (the last may be smaller).

    The first rank of a node is its leader. Ranks on one node share fast links (shared memory,
    NVLink); links between nodes are the slow ones. With ``ids`` (the worker id of each rank, a
    group of the members left after a loss, say) a worker's node is that of its id, and the nodes
    are those the ids are on, numbered from 0 in order, so a node that lost its leader is led by
    its next member, and one with no member left is gone.

    Example::

        nodes = NodeMap(world_size=8, workers_per_node=4)
        nodes.node_of(5), nodes.members(1), nodes.leaders   # 1, [4, 5, 6, 7], [0, 4]
        NodeMap(3, 2, ids=(1, 2, 3)).leaders                # [0, 1]: ids 1 and 2 lead
    """

    world_size: int
    workers_per_node: int
    ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.workers_per_node < 1:
            raise ConfigError("--workers-per-node", f"must be an integer >= 1, got {self.workers_per_node!r}")

    def _node_of_id(self, rank: int) -> int:
        return (rank if self.ids is None else self.ids[rank]) // self.workers_per_node

    @property
    def _nodes(self) -> list[int]:
        return sorted({self._node_of_id(r) for r in range(self.world_size)})

    @property
    def num_nodes(self) -> int:
        return len(self._nodes)

    def node_of(self, rank: int) -> int:
        return self._nodes.index(self._node_of_id(rank))

    def members(self, node: int) -> list[int]:
        wanted = self._nodes[node]
        return [r for r in range(self.world_size) if self._node_of_id(r) == wanted]

    @property
    def leaders(self) -> list[int]:
        return [self.members(node)[0] for node in range(self.num_nodes)]

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of(a) == self.node_of(b)
