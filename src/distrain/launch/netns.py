"""An emulated cluster on one Linux machine: one network namespace per worker (or host), joined
by a bridge, each link capped in both directions with ``tc ... tbf``.

Layout for a cluster of n members, created by a process with id PID::

    namespace distrain-PID-i   eth0 10.77.0.(i+1)/24 --veth-- dtrPIDv<i> --+-- bridge dtrPIDb
    (tbf on eth0: member i's uplink)   (tbf on dtrPIDv<i>: its downlink)   |   (no address)

Every exit path removes what was made (normal end, error, Ctrl-C, SIGTERM, a failed worker);
if the creating process was killed outright, the next cluster made on this machine removes the
leftovers (names carry the creator's process id, and only those of dead processes are removed).
``tc netem`` is not assumed: latency comes from the in-process link model. Links use jumbo
frames (MTU 9000, ``DISTRAIN_NETNS_MTU`` to change), so headers cost under 1% of a link.

``distrain train --emulation netns`` uses :func:`launch_netns`: worker r runs
``python -m distrain train --config RUN_DIR/netns/config.json`` inside namespace r, with
``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` (rank 0's address) set as torchrun would and
``GLOO_SOCKET_IFNAME=eth0``. Bandwidth traces are replayed with ``tc qdisc change``. With
``--workers-per-node K`` a namespace is a node: its K workers share one capped link and talk to
each other over the namespace's own loopback (unshaped), as on one machine; each parameter
server has a namespace of its own.

Example::

    with NetnsCluster(2, rates=[100e6, 10e6]) as cluster:
        proc = cluster.popen(1, ["python", "-c", "print('hello from', 1)"])
        proc.wait()
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from distrain.config import TrainConfig
from distrain.emulation import CLOCK_FILE_ENV, NETNS_WORKER_ENV, NetworkSettings, NetworkSpec
from distrain.emulation.units import tc_rate
from distrain.errors import ConfigError, WorkerFailure
from distrain.launch.common import PR_SET_PDEATHSIG
from distrain.runtime.process import EXIT_BAD_INPUT

log = logging.getLogger(__name__)

PREFIX = "distrain"
LINK_PREFIX = "dtr"
SUBNET = "10.77.0"
INTERFACE = "eth0"
#: Link MTU. Jumbo frames, as on a data-centre LAN: per-packet headers then cost <1% of a link,
#: so a transfer can reach close to the cap (with 1500 they cost 4.4%).
MTU = int(os.environ.get("DISTRAIN_NETNS_MTU", "9000"))
MASTER_PORT = 29500
_NS_RE = re.compile(rf"^{PREFIX}-(\d+)-(\d+)$")
_LINK_RE = re.compile(rf"^{LINK_PREFIX}(\d+)(?:b|v\d+)$")


# -- permission and commands -----------------------------------------------------------------

def netns_unavailable() -> str | None:
    """Why shaped namespaces cannot be made here, or None if they can."""
    if sys.platform != "linux":
        return f"this is {sys.platform}, not Linux"
    if os.geteuid() != 0:
        return "this process is not root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the '{tool}' command (iproute2) is not installed"
    probe = f"{PREFIX}-{os.getpid()}-999"  # a name cleanup_stale() recognises, should this process die here
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"'ip netns add' failed: {made.stderr.strip() or made.returncode}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def require_netns() -> None:
    """Raise ConfigError (one line) unless namespaces can be made here."""
    reason = netns_unavailable()
    if reason is not None:
        raise ConfigError("--emulation", f"netns needs root and the ip command (iproute2) on Linux ({reason}); "
                          "use --emulation model")


def _cmd(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {out.stderr.strip() or f'exit status {out.returncode}'}")
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_namespaces() -> list[str]:
    """Names of distrain's namespaces on this machine."""
    out = _cmd("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.split() and _NS_RE.match(line.split()[0])]


def cleanup_stale() -> list[str]:
    """Remove namespaces and links left by distrain processes that no longer exist."""
    removed = []
    for name in list_namespaces():
        m = _NS_RE.match(name)
        if m and not _alive(int(m.group(1))):
            _cmd("ip", "netns", "del", name, check=False)
            removed.append(name)
    for line in _cmd("ip", "-o", "link", "show", check=False).stdout.splitlines():
        fields = line.split(":")
        name = fields[1].strip().split("@")[0] if len(fields) > 1 else ""
        m = _LINK_RE.match(name)
        if m and not _alive(int(m.group(1))):
            _cmd("ip", "link", "del", name, check=False)
            removed.append(name)
    if removed:
        log.warning("removed leftovers of an earlier run: %s", ", ".join(removed))
    return removed


def free_subnet(first: int = 1) -> str:
    """A ``10.77.X`` subnet (X from ``first`` to 250) that no address of this machine is in, for a
    cluster whose bridge has an address of this machine's."""
    used = set(re.findall(r"inet 10\.77\.(\d+)\.", _cmd("ip", "-o", "-4", "addr", "show", check=False).stdout))
    for x in range(first, 251):
        if str(x) not in used:
            return f"10.77.{x}"
    raise ConfigError("--emulation", "no free 10.77.X.0/24 subnet is left on this machine for the namespaces")


def _die_with_parent() -> None:
    """In a child, before exec: get SIGKILL when the launcher dies, however it dies."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


# -- the cluster -----------------------------------------------------------------------------

class NetnsCluster:
    """``size`` namespaces on a bridge, member i at ``SUBNET.(i+1)``, each link capped by tbf.

    Args:
        size: members (workers, or emulated hosts).
        rates: each member's link bandwidth in bits/s (None: unlimited); both directions.
        subnet: the first three octets of the members' addresses.
        host: give this machine itself an address on the bridge, ``SUBNET.254``, so that a
            process outside the namespaces (``distrain launch``'s store) serves the members. The
            subnet then needs to be free on this machine (:func:`free_subnet`).
    """

    def __init__(self, size: int, rates: list[float | None] | None = None, subnet: str = SUBNET,
                 host: bool = False) -> None:
        if not 1 <= size <= 250:
            raise ValueError(f"a cluster has 1 to 250 members, got {size}")
        self.size = size
        self.rates: list[float | None] = list(rates) if rates is not None else [None] * size
        tag = os.getpid()
        self.namespaces = [f"{PREFIX}-{tag}-{i}" for i in range(size)]
        self.addresses = [f"{subnet}.{i + 1}" for i in range(size)]
        self.host_address = f"{subnet}.254" if host else None
        self.bridge = f"{LINK_PREFIX}{tag}b"
        self.host_ends = [f"{LINK_PREFIX}{tag}v{i}" for i in range(size)]
        self.interface = INTERFACE
        self._up = False

    def create(self) -> NetnsCluster:
        cleanup_stale()
        self.destroy()  # names of ours from an earlier cluster in this process
        self._up = True
        try:
            _cmd("ip", "link", "add", self.bridge, "mtu", str(MTU), "type", "bridge")
            _cmd("ip", "link", "set", self.bridge, "up")
            if self.host_address is not None:
                _cmd("ip", "addr", "add", f"{self.host_address}/24", "dev", self.bridge)
            for i, (ns, host) in enumerate(zip(self.namespaces, self.host_ends, strict=True)):
                _cmd("ip", "netns", "add", ns)
                _cmd("ip", "link", "add", host, "mtu", str(MTU), "type", "veth", "peer", "name", INTERFACE,
                     "netns", ns, "mtu", str(MTU))
                _cmd("ip", "link", "set", host, "master", self.bridge, "up")
                _cmd("ip", "-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", INTERFACE)
                _cmd("ip", "-n", ns, "link", "set", INTERFACE, "up")
                _cmd("ip", "-n", ns, "link", "set", "lo", "up")
                if self.rates[i] is not None:
                    self._tbf("add", i, self.rates[i])
        except BaseException:
            self.destroy()
            raise
        return self

    def _tbf(self, verb: str, i: int, bits: float | None) -> None:
        if bits is None:
            args = ["qdisc", "del", "dev"]
        else:
            bytes_per_s = bits / 8
            burst = max(16_000, int(bytes_per_s * 0.004))  # 4 ms of traffic, at least ~10 frames
            limit = max(200_000, int(bytes_per_s * 0.1))  # up to 100 ms queued before drops
            args = ["qdisc", verb, "dev"]
        for prefix, dev in ((["-n", self.namespaces[i]], INTERFACE), ([], self.host_ends[i])):
            cmd = ["tc", *prefix, *args, dev, "root"]
            if bits is not None:
                cmd += ["tbf", "rate", tc_rate(bits), "burst", str(burst), "limit", str(limit)]
            _cmd(*cmd, check=bits is not None)

    def set_rate(self, i: int, bits: float | None) -> None:
        """Change member ``i``'s link bandwidth (both directions) now; None removes the cap."""
        if bits == self.rates[i]:
            return
        verb = "add" if self.rates[i] is None else "change"
        self._tbf(verb, i, bits)
        self.rates[i] = bits

    def popen(self, i: int, argv: list[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside member ``i``'s namespace; it dies with this process."""
        kwargs.setdefault("start_new_session", True)
        return subprocess.Popen(["ip", "netns", "exec", self.namespaces[i], *argv],
                                preexec_fn=_die_with_parent, **kwargs)

    def destroy(self) -> None:
        """Remove the namespaces and links (their processes must be gone). Safe to repeat."""
        existing = set(list_namespaces())
        for ns in self.namespaces:
            if ns in existing:
                _cmd("ip", "netns", "del", ns, check=False)
        for link in (*self.host_ends, self.bridge):
            if Path("/sys/class/net", link).exists():
                _cmd("ip", "link", "del", link, check=False)
        self._up = False

    def __enter__(self) -> NetnsCluster:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.destroy()


class TraceApplier:
    """Replays bandwidth traces on a cluster with ``tc qdisc change``, from when a file appears
    (rank 0 makes it when training starts) or at once if ``clock_file`` is None."""

    def __init__(self, cluster: NetnsCluster, spec: NetworkSpec, clock_file: Path | None = None,
                 ranks: list[int] | None = None) -> None:
        self.cluster, self.spec, self.clock_file = cluster, spec, clock_file
        self.ranks = list(range(cluster.size)) if ranks is None else ranks  # member i follows rank ranks[i]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="distrain-trace", daemon=True)
        self.changes = 0
        self.error: BaseException | None = None

    def start(self) -> TraceApplier:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            while self.clock_file is not None and not self.clock_file.exists():
                if self._stop.wait(0.02):
                    return
            t0 = time.monotonic()
            while not self._stop.is_set():
                t = time.monotonic() - t0
                for i, r in enumerate(self.ranks):
                    bits = self.spec.bandwidth(r, t)
                    if bits != self.cluster.rates[i]:
                        self.cluster.set_rate(i, bits)
                        self.changes += 1
                self._stop.wait(min(self.spec.next_change(t, self.ranks) - t, 1.0) + 0.0005)
        except BaseException as exc:  # noqa: BLE001 - reported by the launcher
            self.error = exc
            log.warning("bandwidth trace stopped: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)


class NetnsHosts:
    """An emulated run's namespaces: one per node (``--workers-per-node`` ranks, else each rank),
    its link capped by the bandwidth of the node's first rank, bandwidth traces replayed from when
    ``clock_file`` appears (rank 0 makes it when training starts). ``host``: give this machine an
    address on the bridge (:attr:`address`), for a store the launcher serves.
    ``distrain train`` and ``distrain launch`` both start their ranks in them."""

    def __init__(self, spec: NetworkSpec, clock_file: Path, host: bool = False) -> None:
        self.spec, self.clock_file = spec, clock_file
        self.host_of = spec.nodes  # rank -> node
        self.firsts = [self.host_of.index(h) for h in range(max(self.host_of) + 1)]  # each node's first rank
        rates = [spec.bandwidth(r, 0.0) for r in self.firsts]
        self.cluster = (NetnsCluster(len(self.firsts), rates=rates, subnet=free_subnet(), host=True) if host
                        else NetnsCluster(len(self.firsts), rates=rates))
        self.applier: TraceApplier | None = None

    def open(self) -> None:
        self.cluster.create()
        log.info("netns cluster %s: %s", self.cluster.bridge, self.spec.describe())
        if any(s is not None for s in self.spec.schedules):
            self.applier = TraceApplier(self.cluster, self.spec, self.clock_file, ranks=self.firsts).start()

    def close(self) -> None:
        """Stop the traces and remove the namespaces (their processes must be gone)."""
        if self.applier is not None:
            self.applier.stop()
        self.cluster.destroy()

    @property
    def address(self) -> str:
        return str(self.cluster.host_address)

    def namespace(self, rank: int) -> str:
        return self.cluster.namespaces[self.host_of[rank]]

    def env(self) -> dict[str, str]:
        """What every rank's environment adds: gloo on the capped interface, the emulation told
        that the links are shaped, the traces' clock file."""
        return {"GLOO_SOCKET_IFNAME": INTERFACE, NETNS_WORKER_ENV: "1", CLOCK_FILE_ENV: str(self.clock_file)}


# -- distrain train --emulation netns --------------------------------------------------------

@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (and SIGHUP) raise KeyboardInterrupt, so the cleanup in ``finally`` runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def stop_processes(procs: list[subprocess.Popen], wait: float = 5.0) -> None:
    """Terminate, then kill, every process still running; reap all."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + wait
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def supervise(procs: list[subprocess.Popen], grace: float, timeout: float | None = None) -> list[tuple[int, int]]:
    """Wait for every process; once one fails, give the rest ``grace`` seconds, then stop them.

    Returns (index, exit status) of the failures; raises WorkerFailure after ``timeout``.
    """
    failures: list[tuple[int, int]] = []
    failed_at: float | None = None
    deadline = None if timeout is None else time.monotonic() + timeout
    while any([p.poll() is None for p in procs]):  # a list: poll every process, every round
        now = time.monotonic()
        if failed_at is not None and now > failed_at + grace:
            break
        if deadline is not None and now > deadline:
            stop_processes(procs)
            raise WorkerFailure(f"the workers did not finish within {timeout:.0f} s")
        # Seen in the same round, a process killed by a signal is the cause; its peers then fail.
        new = sorted(((i, p.returncode) for i, p in enumerate(procs)
                      if p.returncode not in (None, 0) and all(i != j for j, _ in failures)), key=lambda f: f[1] >= 0)
        if new:
            failures += new
            failed_at = failed_at or now
        time.sleep(0.05)
    stop_processes(procs)
    failures += [(i, p.returncode) for i, p in enumerate(procs)
                 if p.returncode != 0 and all(i != j for j, _ in failures)]
    return failures


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def launch_netns(cfg: TrainConfig, *, model_fn: Any = None, train_set: Any = None, test_set: Any = None,
                 loss_fn: Any = None) -> dict[str, Any]:
    """Train with ``cfg.cluster.workers`` workers, each in its own shaped network namespace."""
    from distrain.comm.group import check_device
    from distrain.launch.checks import finished_before_start, preflight
    from distrain.launch.common import (
        claim_run_dir,
        default_run_dir,
        replace_earlier_run,
        server_count,
    )

    if model_fn is not None or train_set is not None or test_set is not None or loss_fn is not None:
        raise ConfigError("--emulation", "netns starts each worker as its own program, so it takes built-in or "
                          "importable models and data sets (flags), not Python objects passed to fit()")
    require_netns()
    check_device(cfg)
    world = cfg.cluster.workers + server_count(cfg)  # parameter servers get namespaces too
    spec = NetworkSettings.from_config(cfg.network).resolve(world, cfg.cluster.workers, cfg.algo.workers_per_node)
    preflight(cfg)
    run_dir = default_run_dir(cfg, time.time()).resolve()
    claim_run_dir(cfg, run_dir)
    finished = finished_before_start(cfg, run_dir, world)
    if finished is not None:
        return finished
    replace_earlier_run(cfg, run_dir)  # every check passed: --overwrite removes the earlier run now
    work = run_dir / "netns"
    work.mkdir(parents=True, exist_ok=True)
    worker_cfg = replace(cfg, run=replace(cfg.run, run_dir=str(run_dir), overwrite=False))
    config_path = work / "config.json"
    config_path.write_text(json.dumps(worker_cfg.to_dict(), indent=2))
    clock_file = work / "clock"
    clock_file.unlink(missing_ok=True)
    if cfg.run.resume in ("none", ""):  # a resumed run's summary is its result until a better one
        (run_dir / "summary.json").unlink(missing_ok=True)

    hosts = NetnsHosts(spec, clock_file)
    host_of, firsts, cluster = hosts.host_of, hosts.firsts, hosts.cluster
    procs: list[subprocess.Popen] = []
    logs = [work / f"rank{r}.log" for r in range(world)]
    with _sigterm_as_interrupt():
        try:
            hosts.open()
            for r in range(world):
                host = host_of[r]
                env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r - firsts[host]),
                       "LOCAL_WORLD_SIZE": str(host_of.count(host)), "MASTER_ADDR": cluster.addresses[0],
                       "MASTER_PORT": str(MASTER_PORT), **hosts.env(), "PYTHONUNBUFFERED": "1"}
                env.pop("TORCHELASTIC_RUN_ID", None)
                env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d warns that namespaces have no host names
                with open(logs[r], "wb") as out:
                    procs.append(cluster.popen(host, [sys.executable, "-m", "distrain", "train", "--config", str(config_path)],
                                               env=env, stdin=subprocess.DEVNULL, stdout=out,
                                               stderr=None if r == 0 else subprocess.STDOUT))
            failures = supervise(procs, grace=min(cfg.cluster.timeout, 30.0))
        finally:
            stop_processes(procs)
            hosts.close()
    if failures:
        if all(code == EXIT_BAD_INPUT for _, code in failures):
            raise SystemExit(EXIT_BAD_INPUT)
        rank, code = failures[0]
        raise WorkerFailure(f"worker {rank} exited with status {code}; the run was stopped. "
                            f"Last lines of {logs[rank]}:\n{_tail(logs[rank])}")
    return json.loads((run_dir / "summary.json").read_text())
