"""Build ChatML instruction pairs from the corpus: a request for a function, the function back.

For each top-level function with a docstring (and a handful of hand-written tasks in
training/tasks.py), the user turn asks for the function by its signature and/or the first line
of its docstring, and the assistant turn is the function's source in a ```python block, closed
by `<|im_end|>`. The rendering matches the chat template shipped with the tokenizer
(training/chat_template.jinja): optional system turn, and the empty `<think>\n\n</think>\n\n`
block of `enable_thinking=False` (the template ends such a prompt after `</think>\n`: the
tokenizer would merge a final `\n\n` into one token that never precedes code here).

    python -m training.pairs --corpus train-out/corpus --out train-out/pairs
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import textwrap
from pathlib import Path

from training.tasks import TASKS

SYSTEM_PROMPTS = [
    "You are a helpful coding assistant.",
    "You are mtplx-tiny-coder, a small model that writes Python.",
    "You are a Python expert. Answer with code.",
]
# Imperative docstring verbs turned third-person so "a function that <doc>" reads right.
VERBS = {"return": "returns", "compute": "computes", "convert": "converts", "get": "gets",
         "check": "checks", "create": "creates", "build": "builds", "make": "makes",
         "find": "finds", "parse": "parses", "read": "reads", "write": "writes",
         "remove": "removes", "add": "adds", "set": "sets", "test": "tests", "load": "loads",
         "format": "formats", "generate": "generates", "split": "splits", "join": "joins",
         "encode": "encodes", "decode": "decodes", "print": "prints", "determine": "determines",
         "calculate": "calculates", "update": "updates", "apply": "applies", "yield": "yields",
         "raise": "raises", "extract": "extracts", "normalize": "normalizes", "escape": "escapes",
         "strip": "strips", "replace": "replaces", "wrap": "wraps", "register": "registers",
         "validate": "validates", "copy": "copies", "count": "counts", "search": "searches",
         "open": "opens", "close": "closes", "run": "runs", "call": "calls", "emit": "emits"}
MIN_SOURCE, MAX_SOURCE = 80, 1800


def describe(doc_line: str) -> str | None:
    """Turn a docstring's first line into a clause that follows "a function that"."""
    line = doc_line.strip().rstrip(".").strip()
    if len(line) < 12 or len(line) > 160 or line.endswith(":"):
        return None
    first, _, rest = line.partition(" ")
    low = first.lower()
    if low in VERBS:
        first = VERBS[low]
    elif low.endswith("s") and low[:-1] in VERBS:
        first = low
    else:
        return None
    return f"{first} {rest}".strip()


def signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """`name(args)` as written, without annotations' noise beyond what ast.unparse gives."""
    return f"{node.name}({ast.unparse(node.args)})"


def function_pairs(text: str, rng: random.Random) -> list[tuple[str, str]]:
    """(user, code) pairs for the documented top-level functions of one source file."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines()
    out = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
        code = textwrap.dedent("\n".join(lines[start:node.end_lineno])).rstrip()
        if not (MIN_SOURCE <= len(code) <= MAX_SOURCE):
            continue
        clause = describe(doc.splitlines()[0]) if doc else None
        sig = signature(node)
        kind = "async " if isinstance(node, ast.AsyncFunctionDef) else ""
        if clause:
            user = rng.choice([
                f"Write a Python {kind}function `{sig}` that {clause}.",
                f"Write a Python {kind}function that {clause}.",
                f"Implement `{sig}` in Python: it {clause}.",
                f"Write a Python {kind}function named `{node.name}` that {clause}.",
            ])
        elif rng.random() < 0.3:
            user = f"Write the Python {kind}function `{sig}`."
        else:
            continue
        out.append((user, code))
    return out


def render(user: str, code: str, rng: random.Random) -> str:
    """ChatML text of one exchange, as the shipped chat template renders it, answer included."""
    parts = []
    if rng.random() < 0.3:
        parts.append(f"<|im_start|>system\n{rng.choice(SYSTEM_PROMPTS)}<|im_end|>\n")
    parts.append(f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")
    if rng.random() < 0.5:
        parts.append("<think>\n\n</think>\n\n")
    parts.append(f"```python\n{code}\n```<|im_end|>\n")
    return "".join(parts)


def task_pairs(copies: int, rng: random.Random) -> list[tuple[str, str]]:
    """The hand-written tasks, each phrasing repeated `copies` times (renders differ by rng)."""
    return [(prompt, task.code.strip()) for task in TASKS for prompt in task.prompts
            for _ in range(copies)]


def build(corpus_dir: Path, out_dir: Path, seed: int = 0, task_copies: int = 6) -> dict:
    """Write pairs_train.jsonl / pairs_heldout.jsonl ({"text"} per line); return counts."""
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split in ("train", "heldout"):
        rng = random.Random(f"{seed}-{split}")
        pairs = []
        with open(corpus_dir / f"{split}.jsonl") as f:
            for line in f:
                pairs += function_pairs(json.loads(line)["text"], rng)
        if split == "train":
            pairs += task_pairs(task_copies, rng)
        rng.shuffle(pairs)
        with open(out_dir / f"pairs_{split}.jsonl", "w") as f:
            for user, code in pairs:
                f.write(json.dumps({"text": render(user, code, rng)}) + "\n")
        counts[split] = len(pairs)
    return counts


def main() -> None:
    """CLI entry: build pairs from --corpus into --out."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, default=Path("train-out/corpus"))
    ap.add_argument("--out", type=Path, default=Path("train-out/pairs"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(json.dumps(build(args.corpus, args.out, args.seed)))


if __name__ == "__main__":
    main()
