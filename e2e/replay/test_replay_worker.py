"""Teacher-forced replay against one real worker (`agentserving worker --model tiny`)."""

from __future__ import annotations

import asyncio

import pytest

from agentserving.replay.client import Replayer, ReplayOptions
from agentserving.replay.testing import AGENTSERVING, has_subcommand
from agentserving.replay.trace import sessions_from
from testkit.servers import free_port, free_port_run, service_process

pytestmark = pytest.mark.skipif(not has_subcommand("worker"),
                                reason="`agentserving worker` is not available yet")


def two_sessions():
    """Two 3-turn sessions sharing a 512-token system prompt; ~0.6-1.3k-token contexts."""
    def session(sid: str) -> dict:
        return {"session_id": sid, "start_s": 0.0, "turns": [
            {"input": {"length": 600, "block_ids": ["sys/0", "sys/1"]}, "output_tokens": 6,
             "tool": "bash", "tool_gap_s": 0.05},
            {"input": {"length": 300}, "output_tokens": 6, "tool": "read_file",
             "tool_gap_s": 0.05},
            {"input": {"length": 300}, "output_tokens": 6}]}
    return sessions_from([session("s0"), session("s1")], block_size=256)


def test_two_runs_send_identical_tokens_and_reuse_kv(tmp_path):
    port, mem = free_port(), free_port_run(2)  # memory API: scheduler + engine
    url = f"http://127.0.0.1:{port}"
    args = [AGENTSERVING, "worker", "--role", "both", "--port", str(port),
            "--memory-port-start", str(mem), "--model", "tiny", "--pod-name", "w0",
            "--cpu-cache-gib", "0.5", "--chunk-size", "256", "--hash-scheme", "blake3"]
    with service_process(args, url + "/readyz", log_path=tmp_path / "worker.log",
                         timeout_s=180):
        runs = []
        for i in range(2):
            opts = ReplayOptions(target=url, progress=False, chunk_size=256,
                                 request_timeout_s=120)
            runs.append(asyncio.run(Replayer(two_sessions(), opts,
                                             out_dir=tmp_path / f"run{i}").run()))
    first, second = ({(r.session_id, r.turn): r for r in run.records} for run in runs)
    assert len(first) == len(second) == 6
    assert all(r.ok for r in first.values()), [r.error for r in first.values()]
    assert all(r.ok for r in second.values()), [r.error for r in second.values()]
    for key, r in first.items():
        # identical token sequences: what we sent, and the chunk hashes the engine computed
        assert r.prompt_digest == second[key].prompt_digest
        assert r.output_digest == second[key].output_digest
        assert r.chunk_hashes_digest is not None
        assert r.chunk_hashes_digest == second[key].chunk_hashes_digest
        assert r.completion_tokens == r.forced_tokens == 6  # teacher forcing took
        assert r.prompt_tokens in (600, 906, 1212)
    # later turns found the previous turn's KV
    for sid in ("s0", "s1"):
        assert first[(sid, 1)].cached_tokens >= 512
        assert first[(sid, 2)].cached_tokens >= 768
    assert runs[0].summary["prefix_hit_rate"] > 0.4
    # the second run starts warm: even first turns hit
    assert second[("s0", 0)].cached_tokens >= 512
