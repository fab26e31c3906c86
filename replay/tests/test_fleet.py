"""The local fleet's supervisor: ordered start, health, clean shutdown with no orphans."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from agentserving.replay.fleet.process import FleetError, ProcessSpec
from agentserving.replay.fleet.supervisor import Fleet
from agentserving.replay.fleet.topology import FleetSpec, PortAllocator, build
from agentserving.replay.testing import pid_alive
from testkit.servers import AGENTSERVING, free_port


def parsed(spec: ProcessSpec) -> dict:
    """The parameters the process's own command parses from its rendered command line."""
    from agentserving.core.cli import SUBCOMMANDS, main

    sub = next(i for i, a in enumerate(spec.argv) if a in SUBCOMMANDS)
    command = main.get_command(None, spec.argv[sub])  # type: ignore[arg-type]
    return command.make_context(spec.argv[sub], list(spec.argv[sub + 1:])).params



def wait_gone(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if pid_alive(p)]
        if not alive:
            return []
        time.sleep(0.05)
    return [p for p in pids if pid_alive(p)]


# A server that spawns a grandchild (as a worker spawns engine processes) and ignores SIGTERM
# when asked to (so only SIGKILL ends it).
SERVER = textwrap.dedent("""
    import http.server, os, signal, subprocess, sys
    port, pidfile, stubborn = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(pidfile, "w").write(f"{os.getpid()} {child.pid}")
    if stubborn:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            code = 200 if self.path == "/healthz" else 404
            self.send_response(code); self.end_headers(); self.wfile.write(b"ok")
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
""")


def server_spec(tmp_path: Path, name: str, role: str = "worker", stubborn: bool = False,
                port: int | None = None) -> ProcessSpec:
    port = port or free_port()
    return ProcessSpec(name=name, role=role, url=f"http://127.0.0.1:{port}",
                       argv=[sys.executable, "-c", SERVER, str(port),
                             str(tmp_path / f"{name}.pids"), "1" if stubborn else "0"],
                       startup_timeout_s=20)


def read_pids(tmp_path: Path, name: str) -> list[int]:
    return [int(x) for x in (tmp_path / f"{name}.pids").read_text().split()]


def test_fleet_starts_in_order_and_stops_every_process_group(tmp_path):
    events: list[str] = []
    specs = [server_spec(tmp_path, "proxy", role="proxy"),
             server_spec(tmp_path, "kv", role="kvindex"),
             server_spec(tmp_path, "w0"), server_spec(tmp_path, "w1", stubborn=True)]
    with Fleet(specs, tmp_path / "run", on_event=events.append, stop_grace_s=1.0) as fleet:
        started = [e.split()[1] for e in events if e.startswith("started")]
        assert started == ["kv", "w0", "w1", "proxy"]  # kvindex, workers, then the proxy
        # every process answered /healthz (after /readyz said 404) before the next wave
        ready = [e.split()[0] for e in events if " ready at " in e]
        assert ready.index("kv") < ready.index("w0") and ready[-1] == "proxy"
        described = json.loads((tmp_path / "run" / "fleet.json").read_text())
        assert described["proxy"] == specs[0].url and len(described["processes"]) == 4
        pids = [p for n in ("proxy", "kv", "w0", "w1") for p in read_pids(tmp_path, n)]
        assert all(pid_alive(p) for p in pids)
        for n in ("proxy", "kv", "w0", "w1"):
            leader = read_pids(tmp_path, n)[0]
            assert os.getpgid(leader) == leader  # its own process group
        assert httpx.get(specs[2].url + "/healthz").status_code == 200
        started_stop = time.monotonic()
    assert wait_gone(pids) == []  # leaders and grandchildren, the stubborn one too
    assert time.monotonic() - started_stop < 5
    assert (tmp_path / "run" / "logs" / "w0.log").exists()
    fleet.stop()  # idempotent


def test_a_running_fleet_swaps_one_process_for_another(tmp_path):
    """``agentserving compare`` serves configurations that differ in their proxy alone from one
    fleet: the old proxy's whole group is gone, the new one is healthy, the workers untouched."""
    specs = [server_spec(tmp_path, "kv", role="kvindex"), server_spec(tmp_path, "w0"),
             server_spec(tmp_path, "proxy", role="proxy")]
    with Fleet(specs, tmp_path / "run", stop_grace_s=1.0) as fleet:
        old, worker = read_pids(tmp_path, "proxy"), read_pids(tmp_path, "w0")
        new = server_spec(tmp_path, "proxy2", role="proxy")
        fleet.replace(new, log_dir=tmp_path / "logs2")
        assert wait_gone(old) == [] and all(pid_alive(p) for p in worker)
        assert fleet.url("proxy") == new.url and httpx.get(new.url + "/healthz").is_success
        assert [mp.spec.name for mp in fleet.procs] == ["kv", "w0", "proxy2"]
        assert (tmp_path / "logs2" / "proxy2.log").exists()
        assert json.loads((tmp_path / "run" / "fleet.json").read_text())["proxy"] == new.url
        pids = [*read_pids(tmp_path, "proxy2"), *worker]
    assert wait_gone(pids) == []


def test_stubborn_process_is_killed_after_the_grace_period(tmp_path):
    fleet = Fleet([server_spec(tmp_path, "w", stubborn=True)], tmp_path).start()
    leader, child = read_pids(tmp_path, "w")
    t = time.monotonic()
    fleet.stop(grace_s=0.5)
    assert 0.4 < time.monotonic() - t < 8
    assert wait_gone([leader, child], 2) == []


def test_a_process_that_dies_while_starting_fails_the_start_and_stops_the_rest(tmp_path):
    good = server_spec(tmp_path, "kv", role="kvindex")
    bad = ProcessSpec(name="w", role="worker", url=f"http://127.0.0.1:{free_port()}",
                      argv=[sys.executable, "-c", "import sys; print('no model'); sys.exit(3)"])
    with pytest.raises(FleetError, match=r"w exited with 3 while starting(.|\n)*no model"):
        Fleet([good, bad], tmp_path).start()
    assert wait_gone(read_pids(tmp_path, "kv")) == []


def test_a_process_that_never_gets_healthy_times_out(tmp_path):
    spec = ProcessSpec(name="w", role="worker", url=f"http://127.0.0.1:{free_port()}",
                       argv=[sys.executable, "-c", "import time; time.sleep(60)"],
                       startup_timeout_s=1.0)
    t = time.monotonic()
    with pytest.raises(FleetError, match="not healthy after 1s"):
        Fleet([spec], tmp_path).start()
    assert time.monotonic() - t < 10


def test_topologies():
    ports = PortAllocator(seed=1)
    pd = build(FleetSpec(prefill=1, decode=2, kvindex="redis://127.0.0.1:1/0",
                         disk_cache_gib=2), Path("/tmp/r"), ports)
    assert [(p.name, p.role) for p in pd] == [("kvindex", "kvindex"), ("prefill-0", "prefill"),
                                              ("decode-0", "decode"), ("decode-1", "decode"),
                                              ("proxy", "proxy")]
    assert parsed(pd[0])["store"] == "redis://127.0.0.1:1/0"
    w = parsed(pd[1])
    assert w["kvindex_url"] == pd[0].url and w["role"] == "prefill"
    assert str(w["disk_cache_dir"]) == "/tmp/r/disk/prefill-0" and w["disk_cache_gib"] == 2
    assert w["chunk_size"] == 256 and w["hash_scheme"] == "blake3"
    proxy = parsed(pd[-1])
    assert proxy["routing"] == "kv-aware"
    assert list(proxy["decode_urls"]) == [pd[2].url, pd[3].url]
    assert list(proxy["prefill_urls"]) == [pd[1].url]
    urls = [p.url for p in pd]
    assert len(set(urls)) == len(urls)
    mem = [int(p.argv[p.argv.index("--memory-port-start") + 1]) for p in pd[1:4]]
    assert all(abs(a - b) >= 4 for i, a in enumerate(mem) for b in mem[i + 1:])

    base = build(FleetSpec(prefill=0, decode=0, both=2, routing="round-robin",
                           cpu_cache_gib=0.001), Path("/tmp/r"), ports)
    assert [p.role for p in base] == ["kvindex", "both", "both", "proxy"]
    assert "--disk-cache-dir" not in base[1].argv
    assert parsed(base[1])["cpu_cache_gib"] == 0.001
    assert len(parsed(base[-1])["prefill_urls"]) == 2 and not parsed(base[-1])["decode_urls"]
    # no decode pool: the prefill workers do both
    solo = build(FleetSpec(prefill=1, decode=0), Path("/tmp/r"), ports)
    assert solo[1].role == "both" and solo[1].name == "prefill-0"
    only_index = build(FleetSpec(prefill=0, decode=0), Path("/tmp/r"), ports)
    assert [p.role for p in only_index] == ["kvindex"]


def _flag(spec: ProcessSpec, flag: str) -> str:
    return spec.argv[spec.argv.index(flag) + 1]


def test_vllm_pd_hands_kv_point_to_point_or_through_one_bounded_server():
    ports = PortAllocator(seed=2)
    p2p = {p.name: p for p in build(FleetSpec(engine="vllm", prefill=1, decode=1,
                                              kv_transfer_gib=0.5), Path("/tmp/r"), ports)}
    # each vLLM pod has its own KV server, started before it; no central one
    assert {n for n, p in p2p.items() if p.role == "kvserver"} == {"kvserver-prefill-0",
                                                                    "kvserver-decode-0"}
    names = list(p2p)
    for pod in ("prefill-0", "decode-0"):
        server, worker = p2p[f"kvserver-{pod}"], parsed(p2p[pod])
        assert names.index(f"kvserver-{pod}") < names.index(pod)
        assert server.argv[server.argv.index("kvserver") - 1] != "-m"
        assert _flag(server, "--max-gib") == "0.5"
        assert worker["kv_transfer_url"] == f"lm://127.0.0.1:{_flag(server, '--port')}"
        assert worker["kv_server_api"] == server.url
        assert server.url == f"http://127.0.0.1:{_flag(server, '--api-port')}"
        assert worker["kv_transfer_p2p"] is True
    central = build(FleetSpec(engine="vllm", prefill=1, decode=2, kv_transfer="server"),
                    Path("/tmp/r"), ports)
    servers = [p for p in central if p.role == "kvserver"]
    assert [p.name for p in servers] == ["kvserver"]
    for worker in (parsed(p) for p in central if p.role in ("prefill", "decode")):
        assert worker["kv_server_api"] == servers[0].url
        assert not worker.get("kv_transfer_p2p")
    # no P/D, or the reference engine's own pull: no KV server at all
    for spec in (FleetSpec(engine="vllm", prefill=0, decode=0, both=2),
                 FleetSpec(prefill=1, decode=1)):
        assert not any(p.role == "kvserver" for p in build(spec, Path("/tmp/r"), ports))


# --------------------------------------------------------------------- agentserving up


def _up(tmp_path: Path) -> tuple[subprocess.Popen, dict]:
    run_dir = tmp_path / "up"
    proc = subprocess.Popen([AGENTSERVING, "up", "--prefill", "0", "--decode", "0",
                             "--run-dir", str(run_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 30
    while not (run_dir / "fleet.json").exists():
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "agentserving up did not get ready"
        time.sleep(0.1)
    return proc, json.loads((run_dir / "fleet.json").read_text())


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_up_stops_everything_on_ctrl_c_or_sigterm(tmp_path, sig):
    proc, fleet = _up(tmp_path)
    try:
        kv = fleet["processes"][0]
        assert kv["name"] == "kvindex"
        assert httpx.get(fleet["kvindex"] + "/readyz").status_code == 200
        assert Path(kv["log"]).parent == tmp_path / "up" / "logs"
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        assert f"{signal.Signals(sig).name}: stopping" in out and "stopped 1 processes" in out
        assert wait_gone([kv["pid"]]) == []
        with pytest.raises(httpx.HTTPError):
            httpx.get(fleet["kvindex"] + "/readyz", timeout=1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_up_children_die_with_a_killed_supervisor(tmp_path):
    proc, fleet = _up(tmp_path)
    kv_pid = fleet["processes"][0]["pid"]
    try:
        proc.kill()  # SIGKILL: no handler runs; the kernel's parent-death signal does
        proc.wait()
        assert wait_gone([kv_pid]) == []
    finally:
        if pid_alive(kv_pid):
            os.killpg(kv_pid, signal.SIGKILL)


def test_up_exits_when_a_process_dies(tmp_path):
    proc, fleet = _up(tmp_path)
    try:
        os.killpg(fleet["processes"][0]["pid"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 1 and "kvindex exited with" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
def test_up_with_a_redis_kvindex(tmp_path):
    from testkit.servers import redis_server

    with redis_server() as redis:
        run_dir = tmp_path / "up"
        proc = subprocess.Popen([AGENTSERVING, "up", "--prefill", "0", "--decode", "0",
                                 "--kvindex", redis.url, "--run-dir", str(run_dir)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 30
            while not (run_dir / "fleet.json").exists():
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
            fleet = json.loads((run_dir / "fleet.json").read_text())
            assert fleet["processes"][0]["argv"][-2:] == ["--store", redis.url]
            kv = fleet["kvindex"]
            assert httpx.post(kv + "/v1/pods", json={
                "pod": "w0", "memory_api_url": "http://127.0.0.1:1", "model": "tiny"}
            ).status_code == 200
            assert redis.proc.poll() is None
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0
            assert wait_gone([fleet["processes"][0]["pid"]]) == []
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_kv_events_give_every_worker_a_stream_the_kvindex_reads_and_a_registrar(tmp_path):
    spec = FleetSpec(engine="vllm", prefill=0, decode=0, both=2, kv_events=True,
                     chunk_size=128)
    procs = {p.name: p for p in build(spec, tmp_path)}
    streams = dict(e.split("=", 1) for e in parsed(procs["kvindex"])["vllm_events"])
    assert sorted(streams) == ["worker-0", "worker-1"]
    assert len(set(streams.values())) == 2 and all(ep.startswith("ipc://")
                                                   for ep in streams.values())
    for name, endpoint in streams.items():
        assert parsed(procs[name])["kv_events_endpoint"] == endpoint
        reg = procs[f"{name}-registrar"].argv
        flags = dict(zip(reg[3::2], reg[4::2], strict=False))
        assert reg[1:3] == ["-m", "agentserving.engine.vllm.registrar"]
        assert flags["--pod"] == name and flags["--api-url"] == procs[name].url
        assert flags["--hash-scheme"] == "vllm-sha256" and flags["--chunk-size"] == "128"
    deep = tmp_path.joinpath(*["d" * 20] * 5)  # too long for a socket path: the temp dir
    sockets = [a for p in build(spec, deep) for a in p.argv if a.startswith("ipc://")]
    assert sockets and all(len(a) - len("ipc://") <= 100 for a in sockets)
    assert len(set(sockets)) == 2  # one per worker
    plain = build(FleetSpec(engine="vllm", prefill=0, decode=0, both=2), tmp_path)
    assert not any(p.role == "registrar" or any(a.startswith("--vllm-events") for a in p.argv)
                   for p in plain)


def test_fleet_ports_lie_below_the_ephemeral_range():
    from agentserving.core.ports import ephemeral_range

    low, _ = ephemeral_range()
    alloc = PortAllocator(seed=3)
    ports = [alloc.one() for _ in range(50)] + [alloc.run(4) + 3 for _ in range(10)]
    assert all(10000 <= p < low for p in ports)  # a client socket never takes them
    assert len(set(ports)) == len(ports)


def test_a_parents_prometheus_multiprocess_dir_does_not_reach_the_fleet():
    """Inherited, it merged unrelated processes' metrics into every vLLM pod's /metrics."""
    from agentserving.replay.fleet.process import child_env

    parent = {"PATH": "/bin", "PROMETHEUS_MULTIPROC_DIR": "/tmp/x", "KEEP": "1"}
    assert child_env(parent, {"OWN": "2"}) == {"PATH": "/bin", "KEEP": "1", "OWN": "2"}
    wanted = child_env(parent, {"PROMETHEUS_MULTIPROC_DIR": "/tmp/mine"})
    assert wanted["PROMETHEUS_MULTIPROC_DIR"] == "/tmp/mine"  # a spec may still ask for one


def _flags(spec, role: str, run_dir: Path) -> list[str]:
    """A fleet process's command line, its ports, URLs and paths aside."""
    from agentserving.replay.fleet.topology import build

    proc = next(p for p in build(spec, run_dir) if p.role == role)
    return [a for a in proc.argv if "://" not in a and not a.startswith("/")
            and not (a.isdigit() and int(a) > 1024)]


def test_up_starts_the_configuration_the_main_job_measures(tmp_path):
    """`agentserving up` and `agentserving compare`'s agentserving: the same worker flags,
    prefill scheduling and proxy settings (one place: replay/configs.py), at up's sizes."""
    from agentserving.replay.configs import CONFIGS, FleetSizes, engine_proxy_args, fleet_spec
    from agentserving.replay.fleet.cli import up_spec

    for engine in ("vllm", "reference"):
        sizes = dict(prefill=1, decode=2, engine=engine, model="tiny", cpu_cache_gib=2.0,
                     disk_cache_gib=4.0, disk_io="direct", worker_args=["--torch-threads=1"],
                     startup_timeout_s=180.0)
        up = up_spec(**sizes, kvindex="redis://127.0.0.1:1/0", proxy_port=8080)
        main_job = fleet_spec(CONFIGS["agentserving"], FleetSizes(**sizes))
        assert (up.worker_args, up.role_args, up.proxy_args) == \
            (main_job.worker_args, main_job.role_args, main_job.proxy_args)
        assert up.kvindex == "redis://127.0.0.1:1/0" and up.proxy_port == 8080
        for role in ("prefill", "decode", "proxy"):
            assert _flags(up, role, tmp_path) == _flags(main_job, role, tmp_path), role
    vllm = up_spec(**{**sizes, "engine": "vllm"})
    proxy = _flags(vllm, "proxy", tmp_path)
    assert engine_proxy_args("vllm") == ["--admit-per-pod", "1", "--max-prefill-backlog", "1"]
    assert proxy[-4:] == engine_proxy_args("vllm")
    prefill = _flags(vllm, "prefill", tmp_path)
    assert prefill[prefill.index("--scheduler-policy") + 1].startswith("longcap-dynamic")
    # `up --config llmd`: the rival compare measures, its pods both prefilling and decoding
    llmd = up_spec(**{**sizes, "engine": "vllm"}, config="llmd")
    assert llmd == fleet_spec(CONFIGS["llmd"], FleetSizes(**{**sizes, "engine": "vllm"}))
    assert (llmd.both, llmd.routing) == (3, "llm-d")
    assert "--no-tool-pin" in _flags(llmd, "proxy", tmp_path)


def test_up_refuses_llmd_on_the_reference_engine(tmp_path):
    res = subprocess.run([AGENTSERVING, "up", "--config", "llmd", "--run-dir",
                          str(tmp_path / "up")], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "llmd runs on --engine vllm" in res.stderr


def test_up_refuses_decode_workers_without_a_prefill_worker(tmp_path):
    res = subprocess.run([AGENTSERVING, "up", "--prefill", "0", "--decode", "3", "--run-dir",
                          str(tmp_path / "up")], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert "--prefill / --decode" in res.stderr and "no prefill pod" in res.stderr
    assert "--prefill 3 --decode 0" in res.stderr
    assert not (tmp_path / "up" / "fleet.json").exists()
