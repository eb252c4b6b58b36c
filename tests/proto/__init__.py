"""Contract tests of the ShardLM gRPC API (proto/)."""
