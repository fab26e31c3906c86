"""Settings rendered as a command line through the command's own options parse back to the
same settings (flag pairs, repeated options, enums, paths, values that look like flags)."""

from __future__ import annotations

from pathlib import Path

import click
import pytest

from agentserving.core.argv import NoSuchFlag, render_argv
from agentserving.engine.cli import command as worker_command
from agentserving.engine.cli import settings_from_params
from agentserving.engine.settings import WorkerSettings


def parse(argv):
    ctx = worker_command.make_context("worker", argv)
    return settings_from_params(dict(ctx.params))


def test_rendered_worker_settings_parse_back_to_the_same_settings():
    values = {"engine": "vllm", "role": "decode", "host": "0.0.0.0", "advertise_host": "10.0.0.1",
              "cpu_cache_gib": 2.5, "disk_cache_dir": Path("/kvcache"), "disk_cache_gib": 3,
              "enforce_eager": True, "kv_layerwise_load": False, "log_json": False,
              "hash_scheme": "lmcache-builtin", "tensor_parallel_size": 2,
              "vllm_args": ["--load-format", "dummy", "-x"], "kv_transfer_url": "lm://s:1"}
    settings = WorkerSettings(**values)
    argv = render_argv(worker_command, settings, values)
    assert "--no-kv-layerwise-load" in argv and "--log-console" in argv
    assert "--vllm-arg=--load-format" in argv and "--cpu-cache-gib" in argv
    assert argv[argv.index("--disk-cache-gib") + 1] == "3"  # 3.0 as the user wrote it
    assert parse(argv) == settings


def test_a_field_without_a_flag_is_refused():
    settings = WorkerSettings()
    with pytest.raises(NoSuchFlag):
        render_argv(worker_command, settings, ["max_body_bytes"])


def test_the_worker_refuses_an_unknown_policy_before_starting():
    with pytest.raises(click.UsageError, match="scheduler-policy"):
        parse(["--scheduler-policy", "longcap-fcfs"])
