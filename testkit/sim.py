"""A hand-computable profile for the simulator's tests: round step costs, ample memory."""

from __future__ import annotations

from typing import Any

from agentserving.sim.profile import Profile


def toy_profile(**overrides: Any) -> Profile:
    """Prefill 0.1 s + 1 ms per token, decode 10 ms per step, 1 GiB of HBM and DRAM, no SSD;
    ``overrides`` replace whole fields."""
    base: dict[str, Any] = dict(
        name="toy", accelerator="toy", model="toy", kv_bytes_per_token=1000,
        prefill={"a_s": 0.1, "b_s": 0.001, "c_s": 0.0},
        decode={"a_s": 0.01, "b_s": 0.0, "c_s": 0.0},
        memory={"hbm_kv_gib": 1.0, "dram_gib": 1.0, "ssd_gib": 0.0,
                "device_cache_fraction": 0.0},
        bandwidth={"disk_to_dram_gbps": 1.0, "dram_to_device_gbps": 1.0,
                   "pod_to_pod_gbps": 1.0})
    base.update(overrides)
    return Profile.model_validate(base)
