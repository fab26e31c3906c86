"""Accelerator profiles: how long a pod's steps take and how much KV it can hold.

A profile is a YAML file in ``sim/profiles/`` (or any path). Step times are linear models:

- prefill step: ``a + b * new_tokens + c * context_tokens`` (the ShadowScheduler's own
  ``StepTimeModel`` form; ``context_tokens`` sums each chunk's start, i.e. the KV it attends to);
- decode step (one token for every running decode): ``a + b * batch + c * context_tokens``
  (``context_tokens`` summed over the batch: the KV the step reads).

Capacities: ``hbm_kv_gib`` (device memory left for KV after weights and activations),
``dram_gib`` and ``ssd_gib`` (the LMCache tiers); bandwidths in GB/s: ``disk_to_dram``,
``dram_to_device``, ``pod_to_pod`` (the P/D hand-off). ``source`` and ``assumptions`` say where
the numbers come from and which are guesses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
GIB = 1 << 30


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Linear3(_Model):
    a_s: float = Field(ge=0)
    b_s: float = Field(ge=0, description="per new token (prefill) / per sequence (decode)")
    c_s: float = Field(ge=0, description="per context token")
    d_s: float = Field(default=0.0, ge=0, description="prefill: per attention (query, key) "
                       "pair, n * (start + (n + 1) / 2) for a chunk of n tokens at start")


class Memory(_Model):
    hbm_kv_gib: float = Field(gt=0)
    dram_gib: float = Field(ge=0)
    ssd_gib: float = Field(ge=0)
    device_cache_fraction: float = Field(
        default=0.3, ge=0, le=1,
        description="share of hbm_kv kept as a prefix cache of idle chunks (rest: running KV)")


class Bandwidth(_Model):
    disk_to_dram_gbps: float = Field(gt=0)
    dram_to_device_gbps: float = Field(gt=0)
    pod_to_pod_gbps: float = Field(gt=0)
    device_to_dram_gbps: float | None = Field(
        default=None, gt=0, description="storing newly computed chunks into the KV tiers, when "
        "it runs on the step loop (the reference engine); None: off the critical path")


class Engine(_Model):
    """How the serving engine itself schedules, when the simulator should copy it exactly
    (the reference engine: its own ``FcfsPolicy`` unless a worker flag names another)."""

    scheduler: str = Field(default="fcfs", description="the worker's --scheduler-policy")
    prefill_chunk_tokens: int = Field(default=512, ge=1)
    max_running: int = Field(default=16, ge=1)


class Profile(_Model):
    name: str
    accelerator: str
    model: str
    kv_bytes_per_token: int = Field(gt=0)
    prefill: Linear3
    decode: Linear3
    memory: Memory
    bandwidth: Bandwidth
    max_running: int = Field(default=256, ge=1)
    step_tokens: int = Field(default=8192, ge=256, description="prefill tokens per step")
    host_cores: int | None = Field(
        default=None, ge=1, description="all pods are processes sharing this many CPU cores "
        "(processor sharing: n busy engine loops each run at min(1, cores / n) speed); "
        "None: every pod has its own accelerator")
    engine: Engine | None = Field(default=None, description="the engine's own scheduler")
    step_cost_factor: dict[str, float] = Field(
        default_factory=dict, description="per pod role (prefill, decode, both): a step's "
        "forward work times this, measured in a real fleet by `sim check-steps --fold-into` "
        "(the loop's CPU seconds over the profile's price of the same steps: in-step work the "
        "standalone calibration does not see, e.g. a prefill pod reading cached prefixes and "
        "pinning hand-offs); 1 for a role not listed")
    source: str = ""
    assumptions: list[str] = Field(default_factory=list)
    measured: dict[str, Any] = Field(default_factory=dict)

    # -- derived
    def prefill_s(self, new_tokens: int, context_tokens: int) -> float:
        p = self.prefill
        return p.a_s + p.b_s * new_tokens + p.c_s * context_tokens

    def chunk_s(self, new_tokens: int, start: int) -> float:
        """One prompt chunk of ``new_tokens`` starting at token ``start``, without the per-step
        ``a`` (a step may run several chunks)."""
        p = self.prefill
        t = p.b_s * new_tokens + p.c_s * start
        if p.d_s:
            t += p.d_s * new_tokens * (start + (new_tokens + 1) / 2)
        return t

    def decode_s(self, batch: int, context_tokens: int) -> float:
        d = self.decode
        return d.a_s + d.b_s * batch + d.c_s * context_tokens if batch else 0.0

    def chunk_bytes(self, chunk: int) -> int:
        return chunk * self.kv_bytes_per_token

    def tokens(self, gib: float) -> int:
        return int(gib * GIB // self.kv_bytes_per_token)

    def transfer_s(self, nbytes: float, gbps: float) -> float:
        return nbytes / (gbps * 1e9)


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def load_profile(spec: str | Path) -> Profile:
    """A profile by name (``sim/profiles/NAME.yaml``) or by path."""
    path = Path(spec)
    if not path.suffix:
        path = PROFILE_DIR / f"{spec}.yaml"
    if not path.exists():
        raise FileNotFoundError(f"no profile {spec!r}; bundled: {', '.join(profile_names())}")
    return Profile.model_validate(yaml.safe_load(path.read_text()))


def write_profile(profile: Profile, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(profile.model_dump(mode="json"), sort_keys=False))
    return path
