"""KV blocks: the allocator with the prefix-cache hash chain, and which sequences hold blocks (residency and eviction)."""
