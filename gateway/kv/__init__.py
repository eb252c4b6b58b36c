"""KV blocks: the allocator with the prefix-cache hash chain, and the KV manager, the
scheduler's one interface to them (reservation, prefix cache and its salt policy, eviction)."""
