"""The fault bench's hands: kill, stop, restart, fill a disk, corrupt a file. Thin on purpose;
what to inject and what the result means is decided in ``bench.fault_plan``.

Each action is what the real thing does to a pod, on the real processes of a local fleet
(``replay.fleet``): ``kill -9`` of a process *group* (a pod is its API process and its engine
processes, and a kubelet restarts the pod whole), ``SIGSTOP``/``SIGCONT`` (a pod stalled on
a page fault storm or a stuck GPU), a real filesystem that runs out of space (a tmpfs mounted
under the KV disk tier: the kernel answers ENOSPC), and flipped bytes in LMCache's own chunk
files.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from agentserving.core.ports import bindable
from agentserving.replay.fleet.process import ManagedProcess, ProcessSpec
from agentserving.replay.fleet.topology import PortAllocator

# ------------------------------------------------------------------------------- ports


class RangePorts(PortAllocator):
    """Ports from one fixed range only (a shared machine: other benches own the rest), from a
    rotating start, so a fleet just stopped leaves its ports' TIME_WAIT sockets behind it."""

    def __init__(self, low: int, high: int, start: int = 0) -> None:
        super().__init__()
        self.low, self.high, self.next = low, high, low + start % max(1, high - low)

    def run(self, n: int) -> int:
        span = self.high - self.low
        for step in range(span):
            base = self.low + (self.next - self.low + step) % span
            ports = range(base, base + n)
            if base + n > self.high or any(p in self._taken for p in ports) \
                    or not all(bindable(p) for p in ports):
                continue
            self._taken.update(ports)
            self.next = base + n
            return base
        raise RuntimeError(f"no run of {n} free ports in {self.low}-{self.high - 1}")


# ------------------------------------------------------------------------------- redis


class PersistentRedis:
    """redis-server with its append-only file on (fsync every second, Redis's default), in
    its own folder on a fixed port, so a ``kill -9`` and a restart find the data again. Run as
    a fleet process (``ManagedProcess``): its own process group, and SIGTERMed by the kernel
    if the bench dies, so not even a killed bench leaves it behind."""

    def __init__(self, ports: range) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not found: run `make setup`")
        self.binary = binary
        self.port = next((p for p in ports if bindable(p)), None)
        if self.port is None:
            raise RuntimeError(f"no free port for redis in {ports.start}-{ports.stop - 1}")
        self.dir = tempfile.mkdtemp(prefix="faults-redis-")
        self.mp = ManagedProcess(ProcessSpec(
            name="redis", role="redis",
            argv=[binary, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", self.dir,
                  "--appendonly", "yes", "--appendfsync", "everysec", "--save", ""]),
            Path(self.dir))
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.mp.finish()
        self.mp.start()
        deadline = time.monotonic() + 10
        import redis

        while True:
            try:
                redis.Redis(port=self.port, socket_timeout=0.5).ping()
                return
            except (redis.ConnectionError, redis.BusyLoadingError):
                if time.monotonic() > deadline or not self.mp.alive():
                    raise RuntimeError(f"redis-server did not start:\n{self.mp.log_tail()}"
                                       ) from None
                time.sleep(0.05)

    def kill(self) -> None:
        kill9(self.mp)

    def stop(self) -> None:
        self.mp.stop(grace_s=10)
        shutil.rmtree(self.dir, ignore_errors=True)


# ------------------------------------------------------------------------------- processes


def kill9(mp: ManagedProcess) -> None:
    """``kill -9`` of the whole pod (its process group), and reap it."""
    mp.signal_group(signal.SIGKILL)
    if mp.proc is not None:
        mp.proc.wait(10)


def pause(mp: ManagedProcess) -> None:
    mp.signal_group(signal.SIGSTOP)


def resume(mp: ManagedProcess) -> None:
    mp.signal_group(signal.SIGCONT)


def restart(mp: ManagedProcess, timeout_s: float = 120.0) -> float:
    """Start a killed process again with the same command line (its ports, its disk folder,
    as a kubelet restarts a pod); returns when it is healthy, with the seconds it took."""
    t0 = time.monotonic()
    mp.finish()  # what is left of the group, and the log handle
    mp.start()
    with httpx.Client() as client:
        while not mp.check_health(client):
            if not mp.alive():
                raise RuntimeError(f"{mp.spec.name} exited on restart:\n{mp.log_tail()}")
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"{mp.spec.name} not healthy {timeout_s:.0f} s after a "
                                   f"restart:\n{mp.log_tail()}")
            time.sleep(0.1)
    return time.monotonic() - t0


# ------------------------------------------------------------------------------- disk

FILLER = "faults-filler.bin"


def mount_tmpfs(path: Path, size_mib: int) -> bool:
    """A real, small filesystem at ``path`` (root only); False when it cannot be mounted."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs",
                           str(path)], capture_output=True)
    return proc.returncode == 0


def unmount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(path: Path) -> int:
    """Write a filler file until the filesystem under ``path`` answers ENOSPC; its size."""
    written = 0
    block = b"\0" * (1 << 20)
    with open(path / FILLER, "wb", buffering=0) as f:
        try:
            while True:
                written += f.write(block)
        except OSError as exc:
            if exc.errno != 28:  # ENOSPC
                raise
    return written


def free(path: Path) -> None:
    (path / FILLER).unlink(missing_ok=True)


def corrupt_files(root: Path, skip: str = FILLER) -> int:
    """Flip 4 KiB of bytes in the middle of every file under ``root`` (LMCache's chunk files:
    the bytes are KV values, so the size stays right and only a checksum can tell)."""
    n = 0
    for path in sorted(root.rglob("*")):
        if not path.is_file() or path.name == skip or path.stat().st_size < 16:
            continue
        size = path.stat().st_size
        start, length = size // 2, min(4096, size - size // 2)
        with open(path, "r+b") as f:
            f.seek(start)
            data = f.read(length)
            f.seek(start)
            f.write(bytes(b ^ 0xFF for b in data))
        n += 1
    return n


def disk_chunks(memory_url: str) -> list[str]:
    """The chunk hashes a pod's memory API lists in its disk tier."""
    chunks = httpx.get(memory_url + "/memory/chunks", timeout=10).json()["chunks"]
    return list(chunks.get("disk", []))


def evict_dram(memory_url: str, hashes: list[str]) -> int:
    """Drop chunks from a pod's DRAM tier only (the memory API's evict), so the next turn
    that needs them reads the disk."""
    if not hashes:
        return 0
    resp = httpx.post(memory_url + "/memory/evict", timeout=10, json={
        "chunk_hashes": hashes, "locations": ["LocalCPUBackend"]})
    resp.raise_for_status()
    return int(resp.json().get("num_evicted", 0))


def arm_failpoint(memory_url: str, name: str, times: int) -> None:
    """Arm a failpoint (``engine.failpoints``) on a pod's first engine process for its next
    ``times`` hits; 0 disarms it. The pod must have started with ``AGENTSERVING_FAILPOINTS=1``."""
    from agentserving.engine.memory_api import engine_process_url

    resp = httpx.post(engine_process_url(memory_url) + "/memory/failpoints", timeout=10,
                      json={"name": name, "times": times})
    resp.raise_for_status()
