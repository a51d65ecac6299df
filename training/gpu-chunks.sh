#!/usr/bin/env bash
# Re-split the MLX CUDA wheels of ../shared/gpu/prepare-mlx-cuda.sh (.gpu-a + .gpu-b) into eight
# git-ignored folders .gpu-1 .. .gpu-8 of ~11 MB each. Needed since the repository itself carries
# the 35 MB embedded model: tracked files + a part must fit one 64 MiB transfer. Four parts
# (22.4 MB) stopped fitting on 2026-12-03 (tracked 44 MB), five (18 MB, 19 with the small wheels)
# on 2026-12-06 (tracked 49 MB, the Nsight logs under docs/benchmarks-data/); six (15 MB, 16.3
# with the small wheels) left 0.5 MB to spare later that day (tracked 50.3 MB); seven (12.8 MB,
# 14.1 with them) 1.7 MB on 2026-12-07 (tracked 51.2 MB).
# Device runs, one right after the other (the machine keeps /root while it stays warm):
#   carry [".gpu-1"]: bash .gpu-1/stage.sh      ... likewise .gpu-2 .. .gpu-7
#   carry [".gpu-8", ...]: bash .gpu-8/stage.sh && bash .gpu-8/install.sh && export PYTHONPATH=$PWD:/root/site
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
test -f .gpu-a/cuda.part.aa -a -f .gpu-b/cuda.part.ab || { echo "run ../shared/gpu/prepare-mlx-cuda.sh first"; exit 2; }
tmp=$(mktemp -d)
cat .gpu-a/cuda.part.aa .gpu-b/cuda.part.ab > "$tmp/cuda.whl"
echo "$(cat .gpu-b/cuda.sha256)  $tmp/cuda.whl" | sha256sum -c - >/dev/null
parts=8
last=".gpu-$parts"
rm -rf .gpu-[0-9]
split -n $parts -d "$tmp/cuda.whl" "$tmp/part."
for i in $(seq 1 $parts); do
  d=".gpu-$i"
  grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude
  rm -rf "$d" && mkdir -p "$d"
  mv "$tmp/part.0$((i-1))" "$d/"
  printf '#!/usr/bin/env bash\nset -e; mkdir -p /root/mlx-stage; cp %s/part.* /root/mlx-stage/; ls /root/mlx-stage\n' "$d" > "$d/stage.sh"
done
cp .gpu-a/mlx-*.whl .gpu-a/mlx_lm-*.whl .gpu-1/
cp .gpu-b/cuda.name .gpu-b/cuda.sha256 "$last/"
cat > "$last/install.sh" <<EOS
#!/usr/bin/env bash
set -e
if python3 -c 'import sys; sys.path.insert(0, "/root/site"); import mlx.core as mx; mx.eval(mx.ones(1, stream=mx.gpu))' 2>/dev/null; then
  echo "mlx-cuda already installed in /root/site"; exit 0; fi
cp .gpu-1/*.whl /root/mlx-stage/ 2>/dev/null || true
name=\$(cat $last/cuda.name)
cat /root/mlx-stage/part.0[0-$((parts - 1))] > "/root/mlx-stage/\$name"
echo "\$(cat $last/cuda.sha256)  /root/mlx-stage/\$name" | sha256sum -c -
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /root/site \
  "/root/mlx-stage/\$name" /root/mlx-stage/mlx-*.whl /root/mlx-stage/mlx_lm-*.whl
python3 -c 'import sys; sys.path.insert(0, "/root/site"); import mlx.core as mx; print("mlx", mx.__version__, mx.default_device())'
EOS
chmod +x .gpu-*/stage.sh "$last/install.sh"
# The small mlx wheels travel with part 1 and are staged with it.
sed -i 's#cp .gpu-1/part.\* /root/mlx-stage/#cp .gpu-1/part.* .gpu-1/*.whl /root/mlx-stage/#' .gpu-1/stage.sh
rm -rf "$tmp"
du -sh .gpu-[0-9]
