"""ShardLM gateway: tokenization, streaming detokenization, stop sequences and the public API."""
