"""``agentserving kvserver``: the KV server vLLM pods hand prefill -> decode KV through.

It speaks LMCache's remote protocol (``LMCACHE_REMOTE_URL=lm://HOST:PORT``), so LMCache's own
client talks to it unchanged, and adds what LMCache's ``lmcache.v1.server`` lacks: a byte
bound with LRU eviction, eviction by chunk hash (the pods' ``POST /memory/evict``), a listing,
Prometheus metrics, and a pull of chunks from another such server.

Modules, one job each: ``store`` (the bounded LRU of blobs, no I/O), ``records`` (the export
stream's record format), ``lmcache_server`` (the LMCache protocol over asyncio streams),
``pull`` (fetching a peer's export into the store), ``metrics``, ``schemas`` (the HTTP API's
bodies), ``app`` (the FastAPI app whose lifespan runs the protocol server), ``settings`` and
``cli``. Only ``lmcache_server`` and ``records`` import LMCache (and so torch).
"""
