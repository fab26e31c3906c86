"""``agentserving kvserver`` as a real process: its flags, its environment variables, both
ports answering, and a shutdown that does not hang on an open LMCache connection."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import httpx
import torch
from click.testing import CliRunner
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.protocol import (
    ClientCommand,
    ClientMetaMessage,
    ServerMetaMessage,
    ServerReturnCode,
)

from agentserving.core.cli import main
from testkit.kvserver import LmClient, raw_connection, recv_exactly
from testkit.servers import AGENTSERVING, free_port, service_process

FLAGS = ("--host", "--port", "--api-port", "--max-gib", "--pull-timeout", "--max-batch-chunks",
         "--internal-token", "--log-level", "--log-json")


def test_help_lists_every_flag_with_its_environment_variable():
    result = CliRunner().invoke(main, ["kvserver", "--help"])
    assert result.exit_code == 0, result.output
    for flag in FLAGS:
        assert flag in result.output
    for env in ("AGENTSERVING_KVSERVER_HOST", "AGENTSERVING_KVSERVER_PORT",
                "AGENTSERVING_KVSERVER_API_PORT", "AGENTSERVING_KVSERVER_MAX_GIB",
                "AGENTSERVING_KVSERVER_LOG_LEVEL"):
        assert env in re.sub(r"\s+", "", result.output)


def test_max_gib_must_be_positive():
    result = CliRunner().invoke(main, ["kvserver", "--max-gib", "0"])
    assert result.exit_code == 2 and "--max-gib" in result.output


def test_a_kvserver_process_answers_health_on_both_ports_and_stops_promptly(tmp_path):
    lm_port, api_port = free_port(), free_port()
    env = {"AGENTSERVING_KVSERVER_MAX_GIB": "0.25", "AGENTSERVING_KVSERVER_PORT": str(lm_port)}
    args = [AGENTSERVING, "kvserver", "--api-port", str(api_port), "--log-level", "info"]
    url = f"http://127.0.0.1:{api_port}"
    with service_process(args, f"{url}/healthz", env=env,
                         log_path=tmp_path / "kvserver.log") as proc:
        assert httpx.get(f"{url}/healthz").json() == {"status": "ok"}
        metrics = httpx.get(f"{url}/metrics").text
        assert re.search(r"^agentserving_kvserver_capacity_bytes 2\.68435456e\+08$", metrics, re.M)
        sock = raw_connection(lm_port)  # left open across the shutdown
        sock.sendall(ClientMetaMessage(ClientCommand.HEALTH, LmClient.key(1), 0,
                                       MemoryFormat(1), torch.float16,
                                       torch.Size([0, 0, 0, 0])).serialize())
        meta = ServerMetaMessage.deserialize(recv_exactly(sock, ServerMetaMessage.packlength()))
        assert meta.code == ServerReturnCode.SUCCESS
        started = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(15)
        stopped_s = time.monotonic() - started
        sock.close()
    log = (tmp_path / "kvserver.log").read_text()
    # uvicorn exits by the signal it shut down on, once shut down
    assert proc.returncode in (0, -signal.SIGTERM), log
    assert "Traceback" not in log and "kvserver_started" in log, log
    assert stopped_s < 8, stopped_s
    assert subprocess.run([AGENTSERVING, "kvserver", "--help"], capture_output=True,
                          check=True).returncode == 0
