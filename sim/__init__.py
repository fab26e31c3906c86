"""A discrete-event simulator of an AgentServing cluster, see docs/sim.md.

It drives the code the services run — the prefill policies and ShadowScheduler
(``agentserving.prefill``), the proxy's routing policies (``agentserving.proxy.routing``), the
kvindex's in-memory index and session store (``agentserving.kvindex.index.memory``) — on
simulated time, with step times from an accelerator profile (``sim/profiles/*.yaml``).
"""

from agentserving.sim.cluster import SimConfig, SimResult, simulate
from agentserving.sim.profile import Profile, load_profile

__all__ = ["Profile", "SimConfig", "SimResult", "load_profile", "simulate"]
