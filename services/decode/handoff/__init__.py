"""The P/D hand-off protocol, both ends in one place: ``wire`` (the checksummed, layer-by-layer
stream format), ``source`` (the prefill pod's side: KV pinned until pulled, served over HTTP)
and ``pull`` (the decode pod's side: fetch, verify, load layer by layer). It lives in the
decode role's folder because a hand-off exists for a decode pod: the decode pod asks, the
prefill pod answers. The engine composes either end by its role; nothing here imports the
engine.
"""
