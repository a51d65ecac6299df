"""Markdown table of bench.small_m reports: MLX's time per call and each kernel layout's time
over it, per matrix, bit width and row count.
    python docs/benchmarks-data/small-m-layouts-table.py small-m-32b.json [more.json ...]"""
import json
import sys

print("| size | matrix | bits | M | mlx µs | mlx of roofline | word / mlx | vector / mlx by columns per block |")
print("|---|---|---|---|---|---|---|---|")
for path in sys.argv[1:]:
    for row in json.load(open(path))["results"]:
        if row.get("kernel_us") is None:
            continue
        vector = ", ".join(f"{cols}: {us / row['mlx_us']:.2f}" for cols, us in sorted(
            row["vector_us_by_columns"].items(), key=lambda kv: int(kv[0])))
        print(f"| {row['size']} | {row['matrix']} | {row['bits']} | {row['M']} | {row['mlx_us']:.1f} | "
              f"{row['mlx_of_roofline']:.0%} | {row['kernel_over_mlx']:.2f} | {vector} |")
