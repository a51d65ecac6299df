"""How often a model's first call on each agent's hello.py prompt does the task, by sampler.

    python -m training.agent_sampling [--model mtplxd/models/embedded] [--agents pi,codex]
        [--samplers 1:1:0,0.3:0.95:20,0:1:0] [--samples 6] [--max-tokens 130] [--json-out F]

Each agent's held-out hello.py "call" example (`agent_data/agent_heldout.jsonl.xz`: the
agent's recorded first request with the real-agent test's task, rendered as the daemon
renders it) is sampled `--samples` times (seeds 0..n-1) through the engine, the way the daemon
serves it (the session bank keeps the prompt's prefill for the next sample). A sample is
good when its text names `hello.py` and holds `hello world`. A sampler is
TEMPERATURE:TOP_P:TOP_K. This is what chose the embedded model's default sampler
(training/README.md, "Copy drills").
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from mtplxd.engine import GenerationRequest, SamplingParams, load_model
from mtplxd.engine.session.bank import BankSettings
from training.agent_sft import AGENT_DATA
from training.agent_tasks import read_split

REPO = Path(__file__).resolve().parent.parent
HELDOUT = AGENT_DATA / "agent_heldout.jsonl.xz"


def parse_sampler(text: str) -> tuple[float, float, int]:
    """'0.3:0.95:20' -> (temperature, top_p, top_k)."""
    temperature, top_p, top_k = text.split(":")
    return float(temperature), float(top_p), int(top_k)


def does_the_task(text: str) -> bool:
    """The call names hello.py and its content prints hello world."""
    return "hello.py" in text and "hello world" in text


def sample_agents(model_path: Path, agents: list[str], samplers: list[tuple[float, float, int]],
                  samples: int, max_tokens: int) -> list[dict]:
    """One row per (agent, sampler): good samples out of `samples`, and the first three texts."""
    model = load_model(model_path)
    model.enable_session_bank(BankSettings())
    heldout = read_split(HELDOUT)
    rows = []
    for agent in agents:
        example = next(e for e in heldout
                       if e.agent == agent and e.kind == "call" and e.task["name"] == "hello.py")
        for temperature, top_p, top_k in samplers:
            started = time.perf_counter()
            texts = []
            for seed in range(samples):
                sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                                          seed=seed, max_tokens=max_tokens)
                result = model.complete(GenerationRequest(list(example.prompt_ids), sampling))
                texts.append(model.tokenizer.decode(result.token_ids))
            rows.append({"agent": agent, "temperature": temperature, "top_p": top_p, "top_k": top_k,
                         "good": sum(map(does_the_task, texts)), "samples": samples,
                         "seconds": round(time.perf_counter() - started, 1), "texts": texts[:3]})
            print(f"{agent} T={temperature} top_p={top_p} top_k={top_k}: "
                  f"{rows[-1]['good']}/{samples} ({rows[-1]['seconds']} s)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=REPO / "mtplxd" / "models" / "embedded")
    ap.add_argument("--agents", default="pi,codex,opencode,hermes,claude")
    ap.add_argument("--samplers", default="1:1:0,0.3:0.95:20,0:1:0",
                    help="comma-separated TEMPERATURE:TOP_P:TOP_K")
    ap.add_argument("--samples", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=130,
                    help="enough for Claude Code's and OpenCode's absolute paths")
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args(argv)
    rows = sample_agents(a.model, a.agents.split(","), [parse_sampler(s) for s in a.samplers.split(",")],
                         a.samples, a.max_tokens)
    if a.json_out:
        a.json_out.write_text(json.dumps({"model": str(a.model), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
