"""Elastic training under churn: a worker killed outright (SIGKILL) at a random step, and workers
killed every 30 s with restarts on.

For each algorithm given (``--algorithms``, default ``allreduce``; ``diloco``, ``dpsgd``, ``d2``,
``ps`` (with 2 servers; a worker is killed), ``ps-async`` (the same with ``--ps-mode async``),
``ps-server`` (ps with 2 servers, one of them
killed: the other takes over its parameters; started again, it takes them back),
``ps-async-server`` (the same with ``--ps-mode async``; a lost asynchronous server is not
started again, so no restart case), ``ps-server-group_topk`` (``ps-server`` with compressed
pushes, ``--compress group_topk:0.01``), ``adpsgd`` and
``prague`` go on too; ``allreduce-group_topk`` and ``diloco-int8`` are those algorithms with
``--compress group_topk:0.01`` and ``--compress int8``, ``diloco-auto`` DiLoCo with
``--sync-every auto``, ``diloco-streaming`` DiLoCo in 4 fragments whose exchanges overlap 4 inner
steps (``--fragments 4 --overlap-steps 4``), ``allreduce-hierarchical`` all-reduce with
``--workers-per-node 2``, ``ps-hierarchical`` ps with 2 servers and ``--workers-per-node 2``, whose
lost workers are not started again: no restart case, ``ps-hierarchical-server`` the same with one
of the servers killed: the other takes over its parameters, no restart case), on the default
job (``distrain train``: MNIST-1D, the CNN, 4 workers; DiLoCo for 45 epochs, see ``EPOCHS``) and for each of ``--seeds`` seeds (20):

* **no fault**: the run as it is (its final accuracy is the reference);
* **kill**: ``DISTRAIN_INJECT_KILL`` kills a random worker (rank 0 included) as a random step
  between 5% and 95% of the run begins. It passes if the command exits 0 within its timeout,
  no process is left, the summary shows that worker lost and the 3 others at the run's end;
* **kill + restart**: the same with ``--max-restarts 1`` and the step drawn between 5% and 50%
  (the restarted worker needs a few seconds to start and load its data before it can join). It
  passes if the run also ends with 4 workers (``ps-server``: and the summary shows the server
  back, ``returned_servers``).

With ``--kill-at time`` the victim kills itself (``DISTRAIN_INJECT_KILL_AFTER``, from a thread of
its own) at a moment instead: the same share of the run, as seconds of the fault-free run's
training time counted from when its fault watch starts, wherever it is then (inside an exchange,
a server between two answers), as a real failure comes. ``--network`` runs every case on a
network preset (on ``edge`` a synchronous server's answers to its workers leave one after the
other over its uplink, a window in which it has answered some and not others), ``--epochs``
sets every run's length.

A ``ps`` row counts in ``answer_taken`` the workers that took a lost server's answer of a step
from a worker it had answered (the server died between its answers); ``runs_with_answer_taken``
counts such runs.

A ``ps-server`` restart row also has ``back_s``: from the kill to the server taking its range
back (``returned_servers`` in the summary); reported as ``back_s`` (median, min, max).

Recovery time: from the kill (the time the killed process wrote before dying) to the members'
agreement with the new group open (``unix_time`` of the change in ``summary.json``): detection,
agreement and rebuild. Where the members do not change (``ps``, ``adpsgd``, ``prague``: the others
drop the lost worker), from the kill to its first declaration as dead in the store: detection.
Reported: median, min and max over the runs. Also ``rebuild_s``, from the failure a survivor saw
to the new group (the change's ``recovery_s``): DiLoCo's workers exchange nothing within a round,
so they see a loss at the round's sync, up to a round after the kill, training on meanwhile.

A run passes only without false recoveries (``false_recoveries``: the members agreed again
with nobody lost, which costs a wait each). ``slowdown_s``: the run's wall time minus its
fault-free twin's (median, min, max): what the fault cost, recoveries that came later included.

Accuracy: final test accuracy of the kill run minus the no-fault run of the same seed; median,
min and max, and how many are within 1 point.

Goodput (``--goodput-repeats`` 3 pairs): the default job for ``--goodput-epochs`` (80, about 60 s
of all-reduce's training here: two kills) epochs, once without faults and once with a random live worker process
killed every ``--kill-every`` (30) seconds and ``--max-restarts 10``. Where the fault-free run of
a pair lasts less than ``LONG_ENOUGH`` (2) kill intervals (DiLoCo's 80 epochs took 18 s, in which
no kill came), its epochs are scaled up to last that long and it is run again, so that every
pair sees a kill: the pair records its ``epochs``. Useful samples are those of the steps the model took: per step,
the members then times the batch size (the steps between changes, from ``membership``), over the
run's wall time, divided by the no-fault run's samples/s. The figure is the median of the
per-pair ratios, with min and max, over the pairs whose run saw a kill (one that saw none is
kept with its ratio, ``kills`` 0, but measures no churn and is left out). Target: at least 0.85.

    python benchmarks/bench_churn.py --part kill        # 20 seeds: about 16 minutes per algorithm
    python benchmarks/bench_churn.py --part goodput --algorithms allreduce,diloco
    python benchmarks/bench_churn.py --seeds 2 --goodput-repeats 1 --goodput-epochs 40 --kill-every 10   # a quick look
    python benchmarks/bench_churn.py --part kill --algorithms ps-server --kill-at time --network edge --epochs 3 --seeds 10 --out benchmarks/results/churn_ps_server_edge_anytime.json

Run-to-run spread (``--part noise``): each seed's fault-free run twice. Asynchronous algorithms
(``adpsgd``, ``prague``) do not repeat themselves (the order of their exchanges follows the
timing), so their own spread bounds how close a kill run can come to "the" fault-free run:
reported as the second run minus the first (median, min, max) and how many are within 1 point.

Writes ``benchmarks/results/churn.json`` (kills), ``benchmarks/results/churn_goodput.json`` and
``benchmarks/results/churn_noise.json`` (``--noise-out``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from provenance import check_repeats, spread, write_result

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
WORKERS = 4
TIMEOUT_S = 600
#: Flags an algorithm needs besides ``--algorithm`` (ps: two servers; the victim is a worker,
#: or for ``ps-server`` one of the servers).
EXTRA = {"ps": ("--servers", "2"), "ps-server": ("--servers", "2"), "ps-async": ("--servers", "2", "--ps-mode", "async"),
         "ps-async-server": ("--servers", "2", "--ps-mode", "async"),
         "ps-server-group_topk": ("--servers", "2", "--compress", "group_topk:0.01"),
         "allreduce-group_topk": ("--compress", "group_topk:0.01"), "diloco-int8": ("--compress", "int8"),
         "diloco-auto": ("--sync-every", "auto"), "allreduce-hierarchical": ("--workers-per-node", "2"),
         "ps-hierarchical": ("--servers", "2", "--workers-per-node", "2"),
         "ps-hierarchical-server": ("--servers", "2", "--workers-per-node", "2"),
         "diloco-streaming": ("--fragments", "4", "--overlap-steps", "4")}
#: Cases that run another algorithm than their name.
ALGORITHM = {"ps-server": "ps", "ps-async": "ps", "ps-async-server": "ps", "ps-server-group_topk": "ps",
             "allreduce-group_topk": "allreduce", "diloco-int8": "diloco", "diloco-auto": "diloco",
             "allreduce-hierarchical": "allreduce", "diloco-streaming": "diloco", "ps-hierarchical": "ps",
             "ps-hierarchical-server": "ps"}
#: Lines of a failed run's stderr kept in its row (the run directory is a temporary one).
STDERR_LINES = 200
#: Algorithms whose lost workers are not started again (no kill + restart case).
NO_RESTARTS = {"ps-async-server", "ps-hierarchical", "ps-hierarchical-server"}
#: Cases whose victim is one of the two servers.
SERVER_VICTIM = {"ps-server", "ps-async-server", "ps-server-group_topk", "ps-hierarchical-server"}
#: Epochs of the kill cases where the default job's 15 are too short for a restart: DiLoCo trains
#: them in about 5 s here (930 steps of about 6 ms), and a restarted worker needs about 3 s to
#: start, load its data and join, so a kill in the run's second quarter left it nothing to join.
#: 45 epochs take about as long as all-reduce's default job (about 16 s).
EPOCHS = {"diloco": 45, "diloco-int8": 45, "diloco-auto": 45, "diloco-streaming": 45}
#: A goodput pair's fault-free run lasts at least this many kill intervals (else longer epochs).
LONG_ENOUGH = 2
#: Settings of every run from the command line: ``kill_at`` (``step``: as a step begins; ``time``:
#: at a moment drawn over the training time), ``network`` (a preset for every run, or None) and
#: ``epochs`` (None: the job's, or ``EPOCHS``).
OPTIONS: dict = {"kill_at": "step", "network": None, "epochs": None}


def children(pid: int) -> list[int]:
    """Direct child processes of ``pid`` (Linux /proc)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for child in children(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return b""


def worker_processes(launcher: int) -> list[int]:
    """The processes a launcher started for its ranks: its children started by spawn, or the
    children of its fork server (which distrain's launcher uses where the platform has one)."""
    found = []
    for child in children(launcher):
        command = cmdline(child)
        if b"forkserver" in command:
            found += children(child)
        elif b"spawn_main" in command and b"resource_tracker" not in command:
            found.append(child)
    return found


def train(run_dir: Path, algorithm: str, seed: int, *flags: str, env: dict | None = None,
          killer: threading.Event | None = None, kill_every: float = 0.0) -> dict:
    """One ``distrain train`` run; with ``kill_every``, a random live worker is killed every so many
    seconds (until the run ends). Returns what the run showed."""
    cmd = [sys.executable, "-m", "distrain", "train", "--algorithm", ALGORITHM.get(algorithm, algorithm), "--workers", str(WORKERS),
           "--seed", str(seed), "--no-progress", "--run-dir", str(run_dir), *EXTRA.get(algorithm, ()), *flags,
           *(("--network", OPTIONS["network"]) if OPTIONS["network"] else ())]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    kills: list[float] = []
    if kill_every:
        def chaos() -> None:
            rng = random.Random(seed)
            while proc.poll() is None:
                deadline = time.monotonic() + kill_every
                while time.monotonic() < deadline and proc.poll() is None:
                    time.sleep(0.1)
                live = worker_processes(proc.pid)
                if proc.poll() is None and live:
                    os.kill(rng.choice(live), signal.SIGKILL)
                    kills.append(time.time())
        thread = threading.Thread(target=chaos, daemon=True)
        thread.start()
    try:
        _, stderr = proc.communicate(timeout=TIMEOUT_S)
        hung = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        hung = True
    wall = time.perf_counter() - started
    time.sleep(0.5)
    left = [p for p in descendants(proc.pid)] if proc.poll() is None else []
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    return {"returncode": proc.returncode, "hung": hung, "left_running": left, "command_wall_s": wall,
            "summary": summary, "stderr_tail": stderr.strip().splitlines()[-3:], "kills": kills,
            "stderr": stderr}


def epochs(algorithm: str) -> tuple[str, ...]:
    """The ``--epochs`` flag of an algorithm's kill cases, where it is not the default job's
    (``--epochs`` given: that, for every algorithm)."""
    if OPTIONS["epochs"] is not None:
        return ("--epochs", str(OPTIONS["epochs"]))
    return ("--epochs", str(EPOCHS[algorithm])) if algorithm in EPOCHS else ()


def useful_samples(summary: dict, batch: int) -> float:
    """Samples of the steps the model took: per step, the members then times the batch size."""
    total, members, at, samples = summary["steps"], summary["workers"], 0, 0.0
    for change in summary["membership"]:
        step = change.get("lost_at_step", change.get("joined_at_step"))
        samples += (step - at) * members * batch
        at, members = step, len(change["members"])
    return samples + (total - at) * members * batch


def churn_case(tmp: Path, algorithm: str, seed: int, restart: bool, total_steps: int, reference: float,
               training_s: float, clean_wall_s: float) -> dict:
    rng = random.Random(1000 * seed + restart)
    victim = rng.randrange(WORKERS)
    if algorithm in SERVER_VICTIM:  # one of the two servers (global ranks after the workers')
        victim = WORKERS + rng.randrange(2)
    step = rng.randint(max(1, int(0.05 * total_steps)), int((0.5 if restart else 0.95) * total_steps))
    mark = tmp / f"{algorithm}-{seed}-{restart}-mark"
    run_dir = tmp / f"{algorithm}-{seed}-{'restart' if restart else 'kill'}"
    flags = ("--max-restarts", "1") if restart else ()
    if OPTIONS["kill_at"] == "time":  # the same share of the run, as seconds of the fault-free run's training
        after = round(step / total_steps * training_s, 3)
        inject, step = {"DISTRAIN_INJECT_KILL_AFTER": f"{victim}:{after}"}, None
    else:
        inject, after = {"DISTRAIN_INJECT_KILL": f"{victim}:{step}"}, None
    out = train(run_dir, algorithm, seed, *epochs(algorithm), *flags, env={**inject, "DISTRAIN_INJECT_MARK": str(mark)})
    summary = out.pop("summary")
    stderr = out.pop("stderr")
    killed_at = float(mark.read_text().split()[0]) if mark.is_file() else None
    lost = [c for c in (summary or {}).get("membership", []) if c["event"] == "lost"]
    if not lost and summary and summary.get("lost_workers"):  # no membership change: the servers lost it
        declared = summary["lost_workers"]
        lost = [{"unix_time": min(declared.values()), "workers": sorted(int(r) for r in declared)}]
    if not lost and summary and summary.get("lost_servers"):  # taken over by the other servers
        declared = summary["lost_servers"]
        lost = [{"unix_time": min(declared.values()), "workers": sorted(WORKERS + int(s) for s in declared)}]
    row = {"seed": seed, "victim": victim, "step": step, "after_s": after, "restart": restart, **out,
           "workers_at_end": summary["workers_at_end"] if summary else None,
           "final_test_accuracy": summary["final_test_accuracy"] if summary else None,
           "recovery_s": lost[0]["unix_time"] - killed_at if lost and killed_at else None,
           # from the failure a survivor saw to the new group (DiLoCo sees it at its round's sync)
           "rebuild_s": lost[0].get("recovery_s") if lost else None,
           "lost": lost[0]["workers"] if lost else None,
           # recoveries in which nobody was lost (a false alarm: each costs a wait of its own)
           "false_recoveries": sum(1 for c in lost if not c["workers"]),
           # what the fault cost the run in wall time, against its fault-free twin
           "slowdown_s": out["command_wall_s"] - clean_wall_s,
           # ps: workers that took a lost server's answer of a step from one it had answered
           "answer_taken": stderr.count("its answer taken from a worker"),
           "returned": sorted(WORKERS + int(s) for s in (summary or {}).get("returned_servers", {})),
           # ps-server with a restart: from the kill to the server serving its range again
           "back_s": (min((summary or {}).get("returned_servers", {}).values(), default=0.0) - killed_at
                      if killed_at and (summary or {}).get("returned_servers") else None)}
    row["accuracy_minus_no_fault"] = (row["final_test_accuracy"] - reference
                                      if row["final_test_accuracy"] is not None else None)
    want = WORKERS if restart or algorithm in SERVER_VICTIM else WORKERS - 1
    back = [victim] if restart and algorithm in SERVER_VICTIM else []  # a server started again takes its range back
    row["passed"] = (out["returncode"] == 0 and not out["hung"] and not out["left_running"]
                     and row["lost"] == [victim] and row["workers_at_end"] == want and row["returned"] == back
                     and row["false_recoveries"] == 0)
    if not row["passed"]:  # the whole story of a failure (its warnings, every worker's last word)
        row["stderr_lines"] = [line.replace(str(tmp), "<tmp>") for line in stderr.strip().splitlines()[-STDERR_LINES:]]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithms", default="allreduce")
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--goodput-repeats", type=int, default=3)
    parser.add_argument("--goodput-epochs", type=float, default=80)
    parser.add_argument("--kill-every", type=float, default=30.0)
    parser.add_argument("--part", choices=("kill", "goodput", "noise", "all"), default="all")
    parser.add_argument("--noise-out", type=Path, default=RESULTS / "churn_noise.json")
    parser.add_argument("--out", type=Path, default=RESULTS / "churn.json")
    parser.add_argument("--goodput-out", type=Path, default=RESULTS / "churn_goodput.json")
    parser.add_argument("--kill-at", choices=("step", "time"), default="step",
                        help="kill cases: as a random step begins, or at a random moment (the same share of "
                             "the fault-free run's training time), wherever the victim is then")
    parser.add_argument("--network", default=None, help="a network preset for every run (default: none)")
    parser.add_argument("--epochs", type=float, default=None, help="every run's epochs (default: the job's)")
    args = parser.parse_args()
    check_repeats(parser, args.goodput_repeats)
    OPTIONS.update(kill_at=args.kill_at, network=args.network, epochs=args.epochs)
    result: dict = {"workers": WORKERS, "seeds": args.seeds, "cpus": os.cpu_count(), "algorithms": {}}
    goodput: dict = {"workers": WORKERS, "epochs": args.goodput_epochs, "kill_every_s": args.kill_every,
                     "cpus": os.cpu_count(), "algorithms": {}}
    noise: dict = {"workers": WORKERS, "seeds": args.seeds, "cpus": os.cpu_count(), "algorithms": {}}
    with tempfile.TemporaryDirectory(prefix="bench_churn-") as tmp_name:
        tmp = Path(tmp_name)
        for algorithm in args.algorithms.split(","):
            if args.part in ("kill", "all"):
                kill_part(tmp, algorithm, args.seeds, result)
            if args.part in ("goodput", "all"):
                goodput_part(tmp, algorithm, args, goodput)
            if args.part == "noise":
                noise_part(tmp, algorithm, args.seeds, noise)
    if args.part in ("kill", "all"):
        print(f"wrote {write_result(args.out, result)}")
    if args.part in ("goodput", "all"):
        print(f"wrote {write_result(args.goodput_out, goodput)}")
    if args.part == "noise":
        print(f"wrote {write_result(args.noise_out, noise)}")


def noise_part(tmp: Path, algorithm: str, seeds: int, noise: dict) -> None:
    """Each seed's fault-free run twice: how far apart the same run ends by itself."""
    rows = []
    for seed in range(seeds):
        pair = []
        for repeat in range(2):
            run = train(tmp / f"{algorithm}-{seed}-noise-{repeat}", algorithm, seed, *epochs(algorithm))
            assert run["returncode"] == 0 and run["summary"] is not None, run["stderr_tail"]
            pair.append(run["summary"]["final_test_accuracy"])
        rows.append({"seed": seed, "first": pair[0], "second": pair[1], "second_minus_first": pair[1] - pair[0]})
        print(f"{algorithm} seed {seed} fault-free twice: {pair[0]} {pair[1]}", flush=True)
    gaps = [r["second_minus_first"] for r in rows]
    noise["algorithms"][algorithm] = {"epochs": EPOCHS.get(algorithm, "default"), "second_minus_first": spread(gaps),
                                      "within_1_point": sum(abs(g) <= 0.01 for g in gaps), "runs": rows}
    print(f"{algorithm}: fault-free twins within 1 point {noise['algorithms'][algorithm]['within_1_point']}/{seeds}",
          flush=True)


def kill_part(tmp: Path, algorithm: str, seeds: int, result: dict) -> None:
    rows = []
    for seed in range(seeds):
        clean = train(tmp / f"{algorithm}-{seed}-clean", algorithm, seed, *epochs(algorithm))
        summary = clean["summary"]
        assert clean["returncode"] == 0 and summary is not None, clean["stderr_tail"]
        for restart in (False,) if algorithm in NO_RESTARTS else (False, True):
            row = churn_case(tmp, algorithm, seed, restart, summary["steps"], summary["final_test_accuracy"],
                             summary["wall_time_s"], clean["command_wall_s"])
            row["no_fault_accuracy"] = summary["final_test_accuracy"]
            rows.append(row)
            at = f"step {row['step']}" if row["step"] is not None else f"{row['after_s']} s"
            print(f"{algorithm} seed {seed} {'restart' if restart else 'kill'}: rank {row['victim']} at {at}: "
                  f"{'ok' if row['passed'] else 'FAILED'}, {row['workers_at_end']} workers at the end, recovery {row['recovery_s']}, accuracy {row['accuracy_minus_no_fault']}",
                  flush=True)
    kills = [r for r in rows if not r["restart"]]
    restarts = [r for r in rows if r["restart"]]
    gaps = [r["accuracy_minus_no_fault"] for r in kills if r["accuracy_minus_no_fault"] is not None]
    recoveries = [r["recovery_s"] for r in rows if r["recovery_s"] is not None]
    result["algorithms"][algorithm] = {
        "epochs": OPTIONS["epochs"] or EPOCHS.get(algorithm, "default"), "kill_at": OPTIONS["kill_at"],
        "network": OPTIONS["network"],
        "kill_passed": sum(r["passed"] for r in kills), "kill_runs": len(kills),
        "restart_passed": sum(r["passed"] for r in restarts), "restart_runs": len(restarts),
        "hung": sum(r["hung"] for r in rows), "left_running": sum(bool(r["left_running"]) for r in rows),
        "recovery_s": spread(recoveries),
        "slowdown_s": spread([r["slowdown_s"] for r in rows]),
        "false_recoveries": sum(r["false_recoveries"] for r in rows),
        "rebuild_s": spread([r["rebuild_s"] for r in rows if r.get("rebuild_s") is not None]),
        "accuracy_minus_no_fault": spread(gaps),
        "within_1_point": sum(abs(g) <= 0.01 for g in gaps),
        "runs_with_answer_taken": sum(r["answer_taken"] > 0 for r in rows),
        "recovery_at_most_3_s": bool(recoveries) and statistics.median(recoveries) <= 3.0,
        **({"back_s": spread(backs)} if (backs := [r["back_s"] for r in restarts if r.get("back_s") is not None])
           else {}),
        "runs": rows}
    print(f"{algorithm}: kill {result['algorithms'][algorithm]['kill_passed']}/{len(kills)}, restart "
          f"{result['algorithms'][algorithm]['restart_passed']}/{len(restarts)}, recovery median "
          f"{statistics.median(recoveries) if recoveries else None}, accuracy within 1 point "
          f"{result['algorithms'][algorithm]['within_1_point']}/{len(gaps)}", flush=True)


def goodput_part(tmp: Path, algorithm: str, args: argparse.Namespace, goodput: dict) -> None:
    pairs = []
    for repeat in range(args.goodput_repeats):
        epochs = args.goodput_epochs
        clean = train(tmp / f"{algorithm}-goodput-{repeat}-clean", algorithm, repeat, "--epochs", str(epochs))
        wall = clean["summary"]["wall_time_s"]
        if wall < LONG_ENOUGH * args.kill_every:  # too short for the kills: as long as LONG_ENOUGH intervals
            epochs = math.ceil(epochs * LONG_ENOUGH * args.kill_every / wall)
            clean = train(tmp / f"{algorithm}-goodput-{repeat}-clean-longer", algorithm, repeat, "--epochs", str(epochs))
        flags = ("--epochs", str(epochs))
        churn = train(tmp / f"{algorithm}-goodput-{repeat}-churn", algorithm, repeat, *flags,
                      "--max-restarts", "10", kill_every=args.kill_every)
        c, k = clean["summary"], churn["summary"]
        batch = c["global_batch"] // WORKERS
        pair = {"repeat": repeat, "epochs": epochs, "no_fault_samples_per_s": c["samples_per_s"],
                "no_fault_wall_s": c["wall_time_s"], "kills": len(churn["kills"]),
                "returncode": churn["returncode"], "membership": k["membership"] if k else None,
                "churn_wall_s": k["wall_time_s"] if k else None,
                "useful_samples_per_s": useful_samples(k, batch) / k["wall_time_s"] if k else None}
        pair["goodput"] = (pair["useful_samples_per_s"] / c["samples_per_s"]
                           if pair["useful_samples_per_s"] is not None else None)
        pairs.append(pair)
        print(f"{algorithm} goodput {repeat}: {pair['kills']} kills, {pair['goodput']}", flush=True)
    goodputs = [p["goodput"] for p in pairs if p["goodput"] is not None and p["kills"] > 0]  # (no kill: no churn)
    goodput["algorithms"][algorithm] = {**spread(goodputs), "pairs": pairs,
                                        "at_least_0_85": bool(goodputs) and statistics.median(goodputs) >= 0.85}


if __name__ == "__main__":
    main()
