"""The CPU replay's wall time with the weightless stand-ins (``models="scripted"``, before issue 37)
and with the tiny checkpoint's weights (``models="tiny"``, the default now): scenario ``mixed``,
PCP=2, K=2, the dummy run included, no trace; the two interleaved, median and min-max of N repeats,
the command recorded in the JSON.

    python benchmarks/bench_replay_models.py --repeats 5 --out data/bench/replay_models.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from pcpviz.vllm import replay


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    replay(pcp=2, mtp=2, scenario="mixed", record=False, models="tiny")  # warm-up: imports, checkpoint load
    times: dict[str, list[float]] = {"scripted": [], "tiny": []}
    for _ in range(args.repeats):
        for models in times:
            t = time.perf_counter()
            replay(pcp=2, mtp=2, scenario="mixed", record=False, models=models)
            times[models].append(time.perf_counter() - t)
    doc = {"command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]), "scenario": "mixed", "pcp": 2,
           "k": 2, "seconds": {m: {"median": statistics.median(v), "min": min(v), "max": max(v), "all": v}
                               for m, v in times.items()}}
    print(json.dumps(doc, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
