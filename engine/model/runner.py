"""Runs the causal LM one step at a time against a per-request KV cache, and samples.

Bit-exactness contract (what makes reused KV indistinguishable from recomputed KV): with
the CPU SDPA kernels, a token's K/V and logits depend on the *shape* of the forward pass that
computed it when that pass is short (fewer than ~256 rows), not on the pass when it is at
least one LMCache chunk long. The engine therefore splits prefill at chunk boundaries: every
full chunk is computed in a pass of >= ``chunk_size`` rows, and the trailing partial chunk is
always a pass of its own. Reusing a chunk-aligned prefix then reproduces a full recompute
bit for bit (tests assert it). Decode steps are one row in both cases.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from agentserving.engine.model.loader import ModelBundle

LayerKV = tuple[torch.Tensor, torch.Tensor]  # keys, values: [1, kv_heads, tokens, head_dim]


class ModelRunner:
    def __init__(self, bundle: ModelBundle) -> None:
        self.bundle = bundle
        self.model = bundle.model
        self.config = bundle.config

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    def cache_from_layers(self, layers: Sequence[LayerKV]) -> Any:
        cache = self.new_cache()
        for idx, (k, v) in enumerate(layers):
            cache.update(k, v, idx)
        return cache

    def paged_cache(self, kv: Any, length: int = 0, source: Any = None) -> Any:
        """A cache over the engine's paged KV (``engine.kv.paged``): ``length`` tokens are in
        ``kv`` already, or arriving layer by layer (``source(layer)`` waits for one)."""
        from agentserving.engine.kv.paged import paged_cache

        return paged_cache(self.config, kv, length, source)

    @staticmethod
    def cache_len(cache: Any) -> int:
        return int(cache.get_seq_length())

    @staticmethod
    def cache_layers(cache: Any) -> list[LayerKV]:
        """Per-layer ``[1, kv_heads, tokens, head_dim]`` K and V (for a paged cache: views of
        its blocks when they are consecutive, else gathered copies)."""
        kv = getattr(cache, "paged_kv", None)
        if kv is not None:
            return kv.layers(cache.layers[0].length)
        return [(layer.keys, layer.values) for layer in cache.layers]

    @torch.inference_mode()
    def forward(self, token_ids: Sequence[int], cache: Any, start: int) -> torch.Tensor:
        """Feed ``token_ids`` at positions ``start..``; returns the last row's logits (fp32)."""
        n = len(token_ids)
        ids = torch.tensor([list(token_ids)], dtype=torch.long)
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True,
                         cache_position=torch.arange(start, start + n), logits_to_keep=1)
        return out.logits[0, -1].float()


# ---------------------------------------------------------------- sampling


def sample(logits: torch.Tensor, *, temperature: float | None, top_p: float | None,
           seed: int | None, position: int) -> int:
    """Greedy when temperature is None/0; otherwise temperature + nucleus sampling whose
    randomness is a function of (seed, output position) only, so a request continued on
    another pod (P/D hand-off) draws the same tokens a single pod would."""
    if not temperature:
        return int(torch.argmax(logits).item())
    scaled = logits / temperature
    if bool(torch.isnan(scaled).any() or torch.isposinf(scaled).any()):
        # a temperature so small (1e-308 is valid; in float32 it is 0) that logits / T
        # overflow and softmax would be NaN: its limit, greedy, is what it asks for
        return int(torch.argmax(logits).item())
    probs = torch.softmax(scaled, dim=-1)
    if top_p is not None and top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p
        keep[0] = True
        filtered = torch.zeros_like(probs)
        filtered[order[keep]] = sorted_probs[keep]
        probs = filtered / filtered.sum()
    gen = torch.Generator()
    gen.manual_seed(((seed or 0) * 1_000_003 + position) % (2**63))
    return int(torch.multinomial(probs, 1, generator=gen).item())


def logprobs_of(logits: torch.Tensor, token_id: int,
                top_n: int) -> tuple[float, list[tuple[int, float]]]:
    lp = torch.log_softmax(logits, dim=-1)
    chosen = float(lp[token_id].item())
    top: list[tuple[int, float]] = []
    if top_n > 0:
        vals, idx = torch.topk(lp, top_n)
        top = [(int(i), float(v)) for i, v in zip(idx.tolist(), vals.tolist(), strict=True)]
    if math.isnan(chosen):
        chosen = float("-inf")
    return chosen, top
