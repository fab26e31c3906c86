"""The ``tiny`` model as a folder: what the reference engine holds in memory, loadable by
transformers (and so by vLLM), with a tokenizer that gives ``ByteTokenizer``'s ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from agentserving.engine.model.folder import is_current, read_manifest, write_model_folder
from agentserving.engine.model.loader import load_model
from agentserving.engine.model.tokenizer import ByteTokenizer, load_tokenizer


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_folder(tmp_path_factory.mktemp("models") / "tiny-seed0", seed=0)


def test_the_folder_holds_the_seeded_weights(folder: Path) -> None:
    tiny = load_model("tiny", seed=0)
    loaded = load_model(str(folder))
    assert loaded.weights_digest() == tiny.weights_digest()
    assert read_manifest(folder)["weights_digest"] == tiny.weights_digest()
    ids = torch.tensor([[1, 50, 60, 70, 300]])
    with torch.no_grad():
        assert torch.equal(tiny.model(ids).logits, loaded.model(ids).logits)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.parametrize("text", ["hello world", "héllo ✓ naïve 日本", "  two  spaces\n\ttab",
                                  "", "<s> not a special in ByteTokenizer? it is here"])
def test_the_folders_tokenizer_encodes_as_the_byte_tokenizer(folder: Path, text: str) -> None:
    hf, byte = load_tokenizer(str(folder)), ByteTokenizer(32000)
    if "<s>" in text:  # specials in text are special tokens to a HF tokenizer
        assert hf.encode(text)[:2] == [1, 1]
        return
    assert hf.encode(text) == byte.encode(text)


def test_the_chat_template_and_decoding_match(folder: Path) -> None:
    hf, byte = load_tokenizer(str(folder)), ByteTokenizer(32000)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "ok"}, {"role": "tool", "content": "{\"x\": 1}"},
            {"role": "developer", "content": "counts as user"}]
    assert hf.apply_chat_template(msgs) == byte.apply_chat_template(msgs)
    ids = [264, 300, 8363, 8364, 20000, 31999]
    assert hf.decode(ids) == byte.decode(ids)


def test_a_current_folder_is_kept_and_another_seed_rewritten(folder: Path) -> None:
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    write_model_folder(folder, seed=0)
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert is_current(folder, 0) and not is_current(folder, 1)
