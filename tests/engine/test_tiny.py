"""The tiny checkpoint factory writes real, loadable HF-format folders."""

import json

from mlx_lm.utils import load_config, load_tokenizer

from mtplxd.engine import inspect_checkpoint
from mtplxd.engine.fixtures.tokenizer import MARKUP_TOKENS, SPECIAL_TOKENS


def test_tiny_checkpoint_tokenizer_loads_through_mlx_lm_with_bpe_detokenizer(tiny_model_factory):
    path = tiny_model_factory("qwen3")
    tokenizer = load_tokenizer(path, eos_token_ids=load_config(path).get("eos_token_id"))
    assert type(tokenizer._detokenizer).__name__ == "BPEStreamingDetokenizer"
    vocab = tokenizer.get_vocab()
    for token in SPECIAL_TOKENS + MARKUP_TOKENS:
        assert token in vocab
    assert vocab["<|im_end|>"] in tokenizer.eos_token_ids
    text = "def f(x):\n    return 'café 😀 日本'"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert 300 <= len(vocab) <= 600


def test_tiny_chat_template_renders_tools_tool_calls_and_disabled_thinking(tiny_model_factory):
    path = tiny_model_factory("qwen3")
    tokenizer = load_tokenizer(path)
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "open it"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"function": {"name": "read_file", "arguments": {"path": "a.py"}}}]},
        {"role": "tool", "content": "print(1)"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=True, enable_thinking=False)
    assert text.startswith("<|im_start|>system\nbe brief\n\n# Tools")
    assert '"name": "read_file"' in text
    assert '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\nprint(1)\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    thinking = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True,
                                             enable_thinking=True)
    assert thinking.endswith("<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template(messages[:2], add_generation_prompt=True)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_tiny_checkpoint_is_deterministic_per_seed(tmp_path):
    from mtplxd.engine.fixtures.tiny import write_tiny_checkpoint

    a = write_tiny_checkpoint(tmp_path / "a", seed=3)
    b = write_tiny_checkpoint(tmp_path / "b", seed=3)
    c = write_tiny_checkpoint(tmp_path / "c", seed=4)
    weights = lambda p: (p / "model.safetensors").read_bytes()
    assert weights(a) == weights(b)
    assert weights(a) != weights(c)
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()


def test_inspect_reports_mtp_ar_and_quantization(tiny_model_factory):
    mtp = inspect_checkpoint(tiny_model_factory("qwen3"))
    assert (mtp.mode, mtp.family, mtp.has_mtp_tensors, mtp.reason) == ("mtp", "qwen3", True, None)
    assert mtp.context_length == 4096 and mtp.weights_bytes > 0
    bare = inspect_checkpoint(tiny_model_factory("qwen3", with_mtp=False))
    assert bare.mode == "ar" and "no mtp.* tensors" in bare.reason
    llama = inspect_checkpoint(tiny_model_factory("llama"))
    assert llama.mode == "ar" and llama.family is None and "llama" in llama.reason
    q4 = inspect_checkpoint(tiny_model_factory("qwen3", quantize_bits=4))
    assert q4.mode == "mtp" and q4.quantization == "4bit"
    q3 = inspect_checkpoint(tiny_model_factory("qwen3", quantize_bits=3))
    assert q3.mode == "refused" and "3-bit" in q3.reason


def test_inspect_refuses_auto_map(tiny_model_factory, tmp_path):
    import shutil

    path = shutil.copytree(tiny_model_factory("qwen3"), tmp_path / "remote")
    config = json.loads((path / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (path / "config.json").write_text(json.dumps(config))
    report = inspect_checkpoint(path)
    assert report.mode == "refused" and "auto_map" in report.reason
