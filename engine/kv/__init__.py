"""KV data path of an engine process: chunk keys, the LMCache-backed chunk store, the paged KV
pool, layer-wise loading, prefetches and the P/D hand-off wire format."""
