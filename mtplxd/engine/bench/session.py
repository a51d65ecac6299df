"""Time to first token of an agent's follow-up turn: cold, warm (RAM bank), after a restart (SSD).

    python -m mtplxd.engine.bench.session --model PATH [--tokens 4096] [--repeats 3]
        [--depth N] [--json-out FILE]

A coding conversation of about `--tokens` tokens is rendered with the model's chat template.
Each repeat: the conversation's last turn is generated (this stores its state in the bank),
then the follow-up (the conversation + that answer + a new user message) is timed three ways:
- cold: no bank, the whole prompt is prefilled;
- warm: the bank still holds the last turn in RAM;
- ssd: a new bank over the same session-bank directory (what a daemon restart leaves), so
  the prefix is read back from disk (hash-checked) before the new suffix is prefilled.
The output tokens of all three must be identical (greedy). Figures are medians.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mtplxd.engine.bench.harness import median, write_report
from mtplxd.engine.interface import GenerationRequest, GenerationResult, SamplingParams
from mtplxd.engine.session.bank import BankSettings, SessionBank

CODE = '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals and return them sorted."""
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out
'''
ASKS = ("Review this function and point out edge cases.",
        "Add type hints and a docstring example.",
        "Write pytest tests for empty input and touching intervals.",
        "Now make it handle open intervals too.")


def conversation(tokenizer: Any, target_tokens: int) -> list[dict[str, str]]:
    """A system prompt plus user/assistant turns of code until about `target_tokens` long,
    ending with a user turn."""
    messages = [{"role": "system", "content": "You are a careful coding agent working in a repo."}]
    i = 0
    while True:
        ask = ASKS[i % len(ASKS)]
        messages.append({"role": "user", "content": f"{ask}\n\n```python\n{CODE}```"})
        if len(render(tokenizer, messages)) >= target_tokens:
            return messages
        messages.append({"role": "assistant",
                         "content": f"Here is the revised version {i}:\n\n{CODE}"})
        i += 1


def render(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def run(model: Any, prompt: list[int], max_tokens: int, depth: int | None) -> GenerationResult:
    request = GenerationRequest(prompt_ids=prompt, depth=depth, session_id="bench",
                                sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return model.complete(request)


def measure(model_path: str, target_tokens: int, repeats: int, depth: int | None,
            answer_tokens: int) -> dict[str, Any]:
    """Run the bench; returns medians and the raw runs (see the module docstring)."""
    from mtplxd.engine import load_model

    model = load_model(model_path)
    messages = conversation(model.tokenizer, target_tokens)
    prompt = render(model.tokenizer, messages)
    runs: list[dict[str, Any]] = []
    run(model, prompt[:256], 4, depth)  # warm-up: first-call overheads stay out of the figures
    for _ in range(repeats):
        with tempfile.TemporaryDirectory(prefix="mtplx-session-bench-") as ssd_dir:
            settings = BankSettings(ssd_dir=Path(ssd_dir), ssd_min_tokens=512)
            bank = model.enable_session_bank(settings)
            answer = run(model, prompt, answer_tokens, depth)  # the turn the agent got back
            follow = render(model.tokenizer, messages + [
                {"role": "assistant", "content": answer.text},
                {"role": "user", "content": "Thanks. Now add a benchmark for 10k intervals."}])
            assert bank.store is not None and bank.store.flush()
            # A restarted daemon: a new bank over the same disk, nothing in RAM.
            model.bank = SessionBank(bank.identity, settings)
            ssd = run(model, follow, answer_tokens, depth)
            model.bank.close()
            # The running daemon: the previous turn is still in RAM. The disk tier is detached
            # so this run cannot see what the restarted bank just wrote there.
            bank.store.close()
            bank.store = None
            model.bank = bank
            warm = run(model, follow, answer_tokens, depth)
            bank.close()
            model.bank = None
            cold = run(model, follow, answer_tokens, depth)
        runs.append({
            "follow_up_tokens": len(follow),
            "cold_ttft_s": cold.stats.ttft_seconds,
            "warm_ttft_s": warm.stats.ttft_seconds, "warm_cached_tokens": warm.stats.cached_tokens,
            "ssd_ttft_s": ssd.stats.ttft_seconds, "ssd_cached_tokens": ssd.stats.cached_tokens,
            "identical_output": cold.token_ids == warm.token_ids == ssd.token_ids,
        })
    med = {key: median(r[key] for r in runs)
           for key in ("cold_ttft_s", "warm_ttft_s", "ssd_ttft_s")}
    return {
        "model": model_path, "family": model.info.family, "mode": model.info.mode,
        "depth": model.resolve_depth(depth), "prompt_tokens": len(prompt),
        "follow_up_tokens": runs[0]["follow_up_tokens"],
        "cached_tokens_warm": runs[0]["warm_cached_tokens"],
        "cached_tokens_ssd": runs[0]["ssd_cached_tokens"],
        **med,
        "warm_over_cold": med["warm_ttft_s"] / med["cold_ttft_s"],
        "ssd_over_cold": med["ssd_ttft_s"] / med["cold_ttft_s"],
        "identical_output": all(r["identical_output"] for r in runs),
        "repeats": repeats, "runs": runs,
        "machine": f"{platform.system()} {platform.machine()}",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Follow-up turn on a {report['follow_up_tokens']}-token conversation "
                        f"({report['family']}, {report['mode']} depth {report['depth']})")
    for column in ("", "TTFT (s)", "vs cold", "cached tokens"):
        table.add_column(column, justify="right")
    table.add_row("cold", f"{report['cold_ttft_s']:.3f}", "100%", "0")
    table.add_row("warm (RAM)", f"{report['warm_ttft_s']:.3f}", f"{report['warm_over_cold']:.1%}",
                  str(report["cached_tokens_warm"]))
    table.add_row("after restart (SSD)", f"{report['ssd_ttft_s']:.3f}",
                  f"{report['ssd_over_cold']:.1%}", str(report["cached_tokens_ssd"]))
    Console().print(table)
    print(f"identical output cold/warm/ssd: {report['identical_output']}  "
          f"(medians of {report['repeats']} repeats)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mtplxd.engine.bench.session",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="model folder")
    parser.add_argument("--tokens", type=int, default=4096, help="conversation length (tokens)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--depth", type=int, default=None, help="MTP depth (default: the model's)")
    parser.add_argument("--answer-tokens", type=int, default=32, help="tokens per generated turn")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)
    report = measure(args.model, args.tokens, args.repeats, args.depth, args.answer_tokens)
    print_table(report)
    if args.json_out is not None:
        write_report(args.json_out, report)
    return 0 if report["identical_output"] else 1


if __name__ == "__main__":
    sys.exit(main())
