"""The reference engine's grid attention (engine/model/attention.py) against one SDPA call per
step: the tiny model prefills a prompt in the scheduler's steps and decodes a few tokens, the
two implementations interleaved in one run (machine noise hits both alike), best of --reps.

    python -m bench attention [--quick] [--out bench/results/attention.json]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench.common import add_out_args, write_result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench attention", description=__doc__)
    parser.add_argument("--prompt-tokens", type=int, default=4096, help="Prompt length.")
    parser.add_argument("--step-tokens", type=int, default=2048,
                        help="Prefill tokens per step (a multiple of the 64-position grid).")
    parser.add_argument("--decode-tokens", type=int, default=16, help="Decode steps after it.")
    parser.add_argument("--reps", type=int, default=3, help="Repetitions; the best is kept.")
    parser.add_argument("--threads", type=int, default=1, help="torch threads.")
    add_out_args(parser, Path("bench/results/attention.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.prompt_tokens, args.step_tokens, args.decode_tokens, args.reps = 512, 256, 4, 1
    return args


def one_turn(model, args: argparse.Namespace) -> float:  # noqa: ANN001
    from transformers import DynamicCache

    seeded = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 30000, (1, args.prompt_tokens), generator=seeded)
    start = time.perf_counter()
    cache = DynamicCache()
    with torch.inference_mode():
        for s in range(0, args.prompt_tokens, args.step_tokens):
            e = min(args.prompt_tokens, s + args.step_tokens)
            model(input_ids=ids[:, s:e], past_key_values=cache, use_cache=True,
                  cache_position=torch.arange(s, e), logits_to_keep=1)
        for p in range(args.prompt_tokens, args.prompt_tokens + args.decode_tokens):
            model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True,
                  cache_position=torch.arange(p, p + 1), logits_to_keep=1)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    from agentserving.engine.model.attention import ATTENTION_NAME
    from agentserving.engine.model.loader import load_model

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model("tiny").model
    best = {"sdpa": float("inf"), ATTENTION_NAME: float("inf")}
    for _ in range(args.reps):
        for impl in best:  # interleaved
            model.config._attn_implementation = impl
            best[impl] = min(best[impl], one_turn(model, args))
    model.config._attn_implementation = ATTENTION_NAME
    result = {"prompt_tokens": args.prompt_tokens, "step_tokens": args.step_tokens,
              "decode_tokens": args.decode_tokens, "reps": args.reps, "threads": args.threads,
              "seconds": {k: round(v, 4) for k, v in best.items()},
              "grid_over_sdpa": round(best[ATTENTION_NAME] / best["sdpa"], 3)}
    print(result)
    write_result(args.out, result)
    return 0
