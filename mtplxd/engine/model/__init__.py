"""The model and its caches: checkpoint loader, family registry, trunk, MTP head, the hybrid
Gated-DeltaNet families, the KV caches and the GDN rollback cache.

May import: mlx, mlx-lm, numpy and `mtplxd.engine.interface`; nothing else of mtplxd (the
decoding loops, the session bank, benchmarks and fixtures all stand above this room).
"""
