"""The proxy's routing records (``/v1/sessions/{sid}/route``), on both backends: what one
proxy replica writes after a turn every other reads before the next, scoped by tenant, apart
from the session (no session made, no chunk protected), gone with a close or the idle TTL."""

from __future__ import annotations

import time

from agentserving.core.schemas import TENANT_HEADER

from .test_lifecycle import CHAIN, evicted, kvindex, ok, pod_holding

ROUTE = {"turns": 3, "chunk_hashes": CHAIN[:4], "last_pod": "prefill-0",
         "last_decode_pod": "decode-1", "prompt_tokens": 1100, "prompt_chars": None}


def test_a_record_is_read_back_by_any_caller_of_its_tenant(store, memory_api):
    peer = memory_api()
    with kvindex(store, session_idle_ttl_s=600) as kv:
        assert kv.get("/v1/sessions/s/route").status_code == 404
        assert ok(kv.put("/v1/sessions/s/route", json=ROUTE)) == ROUTE
        assert ok(kv.get("/v1/sessions/s/route")) == ROUTE
        newer = {**ROUTE, "turns": 4, "last_decode_pod": "decode-0"}
        ok(kv.put("/v1/sessions/s/route", json=newer))
        assert ok(kv.get("/v1/sessions/s/route")) == newer
        # another tenant's "s" is another record
        assert kv.get("/v1/sessions/s/route", headers={TENANT_HEADER: "b"}).status_code == 404
        # a record is no session: it makes none and protects none of its chunks
        assert kv.get("/v1/sessions/s").status_code == 404
        pod_holding(kv, "p", peer.url, CHAIN[:4])
        r = ok(kv.post("/v1/evict", json={"chunk_hashes": CHAIN[:4]}))
        assert r["protected"] == [] and evicted(peer) == CHAIN[:4]
        # a close (of a session with intents, or of none) takes the record with it
        ok(kv.put("/v1/sessions/s/intents/plan", json={"chunk_hashes": CHAIN[:1]}))
        ok(kv.delete("/v1/sessions/s"))
        assert kv.get("/v1/sessions/s/route").status_code == 404
        ok(kv.put("/v1/sessions/t/route", json=ROUTE))
        assert kv.delete("/v1/sessions/t").status_code == 404  # no session of that id ...
        assert kv.get("/v1/sessions/t/route").status_code == 404  # ... its record went


def test_a_record_lapses_with_the_idle_ttl(store):
    with kvindex(store, session_idle_ttl_s=0.3) as kv:
        ok(kv.put("/v1/sessions/s/route", json=ROUTE))
        assert ok(kv.get("/v1/sessions/s/route"))["turns"] == 3
        time.sleep(0.5)
        assert kv.get("/v1/sessions/s/route").status_code == 404


def test_a_bad_record_names_the_field(store):
    with kvindex(store) as kv:
        for body, param in (({**ROUTE, "turns": -1}, "turns"),
                            ({**ROUTE, "chunk_hashes": ["zz"]}, "chunk_hashes"),
                            ({k: v for k, v in ROUTE.items() if k != "turns"}, "turns"),
                            ({**ROUTE, "pod": "x"}, "pod")):
            r = kv.put("/v1/sessions/s/route", json=body)
            assert r.status_code == 400 and param in r.json()["error"]["param"], r.text
