"""Benchmarks: scripts, not timed tests. `harness` holds what they share (warm-up and median
timing, interleaved A/B runs, paired ratios, the JSON report); each other module is one
`python -m mtplxd.engine.bench.NAME` command (`python -m mtplxd.engine.bench` runs `decode`).

May import anything in `mtplxd.engine`, fixtures included. Nothing in the runtime path
(loading, generation, the daemon) imports this package.
"""
