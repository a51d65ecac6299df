#!/usr/bin/env bash
# MLX's compiled CUDA kernels, carried from one lease's machine to the next one's.
#
# Why: a fresh H200 machine's first MLX process spends ~140-200 s compiling kernels with NVRTC
# (docs/benchmarks.md, "Where the 32B's decode time goes": 192 s in one decode phase), about a
# ninth of a 30-minute lease, and every later process on that machine reuses the result from
# the engine's PTX cache, $MTPLX_HOME/cache/ptx/<mlx version>/<GPU model> (docs/engine.md). The
# cache is plain PTX keyed by MLX's version and the GPU's model, so a lease's cache serves the
# next lease's H200 with the same wheel.
#
#   save OUT     at the end of a lease's last run (the machine still warm): the cache, gzipped,
#                into OUT as ptx-cache.tgz.00, .01, ... (15 MiB each: a file from $OUT comes
#                back only under 16 MiB)
#   restore DIR  after installing MLX on a fresh machine: unpack DIR/ptx-cache.tgz.* into the
#                cache (what is there already stays; a part from another MLX version or GPU
#                lands in its own folder and is never read)
#
# Between leases, here: mkdir -p .gpu-ptx && cp FILES_AT/ptx-cache.tgz.* .gpu-ptx/ (.gpu-ptx is
# git-ignored through .git/info/exclude, as the wheel's parts are), then carry ".gpu-ptx" alone in a
# run (beside a wheel part the 64 MiB a run carries is passed): bash docs/benchmarks-data/ptx-cache.sh
# restore .gpu-ptx (training/README.md).
set -euo pipefail
cache_root=${MTPLX_HOME:-/root/mtplx-home}/cache
case "${1:-}" in
  save)
    out=${2:?usage: ptx-cache.sh save OUT}
    if [ ! -d "$cache_root/ptx" ]; then echo "no PTX cache under $cache_root"; exit 0; fi
    echo "caching $(find "$cache_root/ptx" -type f | wc -l) files, $(du -sh "$cache_root/ptx" | cut -f1)"
    tar czf - -C "$cache_root" ptx | split -b 15m -d - "$out/ptx-cache.tgz."
    ls -l "$out"/ptx-cache.tgz.*
    ;;
  restore)
    dir=${2:?usage: ptx-cache.sh restore DIR}
    mkdir -p "$cache_root"
    cat "$dir"/ptx-cache.tgz.* | tar xzf - -C "$cache_root" --skip-old-files
    echo "PTX cache: $(find "$cache_root/ptx" -type f | wc -l) files under $cache_root/ptx"
    ;;
  *)
    echo "usage: ptx-cache.sh save OUT | restore DIR" >&2
    exit 2
    ;;
esac
