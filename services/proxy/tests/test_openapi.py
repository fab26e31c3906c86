"""The proxy's OpenAPI documents the bodies it takes (it reads them raw) and what it answers."""

from __future__ import annotations

import re

from agentserving.proxy.app import create_app
from agentserving.proxy.settings import ProxySettings


def test_turn_routes_document_their_bodies_and_answers():
    schema = create_app(ProxySettings()).openapi()
    components = schema["components"]["schemas"]
    for path, model, required in (("/v1/chat/completions", "ChatTurn", "messages"),
                                  ("/v1/completions", "CompletionTurn", "prompt")):
        op = schema["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model}"
        assert required in components[model]["required"]
        assert "agent_memory" in components[model]["properties"]
        assert set(op["responses"]) >= {"200", "400", "401", "404", "502", "503"}
        assert set(op["responses"]["200"]["content"]) == {"application/json",
                                                          "text/event-stream"}
    for ref in re.findall(r"'\$ref': '#/components/schemas/([^']+)'", str(schema)):
        assert ref in components, f"dangling $ref {ref}"
    assert "HTTPValidationError" not in components
