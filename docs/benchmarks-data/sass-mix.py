"""A CUDA kernel body of the engine compiled for sm_90 without a GPU: its registers and the
instruction mix of its longest loop, from the SASS (what the GPU runs, after ptxas), so that
instructions per weight can be counted here. Nsight Compute found the quantized matvec of a
decode step issuing an instruction every ~1.35 cycles per scheduler at 42% of DRAM bandwidth
(docs/benchmarks.md, "a profile of the quantized matmuls"): the instructions a weight costs
bound how near the bandwidth it can get.

    python3 docs/benchmarks-data/sass-mix.py LAYOUT [NAME=VALUE ...] [--show]

LAYOUT names a body of small_m_qmm (vector, word, mma, mma_pipelined); NAME=VALUE sets its
template constants (defaults: T=__nv_bfloat16 M=1 BITS=4 GS=64 R=8 CONVERT=false U=1
IN_PLACE=false BIAS_ONCE=false PERSISTENT=false HOIST=false MT=1 KW=8 BF16=true S=2), e.g. `vector BITS=8 IN_PLACE=true`. --show prints the
loop's SASS. The body is wrapped in the signature mx.fast.cuda_kernel generates (as
tests/engine/test_small_m_qmm.py's compile test does). Needs NVRTC, its headers and the
disassembler, all wheels (no GPU, no CUDA toolkit):

    python3 -m venv /tmp/nvrtc && /tmp/nvrtc/bin/pip install nvidia-cuda-nvrtc nvidia-cuda-nvdisasm \\
        nvidia-cuda-cuobjdump nvidia-cuda-runtime nvidia-cuda-cccl
    PYTHONPATH=. /tmp/nvrtc/bin/python docs/benchmarks-data/sass-mix.py vector IN_PLACE=true

(mlx is not needed: the kernel sources are read from small_m_qmm.py's text.)
"""

from __future__ import annotations

import argparse
import ctypes
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[2] / "mtplxd/engine/model/small_m_qmm.py"
HELPERS = SOURCE.with_name("custom_kernels.py")  # TENSOR_CORE_HEADER: the mma and cp.async helpers
BODIES = {"vector": "_SOURCE_VECTOR", "word": "_SOURCE", "mma": "_SOURCE_MMA", "mma_pipelined": "_SOURCE_MMA_PIPELINED"}
DEFAULTS = {"T": "__nv_bfloat16", "M": "1", "BITS": "4", "GS": "64", "R": "8", "CONVERT": "false", "U": "1",
            "IN_PLACE": "false", "BIAS_ONCE": "false", "PERSISTENT": "false", "HOIST": "false", "MT": "1", "KW": "8", "BF16": "true", "S": "2"}


def cuda_root() -> Path:
    import nvidia  # the wheels' namespace package
    for base in nvidia.__path__:
        for sub in ("cu13", "cu12", "cuda_nvrtc"):
            if (Path(base) / sub / "lib").is_dir():
                return Path(base) / sub
    sys.exit("no NVRTC wheel found (see the docstring)")


def kernel_source(layout: str, constants: dict[str, str]) -> str:
    """The layout's body with _HEADER, in mx.fast.cuda_kernel's signature and namespace (NVRTC
    has no <cstdint>: its integer types come from libcu++)."""
    text = SOURCE.read_text()

    def body(name: str) -> str:
        return re.search(name + r' = r"""(.*?)"""', text, re.S).group(1)

    lines = "".join(f"  constexpr {'bool' if v in ('true', 'false') else 'int'} {k} = {v};\n"
                    for k, v in constants.items() if k != "T")
    dtype = constants["T"]
    helpers = re.search(r'TENSOR_CORE_HEADER = r"""(.*?)"""', HELPERS.read_text(), re.S).group(1)
    return ("#include <cooperative_groups/reduce.h>\n" + helpers + body("_HEADER") + "#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n#include <cuda/std/cstdint>\n"
            "using cuda::std::int32_t; using cuda::std::uint32_t; using cuda::std::size_t;\n"
            "#include <cooperative_groups.h>\n#include <cuda/std/array>\nnamespace mlx::core::cu {\n"
            "using Shape = cuda::std::array<int32_t, 8>;\nnamespace cg = cooperative_groups;\n"
            f"extern \"C\" __global__ void k(const {dtype}* x, const __grid_constant__ Shape x_shape, "
            f"const uint32_t* w, const __grid_constant__ Shape w_shape, const {dtype}* scales, "
            f"const {dtype}* biases, {dtype}* out) {{\n  using T = {dtype};\n{lines}{body(BODIES[layout])}\n}}\n}}\n")


def compile_cubin(source: str, root: Path) -> bytes:
    nvrtc = ctypes.CDLL(str(next((root / "lib").glob("libnvrtc.so*"))))
    program = ctypes.c_void_p()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(program), source.encode(), b"k.cu", 0, None, None):
        sys.exit("nvrtcCreateProgram failed")
    options = [b"-arch=sm_90", b"-std=c++17", f"-I{root / 'include'}".encode(),
               f"-I{root / 'include' / 'cccl'}".encode()]
    failed = nvrtc.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options))
    size = ctypes.c_size_t()
    if failed:
        nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(program, log)
        sys.exit(log.value.decode())
    nvrtc.nvrtcGetCUBINSize(program, ctypes.byref(size))
    cubin = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetCUBIN(program, cubin)
    return cubin.raw


def longest_loop(sass: str) -> list[str]:
    """The instructions from a label to the furthest branch back to it (the hot loop)."""
    labels: dict[str, int] = {}
    code: list[str] = []
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(code)
        elif re.search(r"/\*[0-9a-f]{4,}\*/", line):
            code.append(line.strip())
    best: list[str] = []
    for i, line in enumerate(code):
        target = re.search(r"BRA\S*\s+`\((\.L_x_\d+)\)", line)
        if target and labels.get(target.group(1), i + 1) <= i and i + 1 - labels[target.group(1)] > len(best):
            best = code[labels[target.group(1)]:i + 1]
    return best


def opcode(line: str) -> str:
    return re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line).group(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("layout", choices=sorted(BODIES))
    parser.add_argument("constants", nargs="*", help="NAME=VALUE template constants")
    parser.add_argument("--show", action="store_true", help="print the loop's SASS")
    args = parser.parse_args()
    constants = {**DEFAULTS, **dict(c.split("=", 1) for c in args.constants)}
    root = cuda_root()
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "k.cubin"
        cubin.write_bytes(compile_cubin(kernel_source(args.layout, constants), root))
        usage = subprocess.run([root / "bin" / "cuobjdump", "-res-usage", cubin], capture_output=True, text=True).stdout
        sass = subprocess.run([root / "bin" / "nvdisasm", "-c", cubin], capture_output=True, text=True).stdout
    registers = re.search(r"REG:(\d+)", usage).group(1)
    stack = re.search(r"STACK:(\d+)", usage).group(1)
    loop = longest_loop(sass)
    mix = Counter(opcode(line) for line in loop)
    print(" ".join(f"{k}={v}" for k, v in constants.items()))
    print(f"registers {registers}, stack {stack} bytes; longest loop {len(loop)} instructions: "
          + ", ".join(f"{op} {n}" for op, n in mix.most_common(16)))
    if args.show:
        print("\n".join(loop))


if __name__ == "__main__":
    main()
