"""Failpoints: armed for a number of hits through the memory API's route, which a pod serves
only when started with AGENTSERVING_FAILPOINTS=1; a hit past them, or at another name, passes."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from agentserving.engine import failpoints


@pytest.fixture
def client():
    app = FastAPI()
    app.include_router(failpoints.router())
    with TestClient(app) as c:
        yield c
    failpoints.arm("layer_copy", 0)


def test_an_armed_failpoint_fails_its_next_hits_then_passes(client):
    r = client.post("/memory/failpoints", json={"name": "layer_copy", "times": 2})
    assert r.status_code == 200 and r.json() == {"armed": {"layer_copy": 2}}
    failpoints.hit("other")  # not armed: passes
    for left in (1, 0):
        with pytest.raises(failpoints.InjectedFault, match="layer_copy"):
            failpoints.hit("layer_copy")
        assert client.get("/memory/failpoints").json()["armed"] == (
            {"layer_copy": left} if left else {})
    failpoints.hit("layer_copy")  # used up
    client.post("/memory/failpoints", json={"name": "layer_copy", "times": 5})
    assert client.post("/memory/failpoints", json={"name": "layer_copy", "times": 0}).json() == {
        "armed": {}}
    failpoints.hit("layer_copy")  # disarmed


def test_bad_input_names_the_field(client):
    for body, field in (({"name": "nowhere"}, "name"), ({"name": "layer_copy", "times": -1},
                                                        "times")):
        r = client.post("/memory/failpoints", json=body)
        assert r.status_code in (400, 422) and field in r.text


def test_only_a_pod_started_with_the_variable_serves_them():
    assert failpoints.enabled({failpoints.ENV: "1"})
    assert not failpoints.enabled({}) and not failpoints.enabled({failpoints.ENV: "0"})
