"""The wire models and the shared HTTP layer say in their OpenAPI what they check, and check
what they say: each case here is a failure the API fuzzer (tests/fuzz) found, pinned so that
it does not depend on the fuzzer drawing it again."""

from __future__ import annotations

import re

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel, TypeAdapter, ValidationError

from agentserving.core.hashing import is_chunk_hash
from agentserving.core.schemas import (
    CHUNK_HASH_PATTERN,
    EVICT_LOCATIONS,
    ChunkHash,
    EventBatch,
    EvictRequest,
    HttpUrlStr,
    PodName,
    PodRegistration,
    ResidencyEvent,
)
from agentserving.core.service import error_responses, install_error_handlers


def test_a_pod_name_with_a_trailing_newline_is_refused():
    # re.match with "$" lets "pod\n" through; the schema's pattern (ECMA) does not
    with pytest.raises(ValidationError):
        TypeAdapter(PodName).validate_python("pod-1\n")
    assert TypeAdapter(PodName).validate_python("pod-1") == "pod-1"


@pytest.mark.parametrize("value", ["ab", "-6ed9a448787a198f", "0" * 64])
def test_the_chunk_hash_pattern_accepts_what_the_validator_accepts(value):
    assert is_chunk_hash(value) and re.fullmatch(CHUNK_HASH_PATTERN.strip("^$"), value)
    assert TypeAdapter(ChunkHash).validate_python(value) == value


@pytest.mark.parametrize("value", ["", "AB", "ab\n", "-", "0" * 65, "xyz"])
def test_the_chunk_hash_pattern_refuses_what_the_validator_refuses(value):
    assert not is_chunk_hash(value)
    assert not re.fullmatch(CHUNK_HASH_PATTERN.strip("^$"), value)


def test_schemas_declare_their_patterns():
    schema = TypeAdapter(list[ChunkHash]).json_schema()
    assert schema["items"]["pattern"] == CHUNK_HASH_PATTERN
    assert "pattern" in TypeAdapter(PodName).json_schema()
    assert "pattern" in TypeAdapter(HttpUrlStr).json_schema()
    locations = EvictRequest.model_json_schema()["properties"]["locations"]
    assert locations["anyOf"][0]["items"]["enum"] == EVICT_LOCATIONS


def test_a_url_whose_host_starts_with_a_unicode_space_is_what_the_schema_says():
    # Python's \s includes U+0085 where the schema's regex does not: no \s in the pattern
    pattern = TypeAdapter(HttpUrlStr).json_schema()["pattern"]
    assert "\\s" not in pattern
    assert TypeAdapter(HttpUrlStr).validate_python("https://\x85host") == "https://\x85host"
    for bad in ("http://", "http:// host", "ftp://host"):
        with pytest.raises(ValidationError):
            TypeAdapter(HttpUrlStr).validate_python(bad)


@pytest.mark.parametrize("seq", ["5", True])
def test_an_integer_field_refuses_strings_and_booleans(seq):
    with pytest.raises(ValidationError, match="seq"):
        EventBatch.model_validate({"pod": "p", "seq": seq, "events": []})


def test_an_integer_field_takes_a_json_integer_written_with_a_fraction_of_zero():
    # JSON Schema's "integer" includes 5.0; so must the server
    assert EventBatch.model_validate({"pod": "p", "seq": 5.0, "events": []}).seq == 5
    reg = PodRegistration.model_validate({"pod": "p", "memory_api_url": "http://h",
                                          "model": "m", "capacity_bytes": {"cpu": 10.0}})
    assert reg.capacity_bytes == {"cpu": 10}


@pytest.mark.parametrize("force", [0, 1, "true"])
def test_a_boolean_field_refuses_numbers_and_strings(force):
    with pytest.raises(ValidationError, match="force"):
        EvictRequest.model_validate({"chunk_hashes": ["ab"], "force": force})


def test_bounds_inside_mappings_and_unions_reach_the_schema():
    props = PodRegistration.model_json_schema()["properties"]
    assert props["capacity_bytes"]["additionalProperties"]["minimum"] == 0
    nbytes = ResidencyEvent.model_json_schema()["properties"]["bytes"]
    assert nbytes["anyOf"][0]["minimum"] == 0


def test_the_event_schema_requires_a_tier_unless_cleared():
    schema = ResidencyEvent.model_json_schema()
    assert schema["then"]["required"] == ["tier"]
    assert set(schema["if"]["properties"]["op"]["enum"]) == {"stored", "removed"}
    with pytest.raises(ValidationError, match="tier"):
        ResidencyEvent.model_validate({"op": "stored", "tier": None})
    assert ResidencyEvent.model_validate({"op": "cleared"}).tier is None


class _Body(BaseModel):
    n: int


def _app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/things/{name}", responses=error_responses(404))
    def get_thing(name: str) -> dict:
        return {"name": name}

    @app.delete("/things/{name}", status_code=204)
    def delete_thing(name: str) -> None:
        return None

    @app.post("/things")
    def post_thing(body: _Body) -> dict:
        return {"n": body.n}

    return app


def test_validation_errors_are_documented_as_the_400_they_are():
    app = _app()
    schema = TestClient(app).get("/openapi.json").json()
    post = schema["paths"]["/things"]["post"]["responses"]
    assert "422" not in post and "400" in post
    ref = post["400"]["content"]["application/json"]["schema"]["$ref"]
    assert ref == "#/components/schemas/ErrorResponse"
    components = schema["components"]["schemas"]
    assert "ErrorResponse" in components and "ErrorDetail" in components
    assert "HTTPValidationError" not in components
    get = schema["paths"]["/things/{name}"]["get"]["responses"]
    assert get["404"]["content"]["application/json"]["schema"]["$ref"] == ref
    r = TestClient(app).post("/things", json={"n": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_a_body_that_is_not_utf8_is_a_400_naming_the_body():
    # FastAPI raises its own HTTPException(400) for it, which had no param
    r = TestClient(_app()).post("/things", content=b"\x9e\xff",
                                headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "body" and "body" in r.json()["error"]["message"]


def test_a_405_names_every_method_of_the_path():
    # Starlette's names only the first route's; and the error handler used to drop it
    r = TestClient(_app()).put("/things/a")
    assert r.status_code == 405
    assert set(r.headers["allow"].split(", ")) == {"GET", "DELETE"}
    assert r.json()["error"]["type"] == "invalid_request_error"
