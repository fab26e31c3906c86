"""KV data path of an engine process: chunk keys, the LMCache-backed chunk store, the paged KV
pool, layer-wise loading and prefetches (the P/D hand-off format is services/decode/handoff)."""
