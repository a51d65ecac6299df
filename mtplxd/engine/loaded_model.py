"""A loaded model and how to serve it: `load_model` and `LoadedModel`."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

from mtplxd import matmul_precision
from mtplxd.engine.decoding import buffer_attention, fused_ar
from mtplxd.engine.decoding.cohort_rows import CohortCall
from mtplxd.engine.decoding.fused import fused_supported
from mtplxd.engine.generation import Step
from mtplxd.engine.generation import generate as run_generation
from mtplxd.engine.generation import generate_steps as run_generation_steps
from mtplxd.engine.generation import score as run_score
from mtplxd.engine.interface import (
    COMPUTE_CHOICES, DECODE_LOOP_CHOICES, DEQUANTIZE_CHOICES, QUANTIZE_CHOICES, GenerationRequest,
    GenerationResult, ModelInfo, ModelLoadError, TokenDelta,
)
from mtplxd.engine.model import cpu_attention as cpu_attention_path
from mtplxd.engine.model import gdn_kernel, mrope, qk_norm_rope, small_m_qmm, stacked
from mtplxd.engine.model.families import get_family
from mtplxd.engine.model.hybrid import HYBRID_MODEL_TYPES
from mtplxd.engine.model.kv_cache import KV_BITS_CHOICES, fixed_shapes_wanted, kv_group_size
from mtplxd.engine.model.loader import (
    MAX_DEPTH, compute_dtype, default_depth, dense_float32_bytes, dequantize, dequantize_wanted,
    inspect_checkpoint, load_checkpoint, model_dtype, parameter_bytes, quantize_on_load, upcast,
)
from mtplxd.engine.model.trunk import Trunk
from mtplxd.engine.session.bank import BankSettings, SessionBank, identity_for
from mtplxd.engine.model.vision import VisionTower, load_vision_tower

log = logging.getLogger(__name__)

DEQUANTIZED_LABEL = ", dequantized to float32 at load"  # ends info.quantization (load_model)
DEQUANTIZED_PATH = "none: the weights were dequantized to float32 at load (dense BLAS matmuls)"


class LoadedModel:
    """A model on the owner thread: weights, tokenizer, MTP head (when served MTP) and info."""

    def __init__(self, model, tokenizer, info: ModelInfo, trunk: Trunk) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.info = info
        self.trunk = trunk
        self.head = getattr(model, "mtp", None) if info.mode == "mtp" else None
        self.bank: SessionBank | None = None  # prefix reuse across requests (enable_session_bank)
        self.vision: VisionTower | None = None  # images in the prompt (a vision checkpoint)
        self.group: Any = None  # engine/distributed GroupInfo when served over several ranks

    @property
    def session_bank(self) -> SessionBank | None:
        """The model's session bank (None when prefix reuse is off)."""
        return self.bank

    def enable_session_bank(self, settings: BankSettings | None = None) -> SessionBank:
        """Give this model a session bank (owner thread); replaces any previous one."""
        if self.bank is not None:
            self.bank.close()
        self.bank = SessionBank(identity_for(self.info, self.tokenizer, self.model), settings)
        return self.bank

    def serve_depth(self, depth: int) -> None:
        """Serve `depth` by default from now on (a setting or a tuned depth): the backend's own
        default, and the reason it gave for it (`info.depth_reason`), no longer apply."""
        self.info.depth, self.info.depth_reason = depth, None

    def resolve_depth(self, requested: int | None) -> int:
        """The depth a request runs at: its own, else the model's; always 0 when served AR."""
        depth = self.info.depth if requested is None else requested
        if depth < 0 or depth > MAX_DEPTH:
            raise ValueError(f"mtp depth must be between 0 and {MAX_DEPTH}, got {depth}")
        return depth if self.head is not None else 0

    def generate(self, request: GenerationRequest,
                 should_stop: Callable[[], bool] = lambda: False
                 ) -> Iterator[TokenDelta | GenerationResult]:
        """Yield TokenDeltas as tokens commit, then one GenerationResult (owner thread only).

        should_stop() is checked between decode cycles; True ends the request with
        finish_reason "cancelled".
        """
        depth = self.resolve_depth(request.depth)
        return run_generation(self.trunk, self.head, self.tokenizer, request, depth,
                              self.info.vocab_size, should_stop, self.bank, self.vision)

    def generate_steps(self, request: GenerationRequest,
                       should_stop: Callable[[], bool] = lambda: False, *,
                       cohort: bool | str | Callable[[], bool | str] = False
                       ) -> Iterator[TokenDelta | GenerationResult | Step | CohortCall]:
        """`generate` one unit of work per item (a prefill chunk or a decode cycle; STEP when
        it has nothing to stream): what the scheduler steps (owner thread only). With
        `cohort`, decode cycles yield cohort calls for the scheduler's cohorts (cohort.py);
        a callable is asked at the prefill's and the decoding's start
        (generation.generate_steps)."""
        depth = self.resolve_depth(request.depth)
        return run_generation_steps(self.trunk, self.head, self.tokenizer, request, depth,
                                    self.info.vocab_size, should_stop, self.bank, self.vision,
                                    cohort=cohort)

    def complete(self, request: GenerationRequest,
                 should_stop: Callable[[], bool] = lambda: False) -> GenerationResult:
        """Run a request to its end and return its GenerationResult (generate's last item);
        for callers that do not stream (benchmarks, tests)."""
        result = None
        for item in self.generate(request, should_stop):
            result = item
        assert isinstance(result, GenerationResult)
        return result

    def score(self, prompt_ids: list[int]) -> list[float | None]:
        """Log-probability of each prompt token given its prefix; the first is None."""
        return run_score(self.trunk, list(prompt_ids))


def load_model(path: str | os.PathLike, *, model_id: str | None = None,
               depth: int | None = None,
               session_bank: BankSettings | None = None,
               draft_head_bits: int | None = None,
               decode_loop: str = "auto",
               quantize: str = "auto",
               shard: Callable[[Any], None] | None = None,
               kv_bits: int | str = 0,
               text_only: str | None = None,
               cpu_attention: str | None = None,
               small_m_kernel: bool | None = None,
               compute: str = "auto",
               dequantize_weights: str = "auto",
               memory_limit_bytes: int | None = None) -> LoadedModel:
    """Load an HF-format folder for serving (owner thread only).

    Registered families with MTP tensors are served MTP at `depth` (default: the checkpoint's
    recommended depth, see loader.recommended_depth, else 3; 0 for quantized weights on the
    CPU backend, with `info.depth_reason` saying why: loader.default_depth); anything else
    mlx-lm loads is served AR with `info.ar_reason` saying why. Raises ModelLoadError for
    refused checkpoints (auto_map, unsupported quantization, missing files). With
    `session_bank` settings the model gets a session bank (prefix reuse; off by default).
    `draft_head_bits` (4 or 8) gives MTP drafting a quantized copy of an unquantized lm_head:
    cheaper draft steps, same output (only acceptance can change). `decode_loop` is "fused"
    (each cycle one compiled device graph: fused.py), "stepwise", or "auto"
    (trunk.default_decode_loop: fused on CUDA and CPU, stepwise on Metal).
    `quantize` quantizes an unquantized checkpoint as it loads: "8bit" or "4bit", "none", or
    "auto" (what the checkpoint's config asks for on CUDA; see loader.CUDA_QUANTIZATION_KEY).
    `shard(model)` runs before any weight is read and may drop layers (a pipeline rank:
    engine/distributed): only what it leaves is loaded.
    `kv_bits` 8 or 4 quantizes the attention KV cache (mlx-lm's QuantizedKVCache), 0 keeps it
    full precision, "auto" takes the checkpoint's config.json `mtplx_kv_bits` (else 0).
    `text_only` is a reason to serve a vision checkpoint text only: its vision tower is not
    loaded, and `info.vision_reason` says why (a distributed group's ranks).
    `cpu_attention` "auto"/"numpy" computes long prefill chunks' attention on the CPU backend
    in numpy, "mlx" keeps MLX's (cpu_attention.py; a process-wide setting); None keeps the
    current one (`MTPLX_CPU_ATTENTION`, else auto).
    `small_m_kernel` True or False routes quantized layers through small_m_qmm's CUDA kernel
    or not; None keeps its default (`small_m_qmm.default_wanted`: 27B/32B-class 4- and 8-bit
    models, dense 4-bit ones of Qwen3-4B's size for their decode steps; a hybrid's and a dense
    8-bit one's every 1..7-row product on its tensor-core layout, row-invariant:
    `small_m_qmm.row_invariant_wanted`; a dense 4-bit one's so inside its MTP cycles only:
    `small_m_qmm.cycle_row_invariant_wanted`).
    `info.kernels` says which runs.
    `compute` "auto" upcasts where loader.compute_dtype says (float32 on the Linux CPU,
    quantized checkpoints' scales and norms included); "checkpoint" keeps the checkpoint's
    dtype (bench.cpu_dtype's other arm). `info.dtype` says which.
    `dequantize_weights` (where the model computes in float32: the Linux CPU) "auto" serves a
    quantized model's linear and embedding layers as dense float32 while those weights take
    at most loader.DEQUANTIZE_MEMORY_SHARE of `memory_limit_bytes` (None: this machine's
    memory) and the checkpoint shipped quantized (not `quantize`d as it loads), "on" while
    they fit in the memory limit at all, "off" never; `info.quantization` then ends
    ", dequantized to float32 at load" and the model's default depth is no longer 0.
    """
    path = Path(path).expanduser().resolve()
    if not path.is_dir():
        raise ModelLoadError(f"{path} is not a folder; pass a Hugging Face-format model folder")
    report = inspect_checkpoint(path)
    if report.mode == "refused":
        raise ModelLoadError(f"{path.name}: {report.reason}")
    if depth is not None and not 0 <= depth <= MAX_DEPTH:
        raise ModelLoadError(f"mtp depth must be between 0 and {MAX_DEPTH}, got {depth}")
    if quantize not in QUANTIZE_CHOICES:
        raise ModelLoadError(f"quantize must be one of {', '.join(QUANTIZE_CHOICES)}, got {quantize!r}")
    if compute not in COMPUTE_CHOICES:
        raise ModelLoadError(f"compute must be one of {', '.join(COMPUTE_CHOICES)}, got {compute!r}")
    if dequantize_weights not in DEQUANTIZE_CHOICES:
        raise ModelLoadError(f"dequantize_weights must be one of {', '.join(DEQUANTIZE_CHOICES)}, "
                             f"got {dequantize_weights!r}")
    if decode_loop not in DECODE_LOOP_CHOICES:
        raise ModelLoadError(f"decode_loop must be one of {', '.join(DECODE_LOOP_CHOICES)}, "
                             f"got {decode_loop!r}")
    if cpu_attention is not None:
        try:
            cpu_attention_path.set_mode(cpu_attention)
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from None
    cpu_attention_path.route_model_attention()
    with_mtp = report.mode == "mtp"
    model, config, tokenizer = load_checkpoint(path, with_mtp=with_mtp, lazy=shard is not None)
    if shard is not None:
        shard(model)
    loaded_bytes = parameter_bytes(model)
    on_cuda, on_cpu = fixed_shapes_wanted(), _on_cpu()
    quantized_at_load = quantize_on_load(model, config, quantize, on_cuda=on_cuda)
    dtype = compute_dtype(sys.platform, on_cpu=on_cpu) if compute == "auto" else None
    if dtype is not None:
        upcast(model, dtype)
    quantization = quantized_at_load or report.quantization
    dequantized = bool(quantization) and dtype == "float32" and _dequantize_if_wanted(
        model, dequantize_weights, memory_limit_bytes or _memory_bytes(), bool(quantized_at_load))
    if dequantized:
        quantization += DEQUANTIZED_LABEL
    # What quantizing, upcasting or dequantizing at load changed the resident weights by.
    grown = parameter_bytes(model) - loaded_bytes
    # Projections that read one input as one product (opt-in: stacked.py says why); not on a
    # rank's shard.
    stacked_groups = stacked.stack(model) if stacked.wanted() and shard is None else 0
    # The model's quantized layers, MTP head included.
    switched = small_m_qmm.install(model, force=small_m_kernel)
    # A dense qwen3's query and key norms and rope as one kernel a layer (opt-in:
    # qk_norm_rope.py says why); not on a rank's shard.
    norm_rope_layers = qk_norm_rope.install(model) if shard is None else 0
    spec = get_family(report.model_type)
    trunk = Trunk(model, spec)
    if decode_loop != "auto":
        trunk.decode_loop = decode_loop
    if with_mtp and draft_head_bits is not None:
        trunk.quantize_draft_head(bits=draft_head_bits)
    text_config = config.get("text_config") or {}
    _set_kv_bits(trunk, config, kv_bits)
    served_depth, depth_reason = default_depth(
        config, on_cuda, quantized_on_cpu=on_cpu and bool(quantization) and not dequantized)
    info = ModelInfo(
        id=model_id or path.name,
        path=str(path),
        family=report.model_type,
        mode=report.mode,
        ar_reason=report.reason if report.mode == "ar" else None,
        depth=(served_depth if depth is None else depth) if with_mtp else 0,
        depth_reason=depth_reason if with_mtp and depth is None else None,
        context_length=int(report.context_length or 0),
        quantization=quantization,
        vocab_size=int(config.get("vocab_size") or text_config.get("vocab_size")),
        weights_bytes=report.weights_bytes + grown,  # what is resident as served
        dtype=model_dtype(model),
        kernels=kernel_paths(switched, hybrid=report.model_type in HYBRID_MODEL_TYPES,
                             kernel_decode=small_m_qmm.decode_wanted(model),
                             row_invariant=small_m_qmm.routed_row_invariant(model),
                             cycle_row_invariant=small_m_qmm.routed_row_invariant(model, in_cycles=True),
                             ar_decode=fused_ar.path_name(trunk), dequantized=dequantized,
                             stacked_groups=stacked_groups, norm_rope_layers=norm_rope_layers),
        decode_loop=("fused" if with_mtp and trunk.decode_loop == "fused"
                     and fused_supported(trunk, trunk.make_cache(), hybrid=True) else "stepwise"),
        vision=report.vision and text_only is None,
        vision_reason=text_only if report.vision and text_only else report.vision_reason,
        kv_bits=trunk.kv_bits,
    )
    loaded = LoadedModel(model, tokenizer, info, trunk)
    if info.vision:
        try:
            loaded.vision = load_vision_tower(path, config)
        except ModelLoadError as exc:  # the text is still served; images are refused, saying why
            log.warning("serving %s text only: %s", path.name, exc)
            info.vision, info.vision_reason = False, f"the vision tower did not load: {exc}"
        else:
            if dtype is not None:
                loaded.vision.model.set_dtype(getattr(_mx(), dtype))
            # Image rows need the family's multimodal rotary positions in every attention
            # layer; text-only checkpoints never get here and keep mlx-lm's layers as they are.
            mrope.install(mrope.attention_layers(trunk.text, loaded.head), loaded.vision.positions)
    if session_bank is not None:
        loaded.enable_session_bank(session_bank)
    return loaded


def _mx():
    import mlx.core as mx

    return mx


def kernel_paths(quantized_layers_switched: int, *, hybrid: bool, kernel_decode: bool = True,
                 row_invariant: bool = False, cycle_row_invariant: bool = False,
                 ar_decode: str = "op by op", dequantized: bool = False,
                 stacked_groups: int = 0, norm_rope_layers: int = 0) -> dict[str, str]:
    """Which implementation each fast path runs on this machine (`ModelInfo.kernels`):
    quantized matmuls (`kernel_decode`: whether decode steps take the small-M kernel, the rule
    `small_m_qmm.install` applied; `row_invariant`: whether it routed every row count to the
    tensor cores, `cycle_row_invariant` inside MTP cycles), attention over the fused loop's cache buffer, for hybrid
    models the Gated DeltaNet verify and decode step, an AR request's decode step
    (`ar_decode`: fused_ar.path_name) and the precision of float32 matmuls. Off CUDA every
    kernel entry names MLX's own ops (or mlx-lm's). A model `dequantized` at load has no
    quantized matmul left. `stacked_groups`: how many groups of projections that read one
    input run as one product (stacked.py); `norm_rope_layers`: how many attention layers run
    their query and key norms and rope as one kernel (qk_norm_rope.py)."""
    paths = {
        "quantized_matmul": (DEQUANTIZED_PATH if dequantized else
                             small_m_qmm.path_name(quantized_layers_switched, decode=kernel_decode,
                                                   row_invariant=row_invariant,
                                                   cycle_row_invariant=cycle_row_invariant)),
        "cache_attention": buffer_attention.path_name(),
        "prefill_attention": cpu_attention_path.path_name(),
    }
    if hybrid:
        paths["gdn_verify"] = gdn_kernel.verify_path_name()
        paths["gdn_decode"] = gdn_kernel.path_name()
    paths["ar_decode"] = ar_decode
    paths["shared_input_projections"] = (
        f"stacked: one product a group ({stacked_groups} groups, {stacked.ENV}=1)" if stacked_groups
        else "one product each")
    paths["qk_norm_rope"] = qk_norm_rope.path_name(norm_rope_layers)
    mx = _mx()
    paths["float32_matmul"] = matmul_precision.path_name(on_gpu=mx.default_device() == mx.gpu)
    return paths


def _set_kv_bits(trunk: Trunk, config: dict, kv_bits: int | str) -> None:
    """Quantize the trunk's attention KV at `kv_bits` (see load_model), or refuse in words."""
    if kv_bits == "auto":
        kv_bits = int(config.get("mtplx_kv_bits") or 0)
    if kv_bits not in KV_BITS_CHOICES:
        raise ModelLoadError(f"kv_bits must be one of {', '.join(map(str, KV_BITS_CHOICES))} or auto, "
                             f"got {kv_bits!r}")
    if not kv_bits:
        return
    text = config.get("text_config") or config
    head_dim = int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])
    group = kv_group_size(head_dim)
    if not group:
        raise ModelLoadError(f"kv_bits {kv_bits} needs a head dimension divisible by 32; this model's "
                             f"is {head_dim}: set kv_bits to 0")
    trunk.kv_bits, trunk.kv_group_size = int(kv_bits), group


def _dequantize_if_wanted(model, choice: str, memory_bytes: int, quantized_at_load: bool) -> bool:
    """Dequantize `model`'s weights to dense float32 where loader.dequantize_wanted says so;
    True when it did. A dequantization asked for ("on") that cannot be done is logged."""
    dense_bytes = dense_float32_bytes(model)
    if dequantize_wanted(choice, dense_bytes, memory_bytes, quantized_at_load):
        dequantize(model)
        return True
    if choice == "on":
        why = ("a quantized layer has no dense float32 twin (mixture-of-experts layers)"
               if dense_bytes is None else
               f"its dense weights ({dense_bytes / 2**30:.1f} GiB) exceed the memory limit "
               f"({memory_bytes / 2**30:.1f} GiB)")
        log.warning("dequantize = on: the weights stay packed: %s", why)
    return False


def _memory_bytes() -> int:
    import psutil

    return psutil.virtual_memory().total


def _on_cpu() -> bool:
    import mlx.core as mx

    return mx.default_device() == mx.cpu



