"""The session bank: prefix caches of past turns kept in RAM (`bank`) and on SSD (`store`),
and the data types both share (`types`).

May import: mlx, mlx-lm, numpy, `mtplxd.engine.interface` and `mtplxd.engine.model`; never the
decoding loops, benchmarks or fixtures.
"""
