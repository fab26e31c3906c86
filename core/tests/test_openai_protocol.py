"""The worker's request models: what the API fuzzer (tests/fuzz) found, pinned."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from agentserving.core.openai_protocol import ChatCompletionRequest, CompletionRequest


def _chat(**fields):  # type: ignore[no-untyped-def]
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **fields})


def test_json_integers_written_with_a_zero_fraction_are_integers():
    req = CompletionRequest.model_validate({"prompt": [1.0, 2], "max_tokens": 5.0, "seed": 3.0,
                                            "stop_token_ids": [7.0], "logprobs": 2.0})
    assert req.prompt == [1, 2] and req.max_tokens == 5 and req.seed == 3
    assert req.stop_token_ids == [7] and req.logprobs == 2
    assert _chat(forced_output_token_ids=[4.0], top_logprobs=1.0).forced_output_token_ids == [4]


@pytest.mark.parametrize("fields", [{"max_tokens": "5"}, {"max_tokens": True},
                                    {"max_tokens": 5.5}, {"prompt": [1.5]},
                                    {"stop_token_ids": [True]}])
def test_strings_booleans_and_fractions_are_still_not_integers(fields):
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": "x", **fields})


@pytest.mark.parametrize("seed", [2**53, -(2**53), 116378351318493600714161146298368])
def test_a_seed_too_large_for_the_engine_is_a_400_not_a_500(seed):
    # the engine process gets it over msgpack (64-bit ints): it used to fail there, as a 500
    with pytest.raises(ValidationError, match="seed"):
        _chat(seed=seed)
    assert _chat(seed=2**53 - 1).seed == 2**53 - 1


def test_kv_transfer_params_must_cross_to_the_engine():
    with pytest.raises(ValidationError, match=r"kv_transfer_params.a\[1\].b"):
        _chat(kv_transfer_params={"a": [1, {"b": 2**64}]})
    assert _chat(kv_transfer_params={"a": [1.5e300, 2**63 - 1]}).kv_transfer_params


def test_the_schema_says_what_the_validators_check():
    props = CompletionRequest.model_json_schema()["properties"]
    assert props["echo"]["enum"] == [False]
    assert {o.get("type") for o in props["prompt"]["anyOf"]} == {"string", "array"}
    stop = props["stop"]["anyOf"]
    assert stop[0]["minLength"] == 1 and stop[1]["maxItems"] == 4
    assert props["max_tokens"]["anyOf"][0]["minimum"] == 1  # a bound the schema shows
    assert props["seed"]["anyOf"][0]["maximum"] == 2**53 - 1
