"""Graphs, mixing matrices, spectral gaps, bipartite splits and node maps."""

from __future__ import annotations

import math

import pytest
import torch

from distrain.algorithms.d2 import D2
from distrain.config import TrainConfig
from distrain.errors import ConfigError
from distrain.topology import (
    TOPOLOGIES,
    NodeMap,
    bipartite,
    bipartite_sets,
    build_topology,
    check_connected,
    eigenvalues,
    from_edges,
    is_connected,
    mixing_matrix,
    spectral_gap,
)


def buildable(name: str, n: int) -> bool:
    return name != "torus" or any(n % r == 0 for r in range(2, math.isqrt(n) + 1))


CASES = [(name, n) for name in TOPOLOGIES for n in range(2, 9) if buildable(name, n)]


@pytest.mark.parametrize("name,n", CASES)
@pytest.mark.parametrize("kind", ["uniform", "metropolis", "lazy"])
def test_mixing_matrix_is_symmetric_doubly_stochastic_on_the_graph(name, n, kind):
    graph = build_topology(name, n)
    assert is_connected(graph)
    if kind == "uniform" and not graph.is_regular:
        with pytest.raises(ConfigError) as err:
            mixing_matrix(graph, kind)
        assert err.value.setting == "--mixing"
        return
    W = mixing_matrix(graph, kind)
    ones = torch.ones(n, dtype=torch.float64)
    torch.testing.assert_close(W.sum(0), ones, rtol=0, atol=1e-12)
    torch.testing.assert_close(W.sum(1), ones, rtol=0, atol=1e-12)
    torch.testing.assert_close(W, W.T, rtol=0, atol=0)
    assert (W >= 0).all()
    allowed = torch.eye(n, dtype=torch.bool)
    for i, nbrs in enumerate(graph.neighbors):
        allowed[i, list(nbrs)] = True
        assert all(W[i, j] > 0 for j in nbrs)
    assert (W[~allowed] == 0).all()
    assert 0 < spectral_gap(W) <= 1 + 1e-12
    if kind == "lazy":
        assert float(eigenvalues(W)[-1]) >= -1e-12


def test_uniform_equals_metropolis_on_regular_graphs_and_averages_exactly_on_complete():
    ring = build_topology("ring", 6)
    torch.testing.assert_close(mixing_matrix(ring, "uniform"), mixing_matrix(ring, "metropolis"))
    W = mixing_matrix(build_topology("complete", 5), "uniform")
    torch.testing.assert_close(W, torch.full((5, 5), 0.2, dtype=torch.float64))
    assert spectral_gap(W) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("n", [3, 4, 5, 8])
def test_ring_spectral_gap_matches_closed_form(n):
    # Eigenvalues of the ring with weights 1/3 are 1/3 + 2/3 cos(2 pi k / n).
    lam = [1 / 3 + 2 / 3 * math.cos(2 * math.pi * k / n) for k in range(n)]
    expected = 1 - sorted(abs(v) for v in lam)[-2]
    assert spectral_gap(mixing_matrix(build_topology("ring", n))) == pytest.approx(expected, abs=1e-12)


def test_graph_shapes():
    assert build_topology("ring", 5).neighbors[0] == (1, 4)
    assert build_topology("exponential", 8).neighbors[0] == (1, 2, 4, 6, 7)  # +-1, +-2, 4
    assert build_topology("exponential", 16).degrees == [7] * 16  # +-1, +-2, +-4, 8
    torus = build_topology("torus", 9)  # 3 x 3
    assert torus.neighbors[4] == (1, 3, 5, 7) and torus.degrees == [4] * 9
    assert build_topology("torus", 8).degrees == [3] * 8  # 2 x 4: up and down coincide
    assert build_topology("complete", 4).neighbors[2] == (0, 1, 3)
    assert build_topology("ring", 2).neighbors == ((1,), (0,))


@pytest.mark.parametrize("n", [2, 3, 5, 7])
def test_torus_needs_a_worker_count_that_factors(n):
    with pytest.raises(ConfigError) as err:
        build_topology("torus", n)
    assert err.value.setting == "--topology" and str(n) in err.value.message


def test_disconnected_and_unknown_topologies_are_config_errors_naming_the_flag():
    two_islands = from_edges("islands", 4, [(0, 1), (2, 3)])
    assert not is_connected(two_islands)
    with pytest.raises(ConfigError) as err:
        check_connected(two_islands)
    assert err.value.setting == "--topology" and "disconnected" in err.value.message
    with pytest.raises(ConfigError) as err:
        build_topology("hypercube", 4)
    assert err.value.setting == "--topology" and "ring" in err.value.message
    with pytest.raises(ConfigError):
        TrainConfig.from_dict({"topology": "star"}).validate()


@pytest.mark.parametrize("n", range(1, 10))
def test_bipartite_graph_exists_for_every_n_and_splits_every_edge(n):
    graph = bipartite(n)
    assert is_connected(graph)
    active, passive = bipartite_sets(graph)
    assert sorted(active + passive) == list(range(n)) and 0 in active
    assert abs(len(active) - len(passive)) <= 1
    for i, j in graph.edges():
        assert (i in active) != (j in active)


def test_bipartite_sets_refuses_odd_cycles():
    with pytest.raises(ValueError, match="not bipartite"):
        bipartite_sets(build_topology("ring", 5))
    assert bipartite_sets(build_topology("ring", 6)) == ([0, 2, 4], [1, 3, 5])


def test_d2_makes_w_lazy_when_its_smallest_eigenvalue_is_minus_one_third():
    d2 = D2(TrainConfig())
    d2.lazy = False
    W = mixing_matrix(build_topology("ring", 4))
    assert float(eigenvalues(W)[-1]) == pytest.approx(-1 / 3)
    lazy = d2.mixing_weights(W)
    assert d2.lazy and float(eigenvalues(lazy)[-1]) == pytest.approx(1 / 3)
    torch.testing.assert_close(lazy, (torch.eye(4, dtype=torch.float64) + W) / 2)
    d2.lazy = False
    exp = mixing_matrix(build_topology("exponential", 8))
    assert d2.mixing_weights(exp) is exp and not d2.lazy


def test_node_map():
    nodes = NodeMap(world_size=7, workers_per_node=3)
    assert nodes.num_nodes == 3 and nodes.leaders == [0, 3, 6]
    assert [nodes.node_of(r) for r in range(7)] == [0, 0, 0, 1, 1, 1, 2]
    assert nodes.members(2) == [6] and nodes.same_node(3, 5) and not nodes.same_node(2, 3)
    with pytest.raises(ConfigError):
        NodeMap(world_size=4, workers_per_node=0)
    # the members of an elastic run keep their ids, and so their nodes: ids 0 and 4 lost of 6
    # (nodes {0, 1}, {2, 3}, {4, 5}); one joined again last
    left = NodeMap(world_size=5, workers_per_node=2, ids=(1, 2, 3, 5, 0))
    assert left.num_nodes == 3 and [left.node_of(r) for r in range(5)] == [0, 1, 1, 2, 0]
    assert left.members(0) == [0, 4] and left.leaders == [0, 1, 3]
    gone = NodeMap(world_size=2, workers_per_node=2, ids=(2, 5))  # node {0, 1} has no member left
    assert gone.num_nodes == 2 and gone.leaders == [0, 1] and not gone.same_node(0, 1)


def test_decentralized_settings_are_checked_before_any_worker_starts():
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_dict({"algorithm": "dpsgd", "topology": "torus", "workers": 5}).validate()
    assert err.value.setting == "--topology"
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_dict({"algorithm": "d2", "topology": "bipartite", "mixing": "uniform", "workers": 5}).validate()
    assert err.value.setting == "--mixing"
    TrainConfig.from_dict({"algorithm": "d2", "topology": "torus", "workers": 6}).validate()
    TrainConfig.from_dict({"algorithm": "allreduce", "topology": "torus", "workers": 5}).validate()  # not used


def test_diameter_counts_the_most_hops_between_two_workers():
    from distrain.topology import build_topology, diameter

    assert [diameter(build_topology("ring", n)) for n in (1, 2, 3, 4, 5, 8)] == [0, 1, 1, 2, 2, 4]
    assert diameter(build_topology("complete", 6)) == 1
    assert diameter(build_topology("torus", 9)) == 2  # 3 x 3, wrapping
