"""ShardLM worker: one process per GPU (or CPU rank) running a tensor-parallel shard."""
