"""The point-to-point hand-off's decisions (pure). The pull itself, through a real pair of KV
servers, is engine/kvserver/tests/test_vllm_handoff_contract.py."""

from __future__ import annotations

from agentserving.engine.vllm.handoff import (
    SOURCE_PARAM,
    advertised_source,
    pull_plan,
    with_source,
)


def test_the_advertised_source_is_the_pods_own_server_at_its_public_host():
    assert advertised_source("lm://127.0.0.1:65432", "10.1.2.3") == "lm://10.1.2.3:65432"
    assert advertised_source("lm://0.0.0.0:9", "pod-a") == "lm://pod-a:9"


def test_a_prefill_answer_names_its_source_only_when_it_has_chunks():
    assert with_source({"chunk_hashes": ["ab"]}, "lm://p:1") == {
        "chunk_hashes": ["ab"], SOURCE_PARAM: "lm://p:1"}
    assert with_source(None, "lm://p:1") is None
    assert with_source({"do_remote_decode": True}, "lm://p:1") == {"do_remote_decode": True}


def test_a_decode_request_pulls_only_valid_chunks_from_another_pod():
    params = {"do_remote_prefill": True, "chunk_hashes": ["ab", "-0f", "XYZ", 7],
              SOURCE_PARAM: "lm://prefill:65432"}
    assert pull_plan(params, "lm://decode:65432") == ("lm://prefill:65432", ["ab", "-0f"])
    # not a P/D decode, no source, an odd source, its own server, nothing valid: no pull
    assert pull_plan({**params, "do_remote_prefill": False}, None) is None
    assert pull_plan({k: v for k, v in params.items() if k != SOURCE_PARAM}, None) is None
    assert pull_plan({**params, SOURCE_PARAM: "http://prefill:65433"}, None) is None
    assert pull_plan({**params, SOURCE_PARAM: "lm://prefill:65432/x"}, None) is None
    assert pull_plan(params, "lm://prefill:65432") is None
    assert pull_plan({**params, "chunk_hashes": ["XYZ"]}, None) is None
    assert pull_plan({**params, "chunk_hashes": "ab"}, None) is None
    assert pull_plan(None, None) is None
