"""Link benchmark: how close distrain's transfers come to an emulated link's capacity.

Runs ``distrain bench link`` in both emulation modes (netns only as root) and writes
``benchmarks/results/link-<mode>.json``. Each transfer is timed ``--repeats`` times (5 by
default); the utilisation reported is the median (``distrain bench link``). Acceptance: utilisation >= 0.90 for the ring all-reduce
and for point-to-point, 10 MB among 4 workers on 100 Mbit/s links.

    python benchmarks/bench_link.py                      # both modes, the acceptance setting
    python benchmarks/bench_link.py --modes model --size 1MB --workers 2
"""

from __future__ import annotations

import argparse
from pathlib import Path

from provenance import check_repeats, write_result

from distrain.bench import LinkBench, format_link_bench, run_link_bench
from distrain.emulation.units import parse_bandwidth, parse_size
from distrain.launch.netns import netns_unavailable

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="model,netns")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--size", default="10MB")
    parser.add_argument("--bandwidth", default="100mbit")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    check_repeats(parser, args.repeats)
    for mode in args.modes.split(","):
        if mode == "netns" and (reason := netns_unavailable()) is not None:
            print(f"skipping netns: {reason}")
            continue
        bench = LinkBench(workers=args.workers, size_bytes=parse_size(args.size), bandwidth_bps=parse_bandwidth(args.bandwidth),
                          emulation=mode, repeats=args.repeats)
        result = run_link_bench(bench)
        print(format_link_bench(result), end="\n\n")
        write_result(RESULTS / f"link-{mode}.json", result)
    print(f"results in {RESULTS}")


if __name__ == "__main__":
    main()
