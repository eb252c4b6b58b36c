"""ShardLM Python client.

Generated gRPC stubs and protobuf messages live in ``shardlm.common.v1``,
``shardlm.gateway.v1`` and ``shardlm.worker.v1``.
"""

__version__ = "0.1.0"
