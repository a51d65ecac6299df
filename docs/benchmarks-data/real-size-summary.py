"""Markdown tables from the real-size and kernel benches' JSON (docs/benchmarks.md, issue 22).

    python docs/benchmarks-data/real-size-summary.py REPORT.json [...]

Takes reports of `python -m mtplxd.engine.bench.real_size` and of
`python -m mtplxd.engine.bench.small_m`, in any order, and prints one table per kind.
"""

from __future__ import annotations

import json
import sys


def real_size_rows(report: dict) -> list[str]:
    rows = []
    for c in report["configs"]:
        d0, d6 = c["decode"]["0.0"], c["decode"]["0.6"]
        fwd = c["forward_over_one_token"]
        kernel = c.get("forward_over_one_token_small_m_kernel")
        # A lean run (--cycle-temperatures 0.6) times no T=0 cycles: shown as "-".
        cyc = c["cycles"].get("0.0", {}).get("cycle_over_decode_by_depth", {})
        cyc_s = c["cycles"]["0.6"]["cycle_over_decode_by_depth"]
        proj = c["cycles"]["0.6"]["projected_mtp_over_ar"]
        rows.append(
            f"| {c['size']} | {c['dtype']} | {c['weights_bytes'] / 1e9:.1f} | {c['roofline_ms']:.2f} "
            f"| {d0['ours_ms']:.2f} / {d0['mlx_lm_ms']:.2f} | {c['of_roofline']:.0%} / {c['mlx_lm_of_roofline']:.0%} "
            f"| {d6['ours_ms']:.2f} / {d6['mlx_lm_ms']:.2f} "
            f"| {' / '.join(f'{fwd[k]:.2f}' for k in ('2', '3', '4', '5', '6'))} "
            f"| {' / '.join(f'{kernel[k]:.2f}' for k in ('2', '4', '6')) if kernel else '-'} "
            f"| {' / '.join(f'{v:.2f}' for v in cyc.values()) or '-'} | {' / '.join(f'{v:.2f}' for v in cyc_s.values())} "
            f"| {' / '.join(f'{v:.2f}' for v in proj.values())} |")
    return rows


REAL_SIZE_HEADER = (
    "| size | dtype | weights GB | roofline ms | decode ms T=0, ours / mlx-lm | of roofline, ours / mlx-lm "
    "| decode ms T=0.6, ours / mlx-lm | forward of 2/3/4/5/6 tokens x 1-token | same, small-M kernel 2/4/6 "
    "| cycle / decode by depth, T=0 | same, T=0.6 | projected MTP/AR at T=0.6 by depth |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|")


def small_m_rows(report: dict) -> list[str]:
    rows = []
    for r in report["results"]:
        kernel = (f"{r['kernel_us']:.1f} | {r['kernel_over_mlx']:.2f} | {r['kernel_error']:.1e}"
                  if r["kernel_us"] is not None else "- | - | -")
        rows.append(f"| {r['size']} | {r['matrix']} {r['N']}x{r['K']} | {r['bits']} | {r['M']} "
                    f"| {r['mlx_us']:.1f} | {r['mlx_of_roofline']:.0%} | {r['mlx_error']:.1e} | {kernel} |")
    return rows


SMALL_M_HEADER = ("| size | matrix | bits | M | mlx us | mlx of roofline | mlx error | kernel us "
                  "| kernel / mlx | kernel error |\n|---|---|---|---|---|---|---|---|---|---|")


def main(paths: list[str]) -> int:
    real, small = [], []
    for path in paths:
        report = json.load(open(path))
        (real if "configs" in report else small).append(report)
    if real:
        print(REAL_SIZE_HEADER)
        for report in real:
            print("\n".join(real_size_rows(report)))
    if small:
        print()
        print(SMALL_M_HEADER)
        for report in small:
            print("\n".join(small_m_rows(report)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
