"""Two Nsight Compute CSVs of the same steps (node mode, `--metrics gpu__time_duration.sum
--csv`), side by side by kernel and grid size: how many launches and how many µs each
arrangement spent there. The grid tells which matrix a quantized product read (the 32B's
gate/up, q, k and v launch different grids), which the name alone does not.

    python3 docs/benchmarks-data/ncu-by-kernel.py BEFORE.log AFTER.log [--top 30]
"""

from __future__ import annotations

import argparse
import csv
import io
from pathlib import Path

from mtplxd.engine.bench.step_profile import durations_by


def by_kernel_and_grid(path: Path) -> dict[tuple[str, str], list[float]]:
    """{(kernel name up to its arguments, grid): [launches, µs]} over the CSV's rows."""
    grouped = durations_by(path.read_text(errors="replace"),
                           lambda row: (row["Kernel Name"].split("(")[0][:72], row["Grid Size"]))
    return {key: [len(ms), 1000 * sum(ms)] for key, ms in grouped.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    before, after = by_kernel_and_grid(args.before), by_kernel_and_grid(args.after)
    keys = sorted(set(before) | set(after),
                  key=lambda k: -max(before.get(k, [0, 0])[1], after.get(k, [0, 0])[1]))
    out = io.StringIO()
    table = csv.writer(out, delimiter="|", lineterminator="\n")
    table.writerow(["kernel", "grid", "before n", "before us", "after n", "after us"])
    for key in keys[:args.top]:
        b, a = before.get(key, [0, 0.0]), after.get(key, [0, 0.0])
        table.writerow([key[0], key[1], b[0], f"{b[1]:.0f}", a[0], f"{a[1]:.0f}"])
    table.writerow(["all", "", sum(v[0] for v in before.values()), f"{sum(v[1] for v in before.values()):.0f}",
                    sum(v[0] for v in after.values()), f"{sum(v[1] for v in after.values()):.0f}"])
    print(out.getvalue(), end="")


if __name__ == "__main__":
    main()
