"""Run a serving group from the command line: start the workers, be rank 0, run requests.

What the distributed tests and the loopback benchmark drive (the daemon serves the same
group through `load_group_model`). Prints one JSON object: the group (ranks, split, link),
each request's tokens and speed, the link's exchange time and the workers' compute time.

    python -m mtplxd.engine.distributed.run --hosts hosts.json --model PATH \
        --prompts '[[1,2,3]]' --depths 0,3 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from mtplxd.engine.distributed.link import DEFAULT_TIMEOUT_S
from mtplxd.engine.distributed.pipeline import worker_stats
from mtplxd.engine.distributed.serving import GroupOptions, ServingGroup
from mtplxd.engine.interface import GenerationRequest, GroupLost, ModelLoadError, SamplingParams


def _requests(model: Any, prompts: list[list[int]], depths: list[int], max_tokens: int,
              repeats: int, sampling: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    out = []
    # Depths back to back on each prompt, repeats outermost: a benchmark's AR and MTP runs
    # see the same machine state (bench/harness.interleaved).
    for _ in range(repeats):
        for index, prompt in enumerate(prompts):
            for depth in depths:
                out.append(_one(model, index, prompt, depth, max_tokens, sampling or {}))
    return out


def _one(model: Any, index: int, prompt: list[int], depth: int, max_tokens: int,
         sampling: dict[str, Any]) -> dict[str, Any]:
    link = model.trunk.link
    before = (link.exchange_seconds, link.exchanges)
    request = GenerationRequest(prompt, SamplingParams(max_tokens=max_tokens, **sampling),
                                depth=depth)
    try:
        result = model.complete(request)
    except GroupLost as exc:
        return {"prompt": index, "depth": depth, "error": "group_lost", "message": str(exc)}
    s = result.stats
    return {"prompt": index, "depth": depth, "token_ids": result.token_ids,
            "finish_reason": result.finish_reason, "cycles": s.cycles,
            "decode_tokens_per_second": s.decode_tokens_per_second,
            "mean_accepted_length": s.mean_accepted_length,
            "exchange_seconds": link.exchange_seconds - before[0],
            "exchanges": link.exchanges - before[1]}


def prompt_logits(model: Any, prompt: list[int]) -> list[float]:
    """The logits after reading `prompt` into a fresh row (float32 values)."""
    import mlx.core as mx

    _, logits = model.trunk.prefill(prompt, model.trunk.make_cache())
    return logits.astype(mx.float32).tolist()


def main(argv: list[str] | None = None) -> int:
    """Start the group, run the requests, stop the group; exit 0, or 2 when refused."""
    parser = argparse.ArgumentParser(prog="mtplxd-group", description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, default=0, help="first ring port (0: find free ones)")
    parser.add_argument("--split", default=None, help="layers per rank, e.g. 2,1,1")
    parser.add_argument("--prompts", default="[[1, 2, 3]]", help="JSON list of token-id lists")
    parser.add_argument("--depths", default="0,3")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S)
    parser.add_argument("--quantize", default="auto")
    parser.add_argument("--dequantize", default="auto", choices=("auto", "on", "off"),
                        help="Linux CPU: a quantized checkpoint's weights as dense float32 on every rank")
    parser.add_argument("--sampling", default="{}",
                        help='SamplingParams fields as JSON, e.g. {"temperature": 0.8, "seed": 7}')
    parser.add_argument("--fault", default=None,
                        help="after the requests: 'kill:R' or 'stop:R' rank R, then run them "
                             "again; 'kill:R:S' does it S seconds into that run (mid-generation)")
    parser.add_argument("--hold", type=float, default=0.0,
                        help="after the requests, print the group as a JSON line and stay idle "
                             "this many seconds (tests freeze or kill rank 0 meanwhile)")
    parser.add_argument("--logits", action="store_true",
                        help="also print each prompt's last-position logits (a fresh row), to "
                             "compare with one process")
    parser.add_argument("--log-dir", default=None)
    args = parser.parse_args(argv)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="mtplx-group-"))
    group = ServingGroup(GroupOptions(Path(args.hosts), log_dir, args.split, args.timeout, args.port),
                         log=lambda line: print(line, file=sys.stderr))
    path = Path(args.model).expanduser().resolve()
    out: dict[str, Any] = {}
    try:
        began = time.perf_counter()
        model = group.load(path, model_id=path.name, depth=None, quantize=args.quantize,
                           dequantize=args.dequantize)
        out["load_seconds"] = round(time.perf_counter() - began, 3)
        out["ranks"] = group.hosts.size
        out["group"] = model.group.to_dict()
        out["vision"] = {"served": model.info.vision, "reason": model.info.vision_reason}
        link = group.link
        prompts, depths = json.loads(args.prompts), [int(d) for d in args.depths.split(",")]
        link.ring_json({"kind": "reset_stats"})
        out["results"] = _requests(model, prompts, depths, args.max_tokens, args.repeats,
                                   json.loads(args.sampling))
        out["workers"] = worker_stats(link)
        if args.logits:
            out["logits"] = [prompt_logits(model, prompt) for prompt in prompts]
        if args.hold:
            print(json.dumps({"holding": group.status()}), flush=True)
            time.sleep(args.hold)
            out["after_hold"] = group.status()
        if args.fault:
            action, rank, *delay = args.fault.split(":")
            pid = group.workers.procs[int(rank) - 1].process.pid
            sig = signal.SIGKILL if action == "kill" else signal.SIGSTOP
            fault = threading.Timer(float(delay[0]) if delay else 0.0, os.kill, (pid, sig))
            fault.start()
            if not delay:
                fault.join()
            began = time.perf_counter()
            out["after_fault"] = _requests(model, prompts[:1], depths[:1], args.max_tokens, 1,
                                           json.loads(args.sampling))
            out["after_fault_seconds"] = round(time.perf_counter() - began, 3)
            out["again"] = _requests(model, prompts[:1], depths[:1], args.max_tokens, 1)
            out["status"] = group.status()
    except ModelLoadError as exc:
        out["refused"] = str(exc)
    except GroupLost as exc:
        out["lost"] = str(exc)
    finally:
        group.stop()
    print(json.dumps(out))
    return 2 if "refused" in out else 0


if __name__ == "__main__":
    # Rank 0 ran MLX on the link thread: leave without the interpreter teardown that can abort
    # in MLX's native threads (seen here, after the report was printed, as exit code -6).
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
