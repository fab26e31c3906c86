"""Which pods the proxy asks for /tokenize and its siblings, and in what order."""

from __future__ import annotations

from agentserving.core.schemas import PodRole
from agentserving.proxy.engine_routes import pods_to_ask
from agentserving.proxy.pods import PodState


def pod(name: str, model: str | None = "m", inflight: int = 0, failed_until: float = 0.0
        ) -> PodState:
    return PodState(name, f"http://{name}", PodRole.BOTH, model, inflight, failed_until)


def test_pods_of_the_model_not_failed_and_least_busy_first():
    pods = [pod("busy", inflight=3), pod("failed", failed_until=20.0), pod("idle"),
            pod("other", model="n"), pod("unknown", model=None, inflight=1)]
    order = [p.name for p in pods_to_ask(pods, "m", now=10.0)]
    assert order == ["idle", "unknown", "busy", "failed"]
    assert [p.name for p in pods_to_ask(pods, None, now=30.0)] == [
        "failed", "idle", "other", "unknown", "busy"]
    assert pods_to_ask(pods[3:4], "m", now=0.0) == []
