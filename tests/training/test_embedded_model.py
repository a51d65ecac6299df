"""The shipped embedded model: layout, size, tokenizer, and a chat request answered with Python."""

import ast
import json
import re
import struct

import pytest

from mtplxd.engine import GenerationRequest, SamplingParams, load_model

from .conftest import EMBEDDED_DIR

FIB_REQUEST = "Write a Python function that returns the n-th Fibonacci number"


def safetensors_names(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k for k in header if k != "__metadata__"}


def test_shipped_files_fit_the_40_mb_budget_and_the_dense_qwen3_mtp_layout():
    files = {p.name for p in EMBEDDED_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    assert sum(p.stat().st_size for p in EMBEDDED_DIR.iterdir() if p.is_file()) <= 40_000_000
    cfg = json.loads((EMBEDDED_DIR / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["mtp_num_hidden_layers"] == 1
    names = safetensors_names(EMBEDDED_DIR / "model.safetensors")
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
            "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight",
            "model.embed_tokens.weight", "model.norm.weight"} <= names
    assert sum(n.startswith(f"model.layers.{cfg['num_hidden_layers'] - 1}.") for n in names) > 0


def test_tokenizer_loads_through_mlx_lm_round_trips_and_renders_the_chat_template():
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tok = load_tokenizer(EMBEDDED_DIR)
    text = 'def f(x):\n    return {"ü": x}  # ✓\n'
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                    "<tool_call>", "</tool_call>"):
        assert len(tok.encode(special, add_special_tokens=False)) == 1, special
    assert tok.eos_token == "<|im_end|>"
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    no_think = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False,
                                       enable_thinking=False)
    # One newline after </think>: a final "\n\n" would be a merged token never seen before code.
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n")
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {}}}]
    with_tools = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)
    assert "<tools>" in with_tools and '"read_file"' in with_tools


def python_block(text: str) -> str:
    """The first ```python fenced block of an answer, else the whole answer."""
    m = re.search(r"```(?:python)?\n(.*?)```", text, re.S)
    return m.group(1) if m else text


@pytest.mark.parametrize("enable_thinking", [None, False])
def test_chat_request_for_fibonacci_gets_python_that_parses_and_ends_with_im_end(enable_thinking):
    model = load_model(EMBEDDED_DIR, model_id="mtplx-tiny-coder")
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": FIB_REQUEST}],
                                                 add_generation_prompt=True, **kwargs)
    request = GenerationRequest(prompt_ids=list(prompt), sampling=SamplingParams(temperature=0.0, max_tokens=300))
    result = model.complete(request)
    # The only EOS is <|im_end|>, and with no stop strings or stop ids requested, finish_reason
    # "stop" means the model emitted it (the engine leaves EOS out of token_ids and text).
    assert model.tokenizer.eos_token_ids == {model.tokenizer.convert_tokens_to_ids("<|im_end|>")}
    assert result.finish_reason == "stop" and len(result.token_ids) < 300
    if enable_thinking is False:
        assert "</think>" not in result.text  # the prompt's think block is not repeated
    code = python_block(result.text)
    tree = ast.parse(code)
    assert any(isinstance(node, ast.FunctionDef) for node in tree.body), code
