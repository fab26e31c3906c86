"""The ``tiny`` model as a Hugging Face folder that both engines load: config, weights, tokenizer.

vLLM loads models from folders, the reference engine builds ``tiny`` in memory. Writing the
in-memory model out — the same seeded weights, and a ``tokenizers`` tokenizer that encodes
exactly as ``ByteTokenizer`` does (UTF-8 bytes at ids 3..258 after BOS, the five role specials,
one pseudo-word per remaining id) with the same chat template — makes a trace's token ids mean
the same on both engines: ``agentserving worker --model DIR`` and ``--engine vllm --model DIR``
see the same prompt ids, and the reference engine's ``--model tiny`` gives the same ids too.

The tokenizer is a byte-level BPE with no merges: every byte is its own token, so encoding is
prefix-stable (what multi-turn reuse with text prompts needs), and the pseudo-words are in the
vocabulary only so that decoding an emitted id gives text. A ``manifest.json`` records the seed
and the weights' digest, so a folder written by another version is rewritten, never trusted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agentserving.engine.model.atomic_folder import write_atomically
from agentserving.engine.model.tokenizer import (
    _BYTE_BASE,
    _FIRST_WORD_ID,
    _SPECIAL_BASE,
    _SPECIALS,
    BOS_ID,
    EOS_ID,
    TINY_VOCAB_SIZE,
    word_piece,
)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
UNK, BOS, EOS = "<unk>", "<s>", "</s>"

# ByteTokenizer.apply_chat_template as Jinja: BOS, <|role|>content<|end|> per message (unknown
# roles count as user), then <|assistant|> when a reply is wanted.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% set r = m['role'] if m['role'] in ['system', 'user', 'assistant', 'tool'] else 'user' %}"
    "{% set c = m['content'] if m['content'] is string else "
    "(m['content'] | map(attribute='text') | join('')) if m['content'] else '' %}"
    "<|{{ r }}|>{{ c }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def byte_level_vocab(vocab_size: int = TINY_VOCAB_SIZE) -> dict[str, int]:
    """Token string (GPT-2's byte-level alphabet, as tokenizers' ``ByteLevel`` uses) -> id,
    for every id below ``vocab_size``."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_char = bytes_to_unicode()
    vocab = {UNK: 0, BOS: BOS_ID, EOS: EOS_ID}
    for b in range(256):
        vocab[byte_char[b]] = _BYTE_BASE + b
    for i, special in enumerate(_SPECIALS):
        vocab[special] = _SPECIAL_BASE + i
    for token_id in range(_FIRST_WORD_ID, vocab_size):
        vocab["".join(byte_char[b] for b in word_piece(token_id).encode())] = token_id
    if len(vocab) != vocab_size:
        raise AssertionError(f"vocabulary has {len(vocab)} distinct entries, not {vocab_size}")
    return vocab


def build_tokenizer(vocab_size: int = TINY_VOCAB_SIZE) -> Any:
    """The ``tokenizers.Tokenizer`` equal to ``ByteTokenizer`` on encode (see module doc)."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    tok = Tokenizer(BPE(vocab=byte_level_vocab(vocab_size), merges=[], unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in (UNK, BOS, EOS, *_SPECIALS)])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, BOS_ID)])
    return tok


def _tokenizer_config(max_len: int) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
        "unk_token": UNK, "pad_token": EOS, "add_bos_token": True, "add_eos_token": False,
        "model_max_length": max_len, "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def _manifest(seed: int, digest: str) -> dict[str, Any]:
    return {"format": FORMAT_VERSION, "model": "tiny", "seed": seed, "weights_digest": digest}


def read_manifest(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def is_current(folder: Path, seed: int) -> bool:
    m = read_manifest(folder)
    return bool(m) and m.get("format") == FORMAT_VERSION and m.get("seed") == seed


def write_model_folder(folder: Path, *, seed: int = 0, force: bool = False) -> Path:
    """Write (atomically: a temp folder renamed into place) the ``tiny`` model with ``seed``'s
    weights to ``folder``; a current folder is kept unless ``force``."""
    folder = Path(folder)
    if is_current(folder, seed) and not force:
        return folder
    from agentserving.engine.model.loader import load_model

    bundle = load_model("tiny", seed=seed)

    def fill(tmp: Path) -> None:
        config = bundle.config
        config.architectures = ["LlamaForCausalLM"]
        config.dtype = "float32"
        bundle.model.save_pretrained(tmp, safe_serialization=True)
        build_tokenizer(int(config.vocab_size)).save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(
            json.dumps(_tokenizer_config(bundle.max_model_len), indent=1))
        (tmp / "special_tokens_map.json").write_text(json.dumps(
            {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": EOS}))
        (tmp / MANIFEST).write_text(json.dumps(_manifest(seed, bundle.weights_digest())))

    return write_atomically(folder, fill)
