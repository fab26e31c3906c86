"""The classes ``--scheduler-cls`` names on AgentServing's vLLM pods: vLLM's scheduler with its
prefix cache a managed tier (``device_kv``: pins, eviction by chunk, device residency), under a
prefill policy (``prefill.vllm_plugin``) or with vLLM's own scheduling:

- ``PolicyScheduler``: the policy in ``AGENTSERVING_PREFILL_POLICY`` (default longcap-dynamic);
- ``LongcapScheduler``: the same class under the name the seed's docs use;
- ``DeviceKvScheduler``: vLLM's own scheduling (``--scheduler-policy fcfs``).

Built on first access, so importing this module never imports vLLM.
"""

from __future__ import annotations

from agentserving.engine.vllm.device_kv import make_device_kv_scheduler
from agentserving.prefill.vllm_plugin import make_scheduler_cls, vllm_scheduler_base


def __getattr__(name: str) -> type:
    if name == "DeviceKvScheduler":
        cls = make_device_kv_scheduler(vllm_scheduler_base())
    elif name in ("PolicyScheduler", "LongcapScheduler"):
        cls = make_scheduler_cls(make_device_kv_scheduler(vllm_scheduler_base()))
    else:
        raise AttributeError(name)
    cls.__name__ = cls.__qualname__ = name
    globals()[name] = cls
    return cls
