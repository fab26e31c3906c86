"""The worker runtime of prefill and decode pods (``agentserving worker``).

Two kinds of process per pod, as in vLLM v1:

- the API process (``worker``, ``api/``): the OpenAI-compatible HTTP API, tokenization,
  the memory API on ``memory_port_start`` that forwards to every engine process and merges
  (seed 000), the residency book and the kvindex reporter (``reporter``), ``/metrics``;
- engine processes (``engine_process``): the model (``model/``), the step loop
  (``core``, scheduling decisions from a policy in ``scheduler/``), the KV chunk store on
  LMCache's CPU and disk tiers with checksums (``kv/``), their own memory API and the P/D
  hand-off endpoint on ``memory_port_start + 1 + k``.

They talk over ZMQ (``ipc``). Role-specific glue lives in ``services/prefill`` (the
hand-off source) and ``services/decode`` (KV pull and layer-wise load).
"""
