from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from agentserving.core.cli import main


def test_help_explains_every_flag_and_its_env_var():
    result = CliRunner().invoke(main, ["operator", "--help"])
    assert result.exit_code == 0, result.output
    flags = set(re.findall(r"^\s+(--[a-z-]+)", result.output, re.M))
    assert {"--namespace", "--image-registry", "--image-tag", "--kvindex-url-template",
            "--cleanup-timeout", "--metrics-port", "--health-port", "--log-format"} <= flags
    for flag in flags - {"--help"}:
        assert f"AGENTSERVING_OPERATOR_{flag[2:].upper().replace('-', '_')}" in result.output \
            or flag == "--namespace", flag
    assert "AGENTSERVING_OPERATOR_NAMESPACES" in result.output


@pytest.fixture
def captured(monkeypatch):
    """Run the command without a cluster: capture what it would hand to kopf."""
    import kopf
    import prometheus_client

    calls: dict = {}
    monkeypatch.setattr(kopf, "run", lambda **kw: calls.setdefault("run", kw))
    monkeypatch.setattr(kopf, "configure", lambda **kw: calls.setdefault("configure", kw))
    monkeypatch.setattr(prometheus_client, "start_http_server",
                        lambda port, addr: calls.setdefault("metrics", (addr, port)))
    return calls


def test_flags_and_environment_become_settings(captured):
    env = {"AGENTSERVING_OPERATOR_IMAGE_TAG": "1.2.3",
           "AGENTSERVING_OPERATOR_NAMESPACES": "team-a team-b",
           "AGENTSERVING_OPERATOR_CLEANUP_TIMEOUT": "2.5"}
    result = CliRunner().invoke(main, ["operator", "--metrics-port", "9999", "--health-port",
                                       "0", "--image-registry", "reg/x"], env=env)
    assert result.exit_code == 0, result.output
    run = captured["run"]
    settings = run["memo"].settings
    assert settings.image("proxy") == "reg/x/proxy:1.2.3"
    assert settings.namespaces == ("team-a", "team-b")
    assert settings.cleanup_timeout_s == 2.5
    assert run["namespaces"] == ["team-a", "team-b"] and run["clusterwide"] is False
    assert run["standalone"] is True
    assert run["liveness_endpoint"] is None
    assert captured["metrics"] == ("0.0.0.0", 9999)


def test_defaults_are_cluster_wide_with_health_and_metrics(captured):
    result = CliRunner().invoke(main, ["operator"], env={})
    assert result.exit_code == 0, result.output
    run = captured["run"]
    assert run["clusterwide"] is True and run["namespaces"] == []
    assert run["liveness_endpoint"] == "http://0.0.0.0:8081/healthz"
    assert captured["metrics"] == ("0.0.0.0", 9090)
    handler_ids = {h.id for h in run["registry"]._spawning.get_all_handlers()} | {
        h.id for h in run["registry"]._changing.get_all_handlers()} | {
        h.id for h in run["registry"]._watching.get_all_handlers()}
    assert {"apply-children", "forget-in-kvindex", "resync", "status-from-statefulsets",
            "status-from-deployments"} <= handler_ids


def test_invalid_flag_values_are_refused(captured):
    result = CliRunner().invoke(main, ["operator", "--log-format", "xml"])
    assert result.exit_code != 0
    assert "run" not in captured
