"""The model folders the engines serve by name, and where they are cached.

``tiny`` (the seeded random Llama, ``engine.model.folder``) and ``smollm2`` (the real
SmolLM2-135M-Instruct converted from its GGUF, ``engine.model.smollm2``) are written once into
``~/.cache/agentserving/models`` (outside any checkout: every fleet and test on the machine
shares them); vLLM loads them from there, and so does the reference engine for ``smollm2``.
Any other model name is a folder (or, on vLLM, a Hugging Face id) used as it is.
"""

from __future__ import annotations

from pathlib import Path

MODEL_CACHE = Path.home() / ".cache" / "agentserving" / "models"
NAMED_MODELS = ("tiny", "smollm2")


def folder_of(model: str, *, seed: int = 0) -> Path | None:
    """Where a named model's folder lives; None for a model that is not one of ours."""
    if model == "tiny":
        return MODEL_CACHE / f"tiny-seed{seed}"
    if model == "smollm2":
        return MODEL_CACHE / "smollm2"
    return None


def prepare(model: str, *, seed: int = 0, force: bool = False) -> Path | None:
    """Write a named model's folder unless a current one is there; returns it (None for a
    model that is not one of ours)."""
    folder = folder_of(model, seed=seed)
    if folder is None:
        return None
    if model == "tiny":
        from agentserving.engine.model.folder import write_model_folder

        return write_model_folder(folder, seed=seed, force=force)
    from agentserving.engine.model.smollm2 import write_smollm2_folder

    return write_smollm2_folder(folder, force=force)
