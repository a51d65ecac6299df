"""custom_kernels.compact: every engine kernel's source loses its comments and layout and
keeps its tokens, directives and PTX strings, so the CUDA compiler sees the same program in a
string MLX hashes faster (on CUDA the kernels' own tests run the compacted sources)."""

from __future__ import annotations

import re

import mlx.core as mx
import pytest

from mtplxd.engine.decoding import buffer_attention
from mtplxd.engine.model import custom_kernels, gdn_kernel, qk_norm_rope, small_m_qmm

# A C++ tokenizer of its own, not compact's: literals, comments, names, numbers, punctuation.
_TOKEN = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|//[^\n]*|/\*.*?\*/|[A-Za-z_]\w*'
                    r'|\d[\w.]*|\S', re.S)


def tokens(source: str) -> list[str]:
    return [t for t in _TOKEN.findall(source) if not t.startswith(("//", "/*"))]


def directives(source: str) -> list[str]:
    """Each preprocessor line, comments cut and blanks squeezed."""
    found = []
    for line in source.splitlines():
        line = re.sub(r"//.*", "", line).strip()
        if line.startswith("#"):
            found.append(re.sub(r"\s+", " ", line))
    return found


def engine_kernel_sources() -> dict[str, str]:
    """Every kernel source and header string the engine's modules hold."""
    found = {}
    for module in (small_m_qmm, buffer_attention, qk_norm_rope, gdn_kernel):
        for name, value in vars(module).items():
            if name.startswith(("_SOURCE", "_HEADER", "_MERGE", "_ROWS", "_SPLIT", "_TWO_PASS", "_STORE", "_MMA")) \
                    and isinstance(value, str):
                found[f"{module.__name__}.{name}"] = value
    found["custom_kernels.TENSOR_CORE_HEADER"] = custom_kernels.TENSOR_CORE_HEADER
    return found


def test_the_engine_has_kernel_sources_to_compact():
    sources = engine_kernel_sources()
    assert len(sources) >= 12 and "mtplxd.engine.model.small_m_qmm._SOURCE_VECTOR" in sources


@pytest.mark.parametrize("name", sorted(engine_kernel_sources()))
def test_compact_keeps_every_token_and_directive(name):
    source = engine_kernel_sources()[name]
    compacted = custom_kernels.compact(source)
    assert tokens(compacted) == tokens(source)
    assert directives(compacted) == directives(source)
    assert "//" not in re.sub(r'"[^"\n]*"', "", compacted)  # no comment left outside a PTX string
    assert len(compacted) <= len(source) + 1  # a final newline at most


def test_the_vector_layouts_source_shrinks_by_about_half():
    full = small_m_qmm._HEADER + small_m_qmm._SOURCE_VECTOR
    compacted = custom_kernels.compact(small_m_qmm._HEADER) + custom_kernels.compact(small_m_qmm._SOURCE_VECTOR)
    assert len(compacted) < 0.65 * len(full)


def test_compact_keeps_literals_and_separates_what_a_comment_separated():
    source = ('  // it\'s a comment\n  asm volatile("mov.u32 %0, 1; // kept" : "=r"(a));\n'
              "#pragma unroll\n    x = a/* gone */b;   y  =  2; // don't\n\n")
    assert custom_kernels.compact(source) == ('asm volatile("mov.u32 %0, 1; // kept" : "=r"(a));\n'
                                              "#pragma unroll\nx = a b; y = 2;\n")


def test_cuda_kernel_hands_mlx_the_compacted_source_and_header(monkeypatch):
    seen = {}
    # mx.fast.cuda_kernel builds only on CUDA; here the call MLX receives is what is checked.
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kwargs: seen.update(kwargs) or "kernel")
    made = custom_kernels.cuda_kernel(name="k", input_names=["x"], output_names=["out"],
                                      source="  out[0] = x[0];  // copy\n", header="// none\n#include <x>\n")
    assert made == "kernel"
    assert seen == {"name": "k", "input_names": ["x"], "output_names": ["out"],
                    "source": "out[0] = x[0];\n", "header": "#include <x>\n"}
