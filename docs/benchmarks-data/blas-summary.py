"""Summarize blas-side-by-side.sh's JSON: medians per side, pooled over rounds.

    python docs/benchmarks-data/blas-summary.py docs/benchmarks-data/blas
"""

import json
import statistics
import sys
from pathlib import Path


def load(folder: Path, kind: str, side: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob(f"{kind}-{side}-*.json"))]


def main(folder: Path) -> None:
    for side in ("before", "after"):
        prefill = load(folder, "prefill", side)
        bench = load(folder, "bench", side)
        if not prefill and not bench:
            continue
        rounds = max(len(prefill), len(bench))
        print(f"{side} ({rounds} rounds)")
        lengths = sorted({row["tokens"] for report in prefill for row in report["prefill"]})
        for n in lengths:
            rates = [r for report in prefill for row in report["prefill"] if row["tokens"] == n
                     for r in row["runs"]]
            print(f"  prefill {n:>6}: {statistics.median(rates):7.1f} tok/s  runs {[round(r, 1) for r in rates]}")
        for t in ("0.0", "0.6"):
            entries = [report["temperatures"][t] for report in bench if t in report["temperatures"]]
            if not entries:
                continue
            ar = statistics.median(x for e in entries for x in e["ar"]["decode_tokens_per_second_all"])
            mtp = statistics.median(x for e in entries for x in e["mtp"]["decode_tokens_per_second_all"])
            ratio = [round(e["speedup_all_tokens"], 2) for e in entries]
            same = [e.get("greedy_identical") for e in entries]
            print(f"  T={t}: AR {ar:5.1f} tok/s, MTP {mtp:5.1f} tok/s, MTP/AR all tokens {ratio}"
                  + (f", greedy identical {same}" if t == "0.0" else ""))
        if bench:
            print(f"  model dtype {bench[0]['model'].get('dtype', 'bfloat16 (as stored)')}, "
                  f"blas {(bench[0].get('blas') or {}).get('summary', 'bundled (before mtplxd.blas)')}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
