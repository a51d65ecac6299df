"""Fine-tune the embedded model to do small file tasks through each coding agent's own tools.

Continues a checkpoint (mtplxd/models/embedded by default) on the examples of
training/agent_tasks.py: each agent's real request (8k-24k tokens of system prompt and tool
schemas) with a small task, and the assistant turn that calls the agent's file-writing tool,
or, after the tool's result, answers "Created NAME.". The loss covers the target tokens only
(trunk next-token CE plus the MTP chain's CE on the same span). Long prompts go through
long_context's chunked, checkpointed attention. Each agent example is followed by
`--short-per-long` batches of the from-scratch recipe's short code/chat windows (full loss) so
the model's general quality holds, as the shipped long-context run did, and by
`--drills-per-long` batches of copy drills (agent_tasks.py: the same calls from short requests
with random names and texts, loss on each row's target), which teach copying the task's words.

Before (unless --skip-baseline) and after, metrics.json gets, per agent, the held-out target
loss and exact match of greedy decoding from the rendered prompt (held-out: unseen names,
messages and wordings, and the real-agent test's "hello.py prints hello world"), plus the
short-context perplexity and MTP acceptance of training/train.py. Weights go out as shards
with config.json; `python -m training.export RUN_DIR` installs them. Commands:
training/README.md, "Agent tasks".

Imports only mlx, mlx_lm, numpy and the standard library (the H200 machine has nothing else;
the examples come pre-tokenized from training/agent_data, no tokenizer is needed there).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from training import export
from training.agent_tasks import DRILL_TOKENS, Example, read_split
from training.long_context import DEFAULT_INIT, load_init, long_hidden
from training.mtp_model import TinyCoder, joint_loss
from training.train import BatchSampler, TrainConfig, load_data, model_args, run_eval, run_log, train

AGENT_DATA = Path(__file__).resolve().parent / "agent_data"


# --- batches -----------------------------------------------------------------------------

class Epochs:
    """Every item once per epoch, in a seeded order (which mixes agents and kinds)."""

    def __init__(self, items: list, seed: int):
        self.items, self.rng, self.order = items, random.Random(seed), []

    def __call__(self):
        if not self.order:
            self.order = list(range(len(self.items)))
            self.rng.shuffle(self.order)
        return self.items[self.order.pop()]


class AgentBatches:
    """Step i's batch: one agent example (padded), then `short_per_long` short batches, then
    `drills_per_long` batches of `drill_batch` copy drills, repeating.

    An agent example is prompt + target + padding up to a multiple of `pad_to` (+1), so the
    long steps come in a few shapes; padding sits after the target and, attention being
    causal, changes nothing before it. `current` is the (prompt, target) length of the agent
    example just handed out, None after a short or drill batch: the loss reads it to find the
    target. After a drill batch `drill_mask` marks each row's target tokens (else None).
    """

    def __init__(self, examples: list[Example], arrays: dict, eot: int, cfg: TrainConfig,
                 short_batch: int, short_per_long: int, pad_to: int, width: int,
                 drills: list[Example] = (), drills_per_long: int = 0, drill_batch: int = 16,
                 drill_tokens: int = DRILL_TOKENS):
        self.eot, self.pad_to, self.width = eot, pad_to, width
        self.depth = len(cfg.mtp_weights)
        self.examples = Epochs(examples, cfg.seed)
        self.short = BatchSampler(arrays["code_train"], arrays["chat_train"], eot,
                                  cfg.seq_len + 1 + self.depth, cfg.chat_fraction, cfg.seed + 1)
        self.drills = Epochs(list(drills), cfg.seed + 2)
        self.short_batch, self.short_per_long = short_batch, short_per_long
        self.drill_batch, self.drill_tokens = drill_batch, drill_tokens
        self.period = 1 + short_per_long + (drills_per_long if drills else 0)
        self.current: tuple[int, int] | None = None
        self.drill_mask: np.ndarray | None = None

    def __call__(self, step: int) -> np.ndarray:
        """[B, L] int32 windows for `step`."""
        phase = step % self.period
        self.current = self.drill_mask = None
        if phase > self.short_per_long:
            rows = [self.drills() for _ in range(self.drill_batch)]
            window, self.drill_mask = drill_windows(rows, self.drill_tokens + 1 + self.depth, self.eot)
            return window
        if phase:
            return self.short(self.short_batch)
        ex = self.examples()
        if len(ex.target_ids) > self.width:
            raise SystemExit(f"a {ex.agent} target has {len(ex.target_ids)} tokens > --target-width {self.width}")
        self.current = (len(ex.prompt_ids), len(ex.target_ids))
        return padded_window(ex, self.width + self.depth + 1, self.pad_to, self.eot)[None]


def padded_window(ex: Example, room: int, pad_to: int, pad_id: int) -> np.ndarray:
    """prompt + target, padded with pad_id to k * pad_to + 1 tokens, at least prompt + room."""
    ids = ex.prompt_ids + ex.target_ids
    need = len(ex.prompt_ids) + room
    length = math.ceil((need - 1) / pad_to) * pad_to + 1
    return np.array(ids + [pad_id] * (length - len(ids)), dtype=np.int32)


def drill_windows(drills: list[Example], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Drills as rows of `length` tokens (prompt + target + pad_id) and a mask that is 1 on each
    row's target tokens."""
    window = np.full((len(drills), length), pad_id, dtype=np.int32)
    mask = np.zeros((len(drills), length), dtype=np.float32)
    for row, ex in enumerate(drills):
        p, t = len(ex.prompt_ids), len(ex.target_ids)
        if p + t > length:
            raise SystemExit(f"a {ex.agent} drill has {p + t} tokens > {length}")
        window[row, :p + t] = ex.prompt_ids + ex.target_ids
        mask[row, p:p + t] = 1.0
    return window, mask


# --- loss --------------------------------------------------------------------------------

def masked_joint_loss(model: TinyCoder, window: mx.array, mask: mx.array,
                      mtp_weights: tuple[float, ...]) -> tuple[mx.array, mx.array]:
    """joint_loss counting only the tokens `mask` marks (a drill batch: each row's target).

    window, mask: [B, L + 1 + D]. The trunk at input t predicts window[t + 1], MTP step s at
    anchor t predicts window[t + 2 + s]; each is scored where the token it predicts is masked
    in (MTP: from anchors whose own next token is too, as target_loss counts), averaged over
    those. Returns (total, [main, mtp step 1, ...]) like joint_loss."""
    depth = len(mtp_weights)
    length = window.shape[1] - 1 - depth
    h = model.hidden(window[:, :length])
    ce = nn.losses.cross_entropy
    anchors = mask[:, 1:length + 1]  # inputs whose next token is a target

    def masked_ce(hidden: mx.array, offset: int) -> mx.array:
        labels = window[:, offset:length + offset]
        weights = anchors * mask[:, offset:length + offset]
        per_token = ce(model.logits_from_hidden(hidden).astype(mx.float32), labels)
        return (per_token * weights).sum() / mx.maximum(weights.sum(), 1.0)

    losses = [masked_ce(h, 1)]
    feeds = [window[:, 1 + s:length + 1 + s] for s in range(depth)]
    for s, g in enumerate(model.mtp_chain(h, feeds) if depth else []):
        losses.append(masked_ce(g, 2 + s))
    total = losses[0]
    for w, part in zip(mtp_weights, losses[1:]):
        total = total + w * part
    return total, mx.stack(losses)


def target_loss(model: TinyCoder, window: mx.array, prompt_len: int, target_len: int,
                mtp_weights: tuple[float, ...], chunk: int, width: int) -> tuple[mx.array, mx.array]:
    """Masked joint loss on the target span of one padded agent window.

    Inputs are window[:, :-1]; the trunk's predictions at inputs prompt_len-1 .. +width-1 are
    scored against window[prompt_len .. +width], counting only the `target_len` real target
    tokens. MTP step s from those anchors predicts window[anchor+2+s], counted while that is
    still a target token. Returns (total, [main, mtp step 1, ...]) like joint_loss.
    """
    depth = len(mtp_weights)
    h = long_hidden(model, window[:, :-1], chunk)
    ce = nn.losses.cross_entropy
    start = prompt_len - 1
    positions = mx.arange(width)

    def masked_ce(hidden: mx.array, labels: mx.array, count: int) -> mx.array:
        mask = (positions < count).astype(mx.float32)
        per_token = ce(model.logits_from_hidden(hidden).astype(mx.float32), labels)
        return (per_token * mask).sum() / max(count, 1)

    main = masked_ce(h[:, start:start + width], window[:, prompt_len:prompt_len + width], target_len)
    losses = [main]
    feeds = [window[:, 1 + s:start + width + 1 + s] for s in range(depth)]
    for s, g in enumerate(model.mtp_chain(h[:, :start + width], feeds, tail=width)):
        labels = window[:, prompt_len + 1 + s:prompt_len + 1 + s + width]
        losses.append(masked_ce(g, labels, target_len - 1 - s))
    total = main
    for w, part in zip(mtp_weights, losses[1:]):
        total = total + w * part
    return total, mx.stack(losses)


# --- evaluation --------------------------------------------------------------------------

class ByteLevelText:
    """Token ids -> text with tokenizer.json's vocabulary (the GPU machine has no tokenizers
    package): byte-level BPE pieces map back to bytes; added tokens are their own text."""

    def __init__(self, tokenizer_json: Path):
        spec = json.loads(tokenizer_json.read_text())
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        chars = dict(zip(printable, printable))
        extra = 0
        for b in range(256):
            if b not in chars:
                chars[b] = 256 + extra
                extra += 1
        to_byte = {chr(c): b for b, c in chars.items()}
        self.pieces = {i: bytes(to_byte[ch] for ch in piece) for piece, i in spec["model"]["vocab"].items()}
        self.pieces.update({t["id"]: t["content"].encode() for t in spec["added_tokens"]})

    def __call__(self, ids: list[int]) -> str:
        return b"".join(self.pieces.get(i, b"?") for i in ids).decode("utf-8", errors="replace")


def prefill(model: TinyCoder, ids: list[int], chunk: int) -> tuple[list, mx.array]:
    """A KV cache holding `ids`, fed `chunk` tokens at a time as the server prefills, and the
    logits after the last one."""
    cache = make_prompt_cache(model)
    logits = None
    for s in range(0, len(ids), chunk):
        logits = model(mx.array([ids[s:s + chunk]]), cache=cache)[:, -1, :]
        mx.eval(logits)
    return cache, logits


def score_example(model: TinyCoder, ex: Example, chunk: int, extra: int) -> dict:
    """Greedy decoding from the rendered prompt, checked against the target token by token.

    After the prompt's prefill the target is fed in one pass (teacher forcing): its loss, and
    the first position where the greedy choice differs. Greedy decoding follows the target
    exactly up to that position, so the greedy output is the target's first `match` tokens,
    then (cache trimmed back there) greedy tokens up to the end token, at most as many as the
    target had left plus `extra`: enough to finish the same text in other pieces (the model
    may spell `hello.py` as two tokens where the target has one: `evaluate_agents` then counts
    it a text match) and to show what the model wrote.
    """
    cache, first = prefill(model, ex.prompt_ids, chunk)
    target = ex.target_ids
    rest = model(mx.array([target[:-1]]), cache=cache)[0] if len(target) > 1 else mx.zeros((0, first.shape[-1]))
    logits = mx.concatenate([first, rest], axis=0).astype(mx.float32)
    labels = mx.array(target)
    ce = mx.logsumexp(logits, axis=-1) - mx.take_along_axis(logits, labels[:, None], -1)[:, 0]
    picks = mx.argmax(logits, axis=-1).tolist()
    match = next((i for i, (p, t) in enumerate(zip(picks, target)) if p != t), len(target))
    generated = list(target[:match])
    if match < len(target):
        for c in cache:
            c.trim(len(target) - 1 - match)
        tok = picks[match]
        for _ in range(len(target) - match + extra):
            generated.append(tok)
            if tok == target[-1]:  # <|im_end|>: the turn ended
                break
            tok = int(mx.argmax(model(mx.array([[tok]]), cache=cache)[0, -1]).item())
    return {"loss": float(ce.mean().item()), "exact": match == len(target), "matched_tokens": match,
            "target_tokens": len(target), "generated_ids": generated}


def evaluation_order(heldout: list[Example]) -> list[Example]:
    """hello.py first (each agent's call, then each agent's final answer), then the other tasks
    round-robin over agents, so a time-limited evaluation still covers every agent."""
    def rank(pair: tuple[int, Example]) -> tuple:
        i, e = pair
        nth = sum(1 for o in heldout[:i] if o.agent == e.agent and o.kind == e.kind)
        return (e.task["name"] != "hello.py", e.kind != "call", nth, e.agent)
    return [e for _, e in sorted(enumerate(heldout), key=rank)]


def evaluate_agents(model: TinyCoder, heldout: list[Example], chunk: int, extra: int,
                    text: ByteLevelText | None, budget_s: float = 0.0) -> dict:
    """Per agent and kind: mean target loss, greedy exact-match rate by tokens and by text (the
    same text in other token pieces is what the agent receives; it needs `text`), and the
    hello.py cases in full.

    With budget_s > 0 it stops starting examples once that many seconds have passed (the
    device's command limit is hard) and says how many it scored.
    """
    t = time.perf_counter()
    groups: dict[str, list[dict]] = defaultdict(list)
    cases = []
    order = evaluation_order(heldout)
    for ex in order:
        if budget_s and time.perf_counter() - t > budget_s:
            break
        r = score_example(model, ex, chunk, extra)
        r["text_exact"] = r["exact"] or (text is not None and text(r["generated_ids"]) == ex.target_text)
        groups[f"{ex.agent}/{ex.kind}"].append(r)
        if ex.task["name"] == "hello.py" or not r["exact"]:
            cases.append({"agent": ex.agent, "kind": ex.kind, "task": ex.task["prompt"],
                          "exact": r["exact"], "text_exact": r["text_exact"], "matched_tokens": r["matched_tokens"],
                          "target_tokens": r["target_tokens"],
                          "generated": text(r["generated_ids"]) if text else r["generated_ids"]})
    summary = {key: {"examples": len(rs), "target_loss": round(sum(r["loss"] for r in rs) / len(rs), 4),
                     "exact_match": round(sum(r["exact"] for r in rs) / len(rs), 3),
                     "text_exact_match": round(sum(r["text_exact"] for r in rs) / len(rs), 3)}
               for key, rs in sorted(groups.items())}
    hello = [c for c in cases if "hello.py" in c["task"]]
    return {"by_agent": summary, "hello_py": hello,
            "misses": [c for c in cases if not c["exact"] and c not in hello][:20],
            "scored": sum(len(rs) for rs in groups.values()), "of": len(order),
            "seconds": round(time.perf_counter() - t, 1)}


# --- entry -------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags (defaults: the device run of training/README.md)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, required=True, help="packed short windows (training/pack.py)")
    ap.add_argument("--agent-data", type=Path, default=AGENT_DATA, help="agent_{train,heldout}.jsonl.xz")
    ap.add_argument("--agents", default="", help="comma-separated agents to keep (default: all)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--init", type=Path, default=DEFAULT_INIT, help="checkpoint folder to start from")
    ap.add_argument("--preset", default="coder-deep")
    ap.add_argument("--attn-chunk", type=int, default=1024, help="queries per attention block")
    ap.add_argument("--pad-to", type=int, default=1024, help="agent windows are padded to a multiple of this")
    ap.add_argument("--target-width", type=int, default=96, help="target tokens scored per agent example (max)")
    ap.add_argument("--short-per-long", type=int, default=1, help="short-window batches after each agent example")
    ap.add_argument("--short-batch", type=int, default=32)
    ap.add_argument("--short-seq-len", type=int, default=1024)
    ap.add_argument("--drills-per-long", type=int, default=1,
                    help="batches of copy drills (agent_drills.jsonl.xz) after each agent example's short batches")
    ap.add_argument("--drill-batch", type=int, default=16, help="copy drills per drill batch")
    ap.add_argument("--cache-limit-gb", type=float, default=4.0, help="MLX buffer cache cap (0: MLX default)")
    # Like the long-context runs: a fine-tune of a trained model, so a tenth of the
    # from-scratch peak; Adam moves every weight by about lr in its first steps.
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--time-budget", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-chunk", type=int, default=2048, help="prefill chunk of the held-out decoding")
    ap.add_argument("--eval-extra", type=int, default=12, help="greedy tokens shown past a held-out miss")
    ap.add_argument("--eval-budget", type=float, default=35.0,
                    help="seconds each held-out agent evaluation may start examples for (0: no limit)")
    ap.add_argument("--eval-per-agent", type=int, default=0,
                    help="held-out tasks per agent to decode besides hello.py (0: all)")
    ap.add_argument("--skip-baseline", action="store_true", help="do not evaluate the --init model")
    ap.add_argument("--quick-eval", action="store_true", help="tiny perplexity/acceptance evaluation (CPU dry run)")
    return ap.parse_args(argv)


def _keep(examples: list[Example], agents: str) -> list[Example]:
    wanted = set(agents.split(",")) if agents else None
    return [e for e in examples if wanted is None or e.agent in wanted]


def _first_tasks(heldout: list[Example], per_agent: int) -> list[Example]:
    """The hello.py examples and the first `per_agent` other tasks of each agent (0: all)."""
    if not per_agent:
        return heldout
    prompts: dict[str, list[str]] = defaultdict(list)
    for e in heldout:
        if e.task["name"] != "hello.py" and e.task["prompt"] not in prompts[e.agent]:
            prompts[e.agent].append(e.task["prompt"])
    return [e for e in heldout if e.task["name"] == "hello.py" or e.task["prompt"] in prompts[e.agent][:per_agent]]


def main(argv: list[str] | None = None) -> None:
    """Evaluate the init model, fine-tune it on the agent examples, save shards, evaluate again."""
    a = parse_args(argv)
    if a.cache_limit_gb:
        mx.set_cache_limit(int(a.cache_limit_gb * 2**30))
    shipped = json.loads((a.init / "config.json").read_text())
    drill_file = a.agent_data / "agent_drills.jsonl.xz"
    drills = _keep(read_split(drill_file), a.agents) if a.drills_per_long and drill_file.exists() else []
    heldout_drills = [e for e in drills if e.split == "heldout"]
    drills = [e for e in drills if e.split == "train"]
    period = 1 + a.short_per_long + (a.drills_per_long if drills else 0)  # steps of one agent example
    cfg = TrainConfig(preset=a.preset, seed=a.seed, steps=a.steps, time_budget=a.time_budget,
                      batch=1, seq_len=a.short_seq_len, lr=a.lr, warmup=a.warmup,
                      rope_theta=shipped["rope_theta"], max_position_embeddings=shipped["max_position_embeddings"],
                      speed_steps=(1 + 2 * period, 1 + 5 * period),
                      log_every=10, compile=False)
    log = run_log(a.out)
    arrays, meta = load_data(a.data)
    train_set = _keep(read_split(a.agent_data / "agent_train.jsonl.xz"), a.agents)
    heldout = _first_tasks(_keep(read_split(a.agent_data / "agent_heldout.jsonl.xz"), a.agents), a.eval_per_agent)
    tokenizer_json = a.init / "tokenizer.json"
    text = ByteLevelText(tokenizer_json) if tokenizer_json.exists() else None
    metrics: dict = {"config": asdict(cfg), "init": str(a.init),
                     "agent_sft": {k: str(v) for k, v in vars(a).items()},
                     "examples": {"train": len(train_set), "heldout": len(heldout), "drills": len(drills),
                                  "heldout_drills": len(heldout_drills)}}

    def save_metrics():
        (a.out / "metrics.json").write_text(json.dumps(metrics, indent=1, default=str) + "\n")

    def evaluate_all(model: TinyCoder) -> dict:
        out = {"agents": evaluate_agents(model, heldout, a.eval_chunk, a.eval_extra, text, a.eval_budget)}
        if heldout_drills:  # short prompts with unseen random names: does the model copy?
            out["drills"] = evaluate_agents(model, heldout_drills, a.eval_chunk, a.eval_extra, text, a.eval_budget)
        t = time.perf_counter()
        out.update(run_eval(model, cfg, arrays, a.quick_eval))
        out["short_eval_seconds"] = round(time.perf_counter() - t, 1)
        return out

    model = load_init(a.init, cfg)
    if not a.skip_baseline:
        metrics["eval_init"] = evaluate_all(model)
        log("init " + json.dumps(metrics["eval_init"]["agents"]["by_agent"]))
        save_metrics()

    weights = tuple(cfg.mtp_weights)
    batches = AgentBatches(train_set, arrays, meta["special_ids"]["<|endoftext|>"], cfg, a.short_batch,
                           a.short_per_long, a.pad_to, a.target_width, drills=drills,
                           drills_per_long=a.drills_per_long, drill_batch=a.drill_batch)

    def loss(m, x):
        if batches.drill_mask is not None:  # copy drills: each row's target only
            return masked_joint_loss(m, x, mx.array(batches.drill_mask), weights)
        if batches.current is None:  # a short batch of the from-scratch recipe: full loss
            return joint_loss(m, x, weights)
        prompt_len, target_len = batches.current
        return target_loss(m, x, prompt_len, target_len, weights, a.attn_chunk, a.target_width)

    model, history = train(cfg, arrays, meta, log, model=model, objective=loss, batches=batches)
    metrics["history"] = history
    metrics["peak_memory_gb"] = round(mx.get_peak_memory() / 1e9, 2)
    # Evaluate what ships: the bfloat16 weights, computed in float32 like the baseline.
    export.save_run(model, model_args(cfg, meta["vocab_size"]), a.out, meta["special_ids"]["<|im_end|>"])
    save_metrics()
    metrics["eval_new"] = evaluate_all(model)
    log("new " + json.dumps(metrics["eval_new"]["agents"]["by_agent"]))
    save_metrics()
    log("done")


if __name__ == "__main__":
    main()
