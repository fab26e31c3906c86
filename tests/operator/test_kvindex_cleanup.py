from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from agentserving.operator import kvindex

pool_prefixes = kvindex.pool_prefixes

PODS = ["demo-prefill-0", "demo-decode-0", "demo-decode-1", "demo2-decode-0", "other-prefill-0",
        "demo-proxy-abc"]


def forget_pods(*args, **kwargs):  # type: ignore[no-untyped-def]
    return asyncio.run(kvindex.forget_pods(*args, **kwargs))


def pod_info(pod: str) -> dict:
    """A registered pod as the kvindex lists it (core.schemas.PodInfo)."""
    return {"pod": pod, "memory_api_url": f"http://{pod}:6999", "model": "tiny",
            "registered_at": 0.0, "last_heartbeat": 0.0, "lease_expires_at": 15.0, "seq": 0,
            "needs_resync": False}


def mock_kvindex(pods, deleted, fail=(), gone=()):
    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "GET" and request.url.path == "/v1/pods":
            return httpx.Response(200, json={"pods": [pod_info(p) for p in pods]})
        if request.method == "DELETE" and request.url.path.startswith("/v1/pods/"):
            pod = request.url.path.rsplit("/", 1)[1]
            if pod in fail:
                return httpx.Response(500)
            if pod in gone:
                return httpx.Response(404, json={"error": {"message": f"no pod {pod}"}})
            deleted.append(pod)
            return httpx.Response(200, json={"removed": pod})
        return httpx.Response(404)
    return httpx.MockTransport(handler)


def test_prefixes():
    assert pool_prefixes("demo") == ("demo-prefill-", "demo-decode-")


def test_forgets_only_this_resources_pool_pods():
    deleted: list[str] = []
    result = forget_pods("http://kvindex:8300", pool_prefixes("demo"), 5.0,
                         transport=mock_kvindex(PODS, deleted))
    assert sorted(deleted) == ["demo-decode-0", "demo-decode-1", "demo-prefill-0"]
    assert sorted(result.removed) == sorted(deleted)
    assert result.failed == [] and result.error == ""


def test_failed_deletes_are_reported_not_raised():
    deleted: list[str] = []
    result = forget_pods("http://kvindex:8300", pool_prefixes("demo"), 5.0,
                         transport=mock_kvindex(PODS, deleted, fail={"demo-decode-1"},
                                                gone={"demo-prefill-0"}))
    assert result.failed == ["demo-decode-1"]
    assert "demo-decode-1" not in deleted
    assert sorted(result.removed) == ["demo-decode-0", "demo-prefill-0"]  # 404: gone already


def test_unreachable_kvindex_does_not_raise():
    started = time.monotonic()
    # Port 9 on loopback (discard) is closed here: connection refused, immediately.
    result = forget_pods("http://127.0.0.1:9", pool_prefixes("demo"), 2.0)
    assert result.error
    assert result.removed == []
    assert time.monotonic() - started < 3


def test_garbage_answer_does_not_raise():
    transport = httpx.MockTransport(lambda r: httpx.Response(200, text="not json"))
    result = forget_pods("http://kvindex:8300", pool_prefixes("demo"), 1.0, transport=transport)
    assert result.error and result.removed == []


@pytest.fixture
def hanging_kvindex():
    """A kvindex that accepts the connection and never answers in time."""
    class Slow(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            time.sleep(10)
            body = json.dumps({"pods": []}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_hanging_kvindex_is_bounded(hanging_kvindex):
    started = time.monotonic()
    result = forget_pods(hanging_kvindex, pool_prefixes("demo"), 1.0)
    elapsed = time.monotonic() - started
    assert result.error
    assert elapsed < 2.5
