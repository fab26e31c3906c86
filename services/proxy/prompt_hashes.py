"""The chunk hashes of a request's own prompt: precise prefix-cache routing.

Pods running AgentServing's connector return their chunk hashes with every answer, and the
proxy looks the session's next turn up by them. A plain vLLM pod returns none; what it
publishes instead is a KV event per block it stores or evicts, hashed its own way. With
``--prompt-hash-scheme vllm-sha256`` (and vLLM's block size as ``--chunk-size``) the proxy
hashes the prompt the way vLLM does and asks the kvindex, which indexed those events, which
pod holds the longest prefix: llm-d's precise scorer, on the kvindex's one interface.

Only token-id prompts are hashed: a text prompt or chat messages would need the model's
tokenizer and chat template in the proxy (not done; those turns fall back to the pods'
returned hashes, if any).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agentserving.core.hashing import ChunkHasher, HashScheme


def prompt_chunk_hashes(endpoint: str, body: Mapping[str, Any], scheme: HashScheme,
                        chunk_size: int) -> list[str] | None:
    """The prompt's full-chunk hashes in ``scheme``, salted by the body's ``cache_salt`` as the
    engine salts them; None when the prompt is not a list of token ids."""
    if endpoint.endswith("/chat/completions"):
        return None
    prompt = body.get("prompt")
    if not (isinstance(prompt, list) and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        return None
    salt = body.get("cache_salt")
    return ChunkHasher(scheme, chunk_size,
                       cache_salt=salt if isinstance(salt, str) and salt else None
                       ).hashes(prompt)
