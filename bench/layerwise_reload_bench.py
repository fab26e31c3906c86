"""A cached context reloaded layer by layer vs whole, next to the forward pass that uses it.

Seed 003 section 3 measures a reload by what the forward pass still waits for: 15 ms of KV wait
against a 4.16 s forward once the load overlaps it layer by layer. Here a turn's cached context
(``--contexts`` tokens) lies in host DRAM as a paged cache (pinned where the device is a GPU, as
LMCache's DRAM tier is); the turn's new tokens (``--chunks``) run through ``--layers`` decoder
layers (attention over the context and themselves, lower-right causal, grouped KV heads; a
gated MLP), three ways, alternating within each round:

- **resident**: the context's KV already on the device (no reload; the forward alone);
- **whole**: every layer's KV copied to the device, then the forward (a synchronous reload);
- **layer-wise**: ``kernels.LayerStager`` moves layer i+1 while layer i computes.

The exposed KV wait of a reload is its step time minus the resident step's; the figure seed 003
reports is that wait as a share of the forward. On the CPU the "device" is the same memory and
the copies run on one thread beside the forward (a correctness and smoke path); the numbers
that matter come from a GPU (``staging`` in the JSON says which).

    python -m bench layerwise_reload [--quick] [--out bench/results/layerwise-reload.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own alias

from agentserving.kernels import LayerStager, split_stacked
from bench.common import add_out_args, write_result

# Sizes by device, each overridable by its flag: on a GPU an 8B model's shapes and long
# contexts; on the CPU a ~100M-parameter model's and one 4k context (the GPU sizes need ~25 GB
# of host memory and minutes a step there); --quick: a smoke run anywhere.
SIZES = {
    "cuda": dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, block_size=256,
                 contexts="8192,32768", chunks="256,2048", repeats=10),
    "cpu": dict(layers=8, hidden=1024, heads=8, kv_heads=2, ffn=2816, block_size=256,
                contexts="4096", chunks="256", repeats=5),
    "quick": dict(layers=2, hidden=256, heads=4, kv_heads=2, ffn=512, block_size=64,
                  contexts="1024", chunks="64", repeats=3),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench layerwise_reload", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu, cpu = SIZES["cuda"], SIZES["cpu"]

    def sized(flag: str, key: str, kind: type, text: str) -> None:
        parser.add_argument(flag, type=kind, default=None,
                            help=f"{text} (default {gpu[key]} on a GPU, {cpu[key]} on the CPU).")

    sized("--layers", "layers", int, "Decoder layers")
    sized("--hidden", "hidden", int, "Hidden size")
    sized("--heads", "heads", int, "Query heads")
    sized("--kv-heads", "kv_heads", int, "KV heads (grouped)")
    sized("--ffn", "ffn", int, "MLP width")
    sized("--block-size", "block_size", int, "Tokens per cached block (LMCache's chunk)")
    sized("--contexts", "contexts", str, "Cached context lengths D, comma-separated")
    sized("--chunks", "chunks", str, "New tokens C per turn (a tool result's append, a "
          "prefill chunk), comma-separated")
    sized("--repeats", "repeats", int, "Timed rounds per case")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda if present).")
    q = SIZES["quick"]
    add_out_args(parser, Path("bench/results/layerwise-reload.json"),
                 quick=f"{q['layers']} layers, hidden {q['hidden']}, D {q['contexts']}, "
                       f"C {q['chunks']}, {q['repeats']} rounds")
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    sizes = SIZES["quick" if args.quick else "cuda" if args.device == "cuda" else "cpu"]
    for key, value in sizes.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


class Decoder:
    """Random-weight decoder layers: only their cost matters, not their output."""

    def __init__(self, args: argparse.Namespace, device: str, dtype: torch.dtype) -> None:
        self.heads, self.kv_heads = args.heads, args.kv_heads
        self.head_dim = args.hidden // args.heads
        kv = args.kv_heads * self.head_dim
        scale = args.hidden ** -0.5

        def weight(rows: int, cols: int) -> torch.Tensor:
            return (torch.randn(rows, cols, device=device) * scale).to(dtype)

        self.layers = [{"qkv": weight(args.hidden, args.hidden + 2 * kv),
                        "o": weight(args.hidden, args.hidden),
                        "up": weight(args.hidden, 2 * args.ffn),
                        "down": weight(args.ffn, args.hidden)} for _ in range(args.layers)]

    def layer(self, i: int, x: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
        """``cached``: the context's ``[2, D, kv_heads, head_dim]`` for this layer."""
        w, c, d = self.layers[i], x.shape[0], cached.shape[1]
        q, k, v = (x @ w["qkv"]).split([self.heads * self.head_dim,
                                        self.kv_heads * self.head_dim,
                                        self.kv_heads * self.head_dim], dim=-1)
        k_all = torch.cat([cached[0], k.view(c, self.kv_heads, self.head_dim)])
        v_all = torch.cat([cached[1], v.view(c, self.kv_heads, self.head_dim)])
        group = self.heads // self.kv_heads
        k_all = k_all.repeat_interleave(group, dim=1).transpose(0, 1)
        v_all = v_all.repeat_interleave(group, dim=1).transpose(0, 1)
        q = q.view(c, self.heads, self.head_dim).transpose(0, 1)
        # query j sits at position d + j: it sees the whole context and its own prefix
        mask = torch.ones(c, d + c, dtype=torch.bool, device=x.device).tril(d)
        attn = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)
        x = x + attn.transpose(0, 1).reshape(c, -1) @ w["o"]
        gate, up = (x @ w["up"]).chunk(2, dim=-1)
        return x + (F.silu(gate) * up) @ w["down"]


def timed(fn: Callable[[], object], sync: Callable[[], None]) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - start) * 1e3


def one_case(args: argparse.Namespace, model: Decoder, context: int, chunk: int,
             dtype: torch.dtype) -> dict:
    device, layers = args.device, args.layers
    blocks = -(-context // args.block_size)
    host = torch.randn(layers, 2, blocks, args.block_size, args.kv_heads, model.head_dim,
                       dtype=dtype)
    if device == "cuda":
        host = host.pin_memory()
    k, v = split_stacked(host)
    table = torch.arange(blocks)
    resident = torch.stack([torch.stack([k[i].flatten(0, 1)[:context],
                                         v[i].flatten(0, 1)[:context]]) for i in range(layers)]
                           ).to(device)
    reloaded = torch.empty_like(resident)
    x0 = torch.randn(chunk, args.hidden, device=device).to(dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def forward(kv_of: Callable[[int], torch.Tensor]) -> torch.Tensor:
        x = x0
        for i in range(layers):
            x = model.layer(i, x, kv_of(i))
        return x

    def whole() -> torch.Tensor:
        for i in range(layers):  # the same two copies per layer as the stager's
            reloaded[i, 0].copy_(k[i].flatten(0, 1)[:context], non_blocking=True)
            reloaded[i, 1].copy_(v[i].flatten(0, 1)[:context], non_blocking=True)
        return forward(lambda i: reloaded[i])

    def layerwise() -> torch.Tensor:
        with LayerStager(k, v, table, tokens=context, target=device) as stager:
            return forward(lambda i: stager.get(i))

    modes = {"resident": lambda: forward(lambda i: resident[i]), "whole": whole,
             "layerwise": layerwise}
    whole()  # every reload brings back the resident KV bit for bit
    assert torch.equal(reloaded, resident), "the whole reload changed the KV"
    with LayerStager(k, v, table, tokens=context, target=device) as stager:
        for i in range(layers):
            assert torch.equal(stager.get(i), resident[i]), f"layer {i} staged wrong"
    samples: dict[str, list[float]] = {name: [] for name in modes}
    for r in range(args.repeats):
        order = list(modes) if r % 2 == 0 else list(reversed(modes))
        for name in order:
            samples[name].append(timed(modes[name], sync))
    p50 = {name: statistics.median(s) for name, s in samples.items()}
    fwd = p50["resident"]
    kv_bytes = resident.numel() * resident.element_size()
    exposed = {name: max(0.0, p50[name] - fwd) for name in ("whole", "layerwise")}
    return {
        "context": context, "chunk": chunk, "kv_bytes": kv_bytes,
        "p50_ms": p50, "samples_ms": samples,
        "exposed_kv_wait_ms": exposed,
        "exposed_share_of_forward": {n: e / fwd for n, e in exposed.items()},
        "whole_over_layerwise_step": p50["whole"] / p50["layerwise"],
        "reload_GBps_whole": kv_bytes / (exposed["whole"] * 1e-3) / 1e9
        if exposed["whole"] > 0 else None,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    model = Decoder(args, args.device, dtype)
    contexts = [int(c) for c in args.contexts.split(",")]
    chunks = [int(c) for c in args.chunks.split(",")]
    staging = (f"{torch.cuda.get_device_name()} from pinned host DRAM"
               if args.device == "cuda" else "cpu: one copy thread beside the forward")
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    cases: list[dict] = []
    for context in contexts:
        for chunk in chunks:
            case = one_case(args, model, context, chunk, dtype)
            cases.append(case)
            write_result(args.out, {  # after every case: a cut-off run keeps what it measured
                "config": config,
                "staging": staging, "torch": torch.__version__,
                "seed_003": {"kv_wait_ms": 15, "forward_ms": 4160, "share": 15 / 4160},
                "cases": cases})
            p, e = case["p50_ms"], case["exposed_share_of_forward"]
            print(f"D={context:>6} C={chunk:>5}: forward {p['resident']:8.2f} ms, whole "
                  f"{p['whole']:8.2f} ms (KV wait {e['whole']:6.1%}), layer-wise "
                  f"{p['layerwise']:8.2f} ms (KV wait {e['layerwise']:6.1%})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
