"""The proxy's own prompt hashes (precise prefix-cache routing of plain vLLM pods)."""

from __future__ import annotations

from agentserving.core.hashing import ChunkHasher, HashScheme
from agentserving.proxy.prompt_hashes import prompt_chunk_hashes

TOKENS = list(range(1000, 1300))


def test_token_prompts_are_hashed_in_the_scheme_and_salted_like_the_engine():
    plain = prompt_chunk_hashes("/v1/completions", {"prompt": TOKENS},
                                HashScheme.VLLM_SHA256, 128)
    assert plain == ChunkHasher(HashScheme.VLLM_SHA256, 128).hashes(TOKENS)
    assert len(plain) == 2  # full blocks only
    salted = prompt_chunk_hashes("/v1/completions", {"prompt": TOKENS, "cache_salt": "t1"},
                                 HashScheme.VLLM_SHA256, 128)
    assert salted[0] != plain[0] and salted[1] != plain[1]  # the salt reaches the whole chain


def test_what_cannot_be_hashed_without_a_tokenizer_gives_none():
    for endpoint, body in (("/v1/completions", {"prompt": "text"}),
                           ("/v1/completions", {"prompt": [[1, 2], [3]]}),
                           ("/v1/completions", {"prompt": [True, 2]}),
                           ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                   "content": "hi"}]})):
        assert prompt_chunk_hashes(endpoint, body, HashScheme.VLLM_SHA256, 128) is None
