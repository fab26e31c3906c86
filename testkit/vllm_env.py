"""Test support for code that meets vLLM's real classes: where the test-only vLLM env of
``scripts/vllm-test-env.sh`` lives, and what a probe child process does first; and, for the
tests that serve with vLLM, the serving env of ``scripts/vllm-env.sh`` (``require_serving_env``).

vLLM is imported only inside child processes (its import changes process-wide state), which
call ``enter_vllm_env`` and write a tiny Llama config that vLLM's config classes accept.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "vllm-test-env.sh"
SERVING_SCRIPT = SCRIPT.with_name("vllm-env.sh")
INSTALLED_STAMP = ".agentserving-installed"


def require_serving_env() -> None:
    """Skip without the vLLM serving env (a failure under CI), and link this checkout into it
    (the env links one checkout editable; quick when it already is this one)."""
    import pytest

    from agentserving.engine.vllm.serve_command import DEFAULT_ENV_DIR

    if not (DEFAULT_ENV_DIR / "bin" / "python").exists():
        if os.environ.get("CI"):
            pytest.fail(f"the vLLM env is missing ({DEFAULT_ENV_DIR}); make test installs it")
        pytest.skip(f"no vLLM env at {DEFAULT_ENV_DIR} (scripts/vllm-env.sh installs it)")
    subprocess.run(["bash", str(SERVING_SCRIPT)], check=True, timeout=900)


def vllm_env_dir() -> Path | None:
    """The installed env's folder, or None (not installed, or skipped on purpose)."""
    if not SCRIPT.exists() or os.environ.get("AGENTSERVING_SKIP_VLLM_ENV") == "1":
        return None
    out = subprocess.run(["bash", str(SCRIPT), "--path"], capture_output=True, text=True,
                         check=True)
    path = Path(out.stdout.strip())
    return path if (path / INSTALLED_STAMP).exists() and (path / "vllm").is_dir() else None


def enter_vllm_env(env_dir: str | Path) -> None:
    """Make vLLM importable here and in the interpreters vLLM spawns, after the project's venv
    (the env holds only packages the venv lacks, so it never shadows torch or LMCache)."""
    sys.path.append(str(env_dir))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.environ.get("PYTHONPATH"), str(env_dir)) if p)


def write_tiny_llama(folder: Path, max_positions: int) -> Path:
    """A 2-layer Llama config (no weights: nothing here runs a forward pass)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": max_positions,
        "torch_dtype": "float32", "rms_norm_eps": 1e-5}))
    return folder
