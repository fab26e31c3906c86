"""A real worker process with non-default paged-KV settings (small blocks, a small pool, the
non-overlapped load): the flags reach the engine, reuse over HTTP stays bit-identical to the
first computation, concurrent requests wait for blocks instead of failing, and a request the
pool can never hold is refused up front (the pool caps the context length the API reports)."""

from __future__ import annotations

import concurrent.futures

import httpx

from testkit.worker import prompt, worker_process


def test_small_blocks_small_pool_sync_load_reuse_is_identical(tmp_path):
    # 16 MiB: 2048 KV slots of 8 KiB (tiny model), 128 blocks of 16 tokens
    with worker_process(tmp_path, "--kv-block-size", "16", "--kv-cache-gib", str(16 / 1024),
                        "--no-kv-layerwise-load", "--max-model-len", "4096",
                        name="w-paged") as w:
        ids = prompt(700, seed=300)
        body = {"prompt": ids, "max_tokens": 4, "logprobs": 2, "return_token_ids": True}
        cold = w.complete(**body)
        warm = w.complete(**body)
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 512
        a, b = cold["choices"][0], warm["choices"][0]
        assert a["token_ids"] == b["token_ids"]
        assert a["logprobs"]["token_logprobs"] == b["logprobs"]["token_logprobs"]  # exact
        # the pool holds 2048 slots: three 900-token turns at once must take turns, all fine
        turns = [prompt(900, seed=301 + i) for i in range(3)]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            outs = list(pool.map(lambda t: w.complete(prompt=t, max_tokens=3), turns))
        assert all(o["usage"]["completion_tokens"] == 3 for o in outs)
        # more than the whole pool: a 400 naming the field, and the worker keeps serving
        models = httpx.get(w.url + "/v1/models", timeout=10).json()["data"][0]
        assert models["max_model_len"] == 2048  # min(--max-model-len, the pool)
        r = httpx.post(w.url + "/v1/completions", timeout=120,
                       json={"prompt": prompt(2000, seed=305), "max_tokens": 100})
        assert r.status_code == 400 and "max_tokens" in r.text and "2048" in r.text
        assert w.complete(prompt=ids, max_tokens=1)["usage"]["completion_tokens"] == 1
