"""Peak resident memory per worker of a language model trained with 4 workers (default: the ~25M `medium` GPT).

Runs ``distrain train --model gpt --model-size SIZE --dataset text --workers 4`` for a few steps
(``--epochs`` of it, 0.1 by default: a handful of steps) on a small text folder made here from the Python standard library (20
files, their first 8 KB each, so that the final evaluation of the validation file stays short on
a CPU), while a watcher reads every process under the command every 0.2 s: a worker's peak is its
``VmHWM`` (the kernel's high-water mark of its resident set, in /proc), read last just before the
process exits. The figures per repeat: each worker's peak in MiB, their sum, the machine's memory,
and whether the run finished. The statistic: the median over ``--repeats`` (3) of the largest
worker's peak and of the sum, with min and max.

    python benchmarks/bench_lm_memory.py
    python benchmarks/bench_lm_memory.py --size small --repeats 1     # a quick look

Writes ``benchmarks/results/lm_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

from provenance import check_repeats, write_result

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
WORKERS = 4
FILES, HEAD_BYTES = 20, 8192


def make_corpus(folder: Path) -> list[str]:
    """The first ``HEAD_BYTES`` of the first ``FILES`` standard-library modules (sorted names)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = sorted(p for p in stdlib.glob("*.py") if p.stat().st_size > HEAD_BYTES)[:FILES]
    for p in sources:
        (folder / p.name).write_bytes(p.read_bytes()[:HEAD_BYTES])
    return [p.name for p in sources]


def descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def high_water_kib(pid: int) -> tuple[int, str] | None:
    """(VmHWM in KiB, command line) of ``pid``, None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]), cmdline
    return None


def run(size: str, epochs: float, data: Path, run_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "distrain", "train", "--model", "gpt", "--model-size", size, "--dataset", "text",
           "--data-path", str(data), "--workers", str(WORKERS), "--run-dir", str(run_dir), "--no-progress",
           "--epochs", str(epochs)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
    peaks: dict[int, tuple[int, str]] = {}
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            for pid in descendants(proc.pid):
                seen = high_water_kib(pid)
                if seen is not None and seen[0] >= peaks.get(pid, (0, ""))[0]:
                    peaks[pid] = seen
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    started = time.perf_counter()
    watcher.start()
    rc = proc.wait(timeout=3600)
    done.set()
    watcher.join()
    wall = time.perf_counter() - started
    # the workers are the launcher's ``spawn`` children (not the command itself, nor the
    # multiprocessing resource tracker)
    workers = sorted(kib / 1024 for kib, line in peaks.values() if "multiprocessing.spawn" in line)
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    config = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").exists() else {}
    return {"returncode": rc, "finished": rc == 0 and bool(summary), "wall_s": wall,
            "worker_peak_mib": workers, "largest_worker_mib": max(workers) if workers else None,
            "sum_workers_mib": sum(workers), "steps": summary.get("steps"), "parameters": config.get("model_parameters"),
            "final_val_bpb": summary.get("final_val_bpb")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="medium", help="--model-size (default: medium, ~25M parameters)")
    parser.add_argument("--epochs", type=float, default=0.1, help="epochs of the small corpus to train (default 0.1)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "lm_memory.json")
    args = parser.parse_args()
    check_repeats(parser, args.repeats)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_lm_memory-") as tmp:
        data = Path(tmp) / "text"
        data.mkdir()
        files = make_corpus(data)
        for repeat in range(args.repeats):
            row = run(args.size, args.epochs, data, Path(tmp) / f"run-{repeat}")
            rows.append(row)
            print(f"repeat {repeat}: finished {row['finished']}, {row['steps']} steps in {row['wall_s']:.0f} s, "
                  f"workers' peaks {', '.join(f'{m:.0f}' for m in row['worker_peak_mib'])} MiB", flush=True)
    largest = [r["largest_worker_mib"] for r in rows if r["largest_worker_mib"] is not None]
    total = [r["sum_workers_mib"] for r in rows]
    memory_kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                      if line.startswith("MemTotal:"))
    summary = {"largest_worker_mib": {"median": statistics.median(largest), "min": min(largest), "max": max(largest)}
               if largest else None,
               "sum_workers_mib": {"median": statistics.median(total), "min": min(total), "max": max(total)},
               "machine_memory_mib": memory_kib / 1024, "all_finished": all(r["finished"] for r in rows)}
    print(f"largest worker {summary['largest_worker_mib']}; sum {summary['sum_workers_mib']}")
    result = {"size": args.size, "workers": WORKERS, "epochs": args.epochs, "corpus_files": files,
              "head_bytes": HEAD_BYTES, "cpus": os.cpu_count(), "summary": summary, "runs": rows}
    print(f"wrote {write_result(args.out, result)}")


if __name__ == "__main__":
    main()
