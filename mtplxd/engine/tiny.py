"""Tiny random-weight checkpoints with a real tokenizer, written in seconds.

Used by every test and benchmark that needs a model on disk. A checkpoint is an HF-format
folder: config.json, model.safetensors (trunk, plus `mtp.*` tensors for MTP families),
tokenizer.json (a byte-level BPE trained here with the `tokenizers` library),
tokenizer_config.json (ChatML specials and a Qwen-style chat template with tools and
`enable_thinking`) and generation_config.json.

Dense families are written here; the hybrid Gated-DeltaNet families (`qwen3_5`,
`qwen3_5_moe`, `qwen3_next`) are written by `mtplxd.engine.hybrid.write_tiny_hybrid_checkpoint`.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
DENSE_FAMILIES = ("qwen3", "llama")

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Plain added tokens (not "special"): they survive skip_special_tokens, as in Qwen's tokenizer.
MARKUP_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>",
                 "<tool_response>", "</tool_response>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
TRAINED_VOCAB_SIZE = 400

CHAT_TEMPLATE = r"""{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
{%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' }}
{%- if message.reasoning_content %}{{- '<think>\n' + message.reasoning_content + '\n</think>\n\n' }}{%- endif %}
{%- if message.content %}{{- message.content }}{%- endif %}
{%- if message.tool_calls %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
{%- if loop.first and message.content %}{{- '\n' }}{%- elif not loop.first %}{{- '\n' }}{%- endif %}
{{- '<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{{- '}\n</tool_call>' }}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}"""

_WORDS = (
    "the model reads a file and writes code for the user while tests run fast on small "
    "machines def return import class self value list dict print if else for while in not "
    "and or None True False async await yield lambda with open path json token cache layer "
    "head draft verify accept commit sample greedy temperature function arguments name "
    "error result data index count offset string number array matrix vector hello world"
).split()
_EXTRA_TEXT = (
    "café naïve résumé über straße façade — “quotes” ‘single’ … ±×÷ °C €£¥ "
    "日本語のテキスト 中文文本 한국어 текст на русском ελληνικά עברית العربية "
    "emoji 😀 🚀 ✨ 👍🏽 🧪 ∑∫√∞≠≤≥ λ→⇒"
)
_CODE = (
    "def add(a, b):\n    return a + b\n\n",
    "class Cache:\n    def __init__(self):\n        self.offset = 0\n\n",
    "for i in range(10):\n    print(i * 2)\n",
    '{"name": "read_file", "arguments": {"path": "src/main.py"}}\n',
    "if x is None:\n    raise ValueError(\"missing value\")\n",
    "import json\nwith open(path) as f:\n    data = json.load(f)\n",
)


def _training_corpus() -> list[str]:
    """A deterministic mix of prose, code, JSON and non-ASCII text."""
    lines = []
    n = len(_WORDS)
    for i in range(300):
        words = [_WORDS[(i * 7 + j * 13 + (i * j) % 5) % n] for j in range(6 + i % 9)]
        lines.append(" ".join(words) + (".\n" if i % 3 else "\n"))
    lines.extend(_CODE * 20)
    lines.extend([_EXTRA_TEXT] * 10)
    return lines


def build_tiny_tokenizer(vocab_size: int = TRAINED_VOCAB_SIZE):
    """Train a byte-level BPE (a `tokenizers.Tokenizer`) with ChatML and markup tokens added."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_corpus(), trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return tokenizer


def write_tiny_tokenizer(dest: Path) -> int:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `dest`.

    Returns the vocabulary size (the model's `vocab_size` must equal it). The files load
    through `mlx_lm.utils.load_tokenizer` (a BPE streaming detokenizer is picked) and
    transformers' AutoTokenizer; the chat template renders tools, tool calls, tool results
    and `enable_thinking=False` the way Qwen3's does.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer()
    tokenizer.save(str(dest / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 32768,
        "chat_template": CHAT_TEMPLATE,
    }
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (dest / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}, indent=2)
    )
    return tokenizer.get_vocab_size(with_added_tokens=True)


def _dense_config(family: str, vocab_size: int, with_mtp: bool) -> dict[str, Any]:
    config: dict[str, Any] = {
        "model_type": family,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        # Untied: a random tied head mostly predicts "repeat the current token".
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    if family == "qwen3":
        config["architectures"] = ["Qwen3ForCausalLM"]
        if with_mtp:
            config["mtp_num_hidden_layers"] = 1
    elif family == "llama":
        config["architectures"] = ["LlamaForCausalLM"]
        config["rope_theta"] = 10000.0
    return config


def _build_mlx_model(config: dict[str, Any]) -> nn.Module:
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    return model_class(args_class.from_dict(config))


def _sharpen(weights: dict[str, mx.array], logit_scale: float, embed_scale: float) -> None:
    """Scale lm_head (peakier next-token distributions) and embeddings (a stronger pull of
    the current token on the next one, which makes the model's continuations predictable
    enough for an MTP head to be right part of the time)."""
    head_key = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    weights[head_key] = weights[head_key] * logit_scale
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"] * embed_scale


def fit_mtp_head(text_model: nn.Module, head: nn.Module, *, seed: int = 0,
                 residual_scale: float = 0.1) -> None:
    """Fit the head's `fc` by least squares so its drafts agree with the trunk part of the time.

    On random token sequences, `fc(concat[norm_e(embed(x_{t+1})), norm_h(h_t)])` is fitted to
    the trunk's own h_{t+1}; the MTP layer's residual branches are scaled by
    `residual_scale` so the fitted map dominates. `text_model` has `.model` (returning
    post-norm hiddens, with `.embed_tokens`). Takes well under a second at tiny sizes, and
    gives tests and benchmarks a head with a realistic mix of accepted and rejected drafts.
    """
    import numpy as np

    vocab = text_model.model.embed_tokens.weight.shape[0]
    tokens = mx.random.randint(0, vocab, (32, 64), key=mx.random.key(seed + 7919))
    hidden = text_model.model(tokens)
    features = mx.concatenate([
        head.pre_fc_norm_embedding(text_model.model.embed_tokens(tokens[:, 1:])),
        head.pre_fc_norm_hidden(hidden[:, :-1]),
    ], axis=-1)
    x = np.array(features.reshape(-1, features.shape[-1]).astype(mx.float32), dtype=np.float64)
    y = np.array(hidden[:, 1:].reshape(-1, hidden.shape[-1]).astype(mx.float32), dtype=np.float64)
    # Normal equations (a small ridge keeps them well posed): far cheaper than lstsq's SVD.
    gram = x.T @ x + 1e-3 * np.eye(x.shape[1])
    solution = np.linalg.solve(gram, x.T @ y)
    head.fc.weight = mx.array(solution.T.astype(np.float32))
    layer = head.layers[0]
    layer.self_attn.o_proj.weight = layer.self_attn.o_proj.weight * residual_scale
    layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * residual_scale


def write_tiny_checkpoint(dest: Path, family: str = "qwen3", *, seed: int = 0,
                          with_mtp: bool = True, quantize_bits: int | None = None,
                          logit_scale: float = 4.0, embed_scale: float = 4.0,
                          fit_mtp: bool = True, **overrides: Any) -> Path:
    """Write a tiny random-weight HF-format checkpoint of `family` into `dest`; return `dest`.

    Families: "qwen3" (with an `mtp.*` head unless `with_mtp=False`), "llama" (no MTP: the
    AR-fallback path), and the hybrid families, delegated to `mtplxd.engine.hybrid`.
    `quantize_bits` writes MLX affine-quantized weights (group size 32) for trunk and head,
    with `"quantization"` in config.json as mlx-lm's converter does. `overrides` replace
    config.json keys (e.g. `hidden_size=128`). `logit_scale` and `embed_scale` shape the
    random model (see `_sharpen`; embed_scale=1 gives a plain random trunk whose drafts are
    accepted far less often). `fit_mtp` least-squares fits the head (`fit_mtp_head`);
    without it the head is random and nearly every draft is rejected. Same seed, same bytes.
    """
    dest = Path(dest)
    if family in HYBRID_FAMILIES:
        hybrid = importlib.import_module("mtplxd.engine.hybrid")
        return hybrid.write_tiny_hybrid_checkpoint(
            dest, family, seed=seed, with_mtp=with_mtp, quantize_bits=quantize_bits,
            logit_scale=logit_scale, **overrides,
        )
    if family not in DENSE_FAMILIES:
        raise ValueError(f"unknown tiny family {family!r}; choose one of "
                         f"{DENSE_FAMILIES + HYBRID_FAMILIES}")
    vocab_size = write_tiny_tokenizer(dest)
    config = _dense_config(family, vocab_size, with_mtp)
    config.update(overrides)

    mx.random.seed(seed)
    model = _build_mlx_model(config)
    if with_mtp and family == "qwen3":
        model.mtp = build_mtp_head_for(config)
    weights = dict(tree_flatten(model.parameters()))
    _sharpen(weights, logit_scale, embed_scale)
    model.load_weights(list(weights.items()))
    if with_mtp and family == "qwen3" and fit_mtp:
        fit_mtp_head(model, model.mtp, seed=seed)
    if quantize_bits is not None:
        group_size = 32
        nn.quantize(model, group_size=group_size, bits=quantize_bits)
        config["quantization"] = {"group_size": group_size, "bits": quantize_bits}
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    (dest / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [_token_id(dest, EOS_TOKEN), _token_id(dest, PAD_TOKEN)]}, indent=2))
    return dest


def build_mtp_head_for(config: dict[str, Any]) -> nn.Module:
    """A randomly initialised MTP head for a dense registered family's config."""
    from mlx_lm.utils import _get_classes

    from mtplxd.engine.families import get_family
    from mtplxd.engine.mtp_head import MTPHead

    spec = get_family(config["model_type"])
    if spec is None:
        raise ValueError(f"{config['model_type']} has no MTP family spec")
    _, args_class = _get_classes(config)
    args = spec.text_args(args_class.from_dict(config))
    return MTPHead(args.hidden_size, args.rms_norm_eps, spec.build_mtp_layer(args))


def _token_id(dest: Path, token: str) -> int:
    vocab = json.loads((dest / "tokenizer.json").read_text())
    for added in vocab["added_tokens"]:
        if added["content"] == token:
            return added["id"]
    raise KeyError(token)


def main(argv: list[str] | None = None) -> int:
    """`python -m mtplxd.engine.tiny DEST [--family F] [--quantize-bits B] [--set KEY=JSON]...`."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m mtplxd.engine.tiny",
                                     description="Write a tiny random-weight checkpoint.")
    parser.add_argument("dest", type=Path)
    parser.add_argument("--family", default="qwen3",
                        choices=DENSE_FAMILIES + HYBRID_FAMILIES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quantize-bits", type=int, default=None)
    parser.add_argument("--no-mtp", action="store_true", help="leave the mtp.* tensors out")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                        help="override a config.json key or a writer option, e.g. hidden_size=1024")
    args = parser.parse_args(argv)
    overrides: dict[str, Any] = {}
    for item in args.set:
        key, _, value = item.partition("=")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    path = write_tiny_checkpoint(args.dest, args.family, seed=args.seed, with_mtp=not args.no_mtp,
                                 quantize_bits=args.quantize_bits, **overrides)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
