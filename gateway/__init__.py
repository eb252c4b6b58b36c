"""ShardLM gateway: tokenization, streaming detokenization, stop sequences and the public API."""
__version__ = "0.1.0"
