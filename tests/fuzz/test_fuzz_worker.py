"""Fuzz a real reference worker (``agentserving worker``, tiny model, CPU) from its own
OpenAPI documents: the OpenAI API, the memory API of the API process (which forwards to the
engine process) and the engine process's own memory API with the P/D hand-off routes.

After the runs the worker must still be alive and serving, and what it stores must not be
corrupted: a greedy completion gives the same tokens as before the fuzzing, and the forwarding
memory API reports the same residency as the engine process behind it, chunk hashes only.
"""

from __future__ import annotations

import httpx
import pytest

from agentserving.core.hashing import is_chunk_hash
from testkit.worker import Worker, prompt


def _greedy(w: Worker) -> list[int]:
    out = w.complete(prompt=prompt(16, seed=7), max_tokens=8, temperature=0.0,
                     return_token_ids=True)
    return out["choices"][0]["token_ids"]


def _residency(url: str) -> dict[str, list[str]]:
    r = httpx.get(url + "/memory/chunks", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["chunks"]


def test_worker_openai_api_fuzz(fleet, fuzz) -> None:  # type: ignore[no-untyped-def]
    worker = fleet.worker
    before = _greedy(worker)
    # positive_data_acceptance, except the one 400 no schema can foresee (st_hooks.py): this
    # worker's schema bounds token ids by its vocabulary, not a prompt by its context
    run = fuzz(worker.url, "worker-openai", max_examples=15,
               runtime_limit_codes=("context_length_exceeded", "integer_out_of_range"),
               timeout_s=300)
    run.assert_clean()
    assert "positive_data_acceptance_within_model_limits" in run.check_names
    assert _greedy(worker) == before, "the same greedy completion changed after the fuzzing"


@pytest.mark.parametrize("which", ["forwarding", "engine"])
def test_worker_memory_api_fuzz(fleet, fuzz, which: str) -> None:  # type: ignore[no-untyped-def]
    worker = fleet.worker
    before = _greedy(worker)  # leaves the prompt's chunks in the tiers for the fuzzer to find
    url = worker.memory_url if which == "forwarding" else worker.engine_url(0)
    run = fuzz(url, f"worker-memory-{which}", max_examples=40)
    run.assert_clean()
    merged, engine = _residency(worker.memory_url), _residency(worker.engine_url(0))
    assert merged == engine, "the forwarding memory API disagrees with its engine process"
    assert all(is_chunk_hash(h) for hashes in engine.values() for h in hashes), engine
    assert _greedy(worker) == before, "the same greedy completion changed after the fuzzing"
