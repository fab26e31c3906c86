"""The local fleet: kvindex, workers and proxy as real processes on loopback.

``topology`` turns a ``FleetSpec`` (how many prefill/decode/both workers, which store, routing
and cache tiers) into process specs with free ports; ``supervisor.Fleet`` starts them in order,
waits for health, watches them and stops every process group on exit; ``process`` is one
supervised process; ``cli`` is ``agentserving up``.
"""
