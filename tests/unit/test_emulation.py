"""Network emulation without processes: units, presets and flags, traces, the link model's
arithmetic, compute slowdown."""

from __future__ import annotations

import math
import time

import pytest

from distrain.config import TrainConfig
from distrain.emulation import (
    BandwidthTrace,
    ComputeSlowdown,
    Emulation,
    LinkModel,
    NetworkSettings,
    NetworkSpec,
    parse_bandwidth,
    parse_duration,
    parse_size,
)
from distrain.errors import ConfigError


def settings(**values: object) -> NetworkSettings:
    cfg = TrainConfig.from_dict(values).validate()
    return NetworkSettings.from_config(cfg.network)


# -- units -------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,bits", [("100mbit", 100e6), ("1gbit", 1e9), ("500kbit", 500e3), ("1.5Gbit", 1.5e9),
                                       ("20 mbit", 20e6), ("64kbit/s", 64e3), ("9600bit", 9600),
                                       # tc's convention: *bps are bytes per second
                                       ("100Mbps", 800e6), ("10MBps", 80e6), ("1kbps", 8e3), ("2GBPS", 16e9),
                                       ("125bps", 1000)])
def test_bandwidth_units(text, bits):
    assert parse_bandwidth(text) == pytest.approx(bits)


@pytest.mark.parametrize("text", ["fast", "100", "100mb", "-5mbit", "0mbit", "", "nanmbit", "1e999mbit", "10mibps",
                                  "10 megabit", "5mbyte"])
def test_bad_bandwidth_is_one_clear_error(text):
    with pytest.raises(ConfigError) as exc:
        parse_bandwidth(text)
    assert str(exc.value) == f"--bandwidth: must look like 100mbit or 500kbit (bits/s) or 10mbps (bytes/s), got {text!r}"


@pytest.mark.parametrize("text,seconds", [("5ms", 0.005), ("100us", 1e-4), ("1s", 1.0), ("0", 0.0), ("0.1ms", 1e-4)])
def test_duration_units(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["5", "fast", "-1ms", "5min"])
def test_bad_duration(text):
    with pytest.raises(ConfigError, match=r"^--latency: must look like 5ms, 100us or 1s"):
        parse_duration(text)


def test_sizes():
    assert parse_size("10MB") == 10_000_000
    assert parse_size("1MiB") == 2**20
    assert parse_size("512KiB") == 512 * 1024
    assert parse_size("1000") == 1000
    with pytest.raises(ConfigError, match="^--size: "):
        parse_size("lots")


# -- presets and flags ---------------------------------------------------------------------------

def test_presets_resolve_per_worker():
    edge = settings(network="edge").resolve(4)
    assert edge.base_bandwidth == [20e6] * 4 and edge.latency == pytest.approx(0.010)
    assert edge.compute_factors == [1.0] * 4
    lan = settings(network="lan").resolve(2)
    assert lan.base_bandwidth == [10e9] * 2 and lan.latency == pytest.approx(1e-4)
    wan = settings(network="wan").resolve(2)
    assert wan.base_bandwidth == [100e6] * 2 and wan.latency == pytest.approx(0.020)
    straggler = settings(network="straggler").resolve(4)
    assert straggler.compute_factors == [1.0, 1.0, 1.0, 4.0] and straggler.base_bandwidth == [10e9] * 4
    slow = settings(network="slow-link").resolve(3)
    assert slow.base_bandwidth == [100e6, 100e6, 10e6]


def test_fluctuating_preset_alternates_with_different_phases():
    spec = settings(network="fluctuating").resolve(4)
    for r in range(4):  # each worker spends half the period high and half low
        samples = [spec.bandwidth(r, t / 100) for t in range(400)]
        assert set(samples) == {50e6, 5e6}
        assert samples.count(50e6) == 200
    assert len({tuple(spec.bandwidth(r, t / 10) for t in range(40)) for r in range(4)}) == 4  # phases differ
    assert spec.bandwidth(1, 1.0) == spec.bandwidth(1, 5.0) == spec.bandwidth(1, 9.0)  # periodic
    assert spec.bandwidth(0, 0.5) == 50e6 and spec.bandwidth(0, 2.5) == 5e6


@pytest.mark.parametrize("world", range(2, 9))
def test_changes_of_a_fluctuating_world_always_move_forward(world):
    # With 5 processes (4 workers and a server) the phase shifts are not exact in binary, and a
    # change point could round back onto itself: a transfer stepping from change to change spun.
    spec = settings(network="fluctuating").resolve(world)
    model = LinkModel(spec, rank=0)
    ranks = list(range(world))
    t = 0.0
    for _ in range(400):
        change = spec.next_change(t, ranks)
        assert change > t
        t = change
    for start in (0.0, 0.8, 1.6, 4.8, 5.6, 9.2, 16.4):  # 1 MB from each change point
        end = model.transmit(start, 1e6, [(0, world - 1)])
        assert 1e6 * 8 / 50e6 <= end - start <= 1e6 * 8 / 5e6 + 1e-9


def test_flags_override_the_preset_field_by_field():
    s = settings(network="edge", latency="1ms", jitter="0.5ms")
    assert s.bandwidth == 20e6 and s.latency == pytest.approx(0.001) and s.jitter == pytest.approx(0.0005)
    spec = settings(network="straggler", slow_worker="0:2x,2:3x", slow_link="1:10mbit").resolve(3)
    assert spec.compute_factors == [2.0, 1.0, 3.0]  # replaces the preset's last:4x
    assert spec.base_bandwidth == [10e9, 10e6, 10e9]
    flat = settings(network="fluctuating", bandwidth="1gbit").resolve(2)  # an explicit bandwidth replaces the trace
    assert flat.schedules == [None, None] and flat.bandwidth(0, 3.0) == 1e9


def test_nothing_set_means_no_emulation():
    s = settings()
    assert not s.active
    emulation = Emulation.from_config(TrainConfig().network, 0, 4)
    assert emulation.link_model is None and emulation.compute.factor == 1.0
    assert settings(latency="5ms").active and settings(slow_worker="1:2x").active


@pytest.mark.parametrize("values,flag,message", [
    ({"bandwidth": "fast"}, "--bandwidth", "must look like 100mbit or 500kbit (bits/s) or 10mbps (bytes/s), got 'fast'"),
    ({"latency": "5"}, "--latency", "must look like 5ms, 100us or 1s, got '5'"),
    ({"jitter": "lots"}, "--jitter", "must look like 5ms, 100us or 1s, got 'lots'"),
    ({"slow_worker": "2"}, "--slow-worker", "must look like 2:4x (rank:value, comma-separated), got '2'"),
    ({"slow_worker": "2:0.5x"}, "--slow-worker", "slowdown must look like 4x (a factor >= 1), got '0.5x'"),
    ({"slow_link": "x:10mbit"}, "--slow-link", "must look like 3:10mbit (rank:value, comma-separated), got 'x:10mbit'"),
    ({"slow_link": "1:slow"}, "--slow-link", "must look like 100mbit or 500kbit (bits/s) or 10mbps (bytes/s), got 'slow'"),
    ({"network": "moon"}, "--network", "unknown value 'moon'; choose one of: none, lan, wan, edge, straggler, slow-link, fluctuating"),
    ({"emulation": "vm"}, "--emulation", "unknown value 'vm'; choose one of: model, netns"),
    ({"bandwidth_trace": "/nonexistent/trace.csv"}, "--bandwidth-trace", "file '/nonexistent/trace.csv' does not exist"),
])
def test_network_validation_names_the_flag(values, flag, message):
    with pytest.raises(ConfigError) as exc:
        TrainConfig.from_dict(values).validate()
    assert exc.value.setting == flag and exc.value.message == message


def test_ranks_beyond_the_world_are_refused_when_it_is_known():
    s = settings(slow_worker="5:2x")
    with pytest.raises(ConfigError, match=r"^--slow-worker: names worker 5, but there are only 4 workers"):
        s.resolve(4)
    with pytest.raises(ConfigError, match=r"^--slow-link: names worker 2"):
        settings(slow_link="2:1mbit").resolve(2)


def test_a_worker_named_twice_is_refused():
    # "last" is rank 3 of 4 workers: two factors for one worker, one of them silently dropped before
    with pytest.raises(ConfigError, match=r"^--slow-worker: names worker 3 twice \(as 3 and last\);"):
        settings(slow_worker="3:2x,last:4x").resolve(4)
    with pytest.raises(ConfigError, match=r"^--slow-link: names worker 1 twice;"):
        settings(slow_link="1:1mbit,1:2mbit").resolve(2)
    spec = settings(slow_worker="2:2x,last:4x", slow_link="last:1mbit").resolve(4)  # one setting each: fine
    assert spec.compute_factors == [1.0, 1.0, 2.0, 4.0]


def test_cli_reports_a_bad_bandwidth_in_one_line(capsys):
    from distrain.cli import main

    assert main(["train", "--bandwidth", "fast"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "distrain: --bandwidth: must look like 100mbit or 500kbit (bits/s) or 10mbps (bytes/s), got 'fast'"


# -- traces --------------------------------------------------------------------------------------

CSV = """# a link that drops out
time_s,worker,bandwidth
0,*,50mbit
0,1,5mbit      # worker 1 starts slow
2.5,1,50mbit
4,last,10mbit
"""


def test_csv_trace_gives_each_worker_a_schedule(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text(CSV)
    spec = settings(bandwidth="100mbit", bandwidth_trace=str(path)).resolve(3)
    assert [spec.bandwidth(r, 0.0) for r in range(3)] == [50e6, 5e6, 50e6]
    assert [spec.bandwidth(r, 3.0) for r in range(3)] == [50e6, 50e6, 50e6]
    assert [spec.bandwidth(r, 100.0) for r in range(3)] == [50e6, 50e6, 10e6]
    assert spec.next_change(0.0) == 2.5 and spec.next_change(2.5) == 4.0 and math.isinf(spec.next_change(4.0))


def test_trace_before_its_first_line_uses_the_base_bandwidth_and_repeat_loops():
    trace = BandwidthTrace.parse_csv("1,0,10mbit\n2,0,20mbit\n3,*,repeat\n")
    spec = NetworkSpec(world=2, base_bandwidth=[99e6, 99e6], schedules=trace.resolve(2))
    assert spec.bandwidth(0, 0.5) == 99e6  # before the first change: --bandwidth
    assert spec.bandwidth(0, 1.5) == 10e6 and spec.bandwidth(0, 2.5) == 20e6
    assert spec.bandwidth(0, 3.5) == 20e6  # the next cycle starts where the last one ended
    assert spec.bandwidth(0, 4.5) == 10e6 and spec.bandwidth(1, 4.5) == 99e6
    assert spec.next_change(2.5) == pytest.approx(4.0)


def test_json_trace(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text('{"period_s": 4, "schedule": [{"time_s": 0, "worker": "*", "bandwidth": "50mbit"},'
                    ' {"time_s": 2, "worker": 1, "bandwidth": "5mbit"}]}')
    spec = settings(bandwidth_trace=str(path)).resolve(2)
    assert spec.bandwidth(1, 1) == 50e6 and spec.bandwidth(1, 3) == 5e6 and spec.bandwidth(1, 5) == 50e6


@pytest.mark.parametrize("text,line,what", [
    ("0,*,50mbit\n1,0\n", 2, "expected 3 fields"),
    ("time_s,worker,bandwidth\n0,*,50mbit\nsoon,0,5mbit\n", 3, "time_s must be a number"),
    ("0,*,50mbit\n\n# comment\n1,zero,5mbit\n", 4, "worker must be a rank"),
    ("0,*,50mbit\n1,0,fast\n", 2, "bandwidth must look like 100mbit"),
    ("2,*,50mbit\n1,0,5mbit\n", 2, "earlier than the line before"),
    ("0,*,50mbit\n4,*,repeat\n5,0,1mbit\n", 3, "nothing may follow"),
    ("3,*,50mbit\n2,*,repeat\n", 2, "earlier than the line before"),
])
def test_malformed_trace_names_the_line(tmp_path, text, line, what):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ConfigError) as exc:
        TrainConfig.from_dict({"bandwidth_trace": str(path)}).validate()
    assert exc.value.setting == "--bandwidth-trace"
    assert f"{path} line {line}: " in exc.value.message and what in exc.value.message


def test_trace_naming_a_missing_worker_is_refused_at_launch():
    trace = BandwidthTrace.parse_csv("0,7,1mbit\n")
    with pytest.raises(ConfigError, match="names worker 7, but there are only 4 workers"):
        trace.resolve(4)


# -- the link model's arithmetic ------------------------------------------------------------------

def test_transfer_time_integrates_a_changing_bandwidth():
    trace = BandwidthTrace.parse_csv("0,*,8mbit\n0.1,*,80mbit\n")
    spec = NetworkSpec(world=2, base_bandwidth=[None, None], schedules=trace.resolve(2))
    link = LinkModel(spec, 0)
    # 100 kB in the first 0.1 s at 1 MB/s, the other 100 kB at 10 MB/s: 0.11 s
    assert link.transmit(0.0, 200_000, [(0, 1)]) == pytest.approx(0.11)
    assert link.transmit(0.2, 200_000, [(0, 1)]) == pytest.approx(0.22)


def test_a_link_runs_at_the_slower_end():
    spec = NetworkSpec(world=3, base_bandwidth=[100e6, 10e6, None], schedules=[None] * 3)
    link = LinkModel(spec, 0)
    assert link.transmit(0.0, 1_250_000, [(0, 1)]) == pytest.approx(1.0)  # 10 Mbit/s
    assert link.transmit(0.0, 1_250_000, [(0, 2)]) == pytest.approx(0.1)  # 100 Mbit/s


def test_ring_collectives_are_charged_their_rounds():
    spec = NetworkSpec.uniform(4, 80e6, 0.001)  # 10 MB/s
    link = LinkModel(spec, 0)
    ring = [0, 1, 2, 3]
    M = 4_000_000
    assert link.ring_seconds("all_reduce", M, ring, 0.0) == pytest.approx(6 * (0.001 + 0.1))
    assert link.ring_seconds("reduce_scatter", M, ring, 0.0) == pytest.approx(3 * (0.001 + 0.1))
    assert link.ring_seconds("all_gather", M // 4, ring, 0.0) == pytest.approx(3 * (0.001 + 0.1))
    assert link.ring_seconds("broadcast", M, ring, 0.0) == pytest.approx(3 * 0.001 + 0.4)
    slow = LinkModel(NetworkSpec(world=4, base_bandwidth=[80e6, 80e6, 8e6, 80e6], schedules=[None] * 4), 0)
    assert slow.ring_seconds("all_reduce", M, ring, 0.0) == pytest.approx(6 * 1.0)  # the slowest link paces every round


def test_uplink_queues_messages_and_jitter_stays_in_bounds():
    spec = NetworkSpec.uniform(3, 8e6, 0.01, jitter=0.004)  # 1 MB/s
    link = LinkModel(spec, 0)
    t0 = link._t0
    first = link.send(1, 100_000) - t0
    second = link.send(2, 100_000) - t0
    assert 0.1 + 0.006 <= first <= 0.1 + 0.014 + 0.01  # (the clock moved a little since start)
    assert 0.2 + 0.006 <= second <= 0.2 + 0.014 + 0.01
    samples = [link.latency() for _ in range(2000)]
    assert 0.006 <= min(samples) < 0.0065 and 0.0135 < max(samples) <= 0.014
    assert sum(samples) / len(samples) == pytest.approx(0.01, abs=3e-4)


def test_links_inside_a_node_are_not_emulated_only_links_between_nodes():
    # edge, 4 workers in nodes {0, 1} and {2, 3}, then a parameter server (a node of its own)
    spec = settings(network="edge").resolve(5, workers=4, workers_per_node=2)
    assert spec.nodes == [0, 0, 1, 1, 2]
    assert spec.same_node(0, 1) and spec.same_node(3, 2) and not spec.same_node(1, 2) and not spec.same_node(3, 4)
    assert not spec.same_node(2, 2)
    assert settings(network="edge").resolve(4).nodes == [0, 1, 2, 3]  # flat: one worker per node
    link = LinkModel(spec, 0)
    link._t0 -= 100.0  # a clock far from zero, so "released at once" and "delayed" cannot be confused
    M = 2_500_000  # 1 s at 20 Mbit/s
    before = time.perf_counter()
    assert link.send(1, M) <= time.perf_counter()  # same node: released at once
    assert link.receive(1, M) <= time.perf_counter()
    assert link.collective("all_reduce", M, [0, 1]) <= time.perf_counter()
    assert link._uplink_free == link._downlink_free == 0.0  # local traffic queues on neither link
    assert link.send(2, M) - before >= 1.0 + 0.010  # across nodes: the cap and the latency
    assert link.ring_seconds("all_reduce", M, [0, 1], 0.0) == 0.0
    # a ring that mixes local and remote links runs at the remote links' pace
    assert link.ring_seconds("all_reduce", M, [0, 1, 2, 3], 0.0) == pytest.approx(6 * (0.25 + 0.010))
    assert link.ring_seconds("all_reduce", M, [0, 2], 0.0) == pytest.approx(2 * (0.5 + 0.010))


def test_hierarchical_runs_resolve_nodes_for_workers_and_servers():
    cfg = TrainConfig.from_dict({"network": "edge", "algorithm": "ps", "servers": 2, "workers": 4,
                                 "workers_per_node": 3}).validate()
    emulation = Emulation.from_config(cfg.network, 0, 6, workers=4, workers_per_node=cfg.algo.workers_per_node)
    assert emulation.link_model is not None
    assert emulation.spec.nodes == [0, 0, 0, 1, 2, 3]
    assert "3 nodes" not in emulation.spec.describe() and "4 nodes" in emulation.spec.describe()


def test_netns_mode_leaves_bandwidth_to_tc():
    spec = NetworkSpec.uniform(2, 8e6, 0.005, mode="netns")
    link = LinkModel(spec, 0)
    assert not link.shapes_bandwidth and spec.delays_messages
    assert link.ring_seconds("all_reduce", 10_000_000, [0, 1], 0.0) == pytest.approx(2 * 0.005)
    assert not NetworkSpec.uniform(2, 8e6, 0.0, mode="netns").delays_messages


# -- compute slowdown ----------------------------------------------------------------------------

def _work() -> float:
    t0 = time.perf_counter()
    x = 0.0
    for i in range(400_000):
        x += i * 0.5
    return time.perf_counter() - t0


@pytest.mark.parametrize("factor", [2.0, 4.0])
def test_compute_slowdown_stretches_a_step_by_its_factor(factor):
    slow = ComputeSlowdown(factor)
    ratios = []
    for _ in range(3):  # the step's own compute time against the whole step, slowdown included
        t0 = time.perf_counter()
        compute = _work()
        added = slow.after_compute(compute)
        ratios.append((time.perf_counter() - t0) / compute)
        assert added == pytest.approx((factor - 1) * compute)
    assert all(r >= factor for r in ratios), ratios  # never shorter than asked
    assert min(ratios) <= 1.1 * factor, ratios  # and not much longer (sleep overshoot, other load)
    assert slow.total_extra_s > 0
    assert ComputeSlowdown(1.0).after_compute(1.0) == 0.0
    with pytest.raises(ValueError):
        ComputeSlowdown(0.5)


def test_emulation_gives_the_slow_worker_its_factor():
    network = TrainConfig.from_dict({"network": "straggler"}).validate().network
    assert Emulation.from_config(network, 3, 4).compute.factor == 4.0
    assert Emulation.from_config(network, 0, 4).compute.factor == 1.0
    assert Emulation.from_config(network, 0, 4).link_model is not None


def test_last_names_the_last_training_worker_when_servers_follow():
    spec = settings(network="straggler").resolve(5, workers=4)  # rank 4 is a parameter server
    assert spec.compute_factors == [1.0, 1.0, 1.0, 4.0, 1.0]
    assert settings(network="slow-link").resolve(3, workers=2).base_bandwidth == [100e6, 10e6, 100e6]


def test_bench_link_refuses_bad_flags_in_one_line(capsys):
    from distrain.cli import main

    assert main(["bench", "link", "--size", "lots"]) == 2
    assert capsys.readouterr().err.strip() == "distrain: --size: must look like 10MB, 512KiB or 1000000 (bytes), got 'lots'"
    assert main(["bench", "link", "--workers", "1"]) == 2
    assert "--workers: must be an integer from 2 to 64" in capsys.readouterr().err
