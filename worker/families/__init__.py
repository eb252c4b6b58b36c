"""Per-family readings of a Hugging Face config.json: what a family adds to the shared decoder
shape, as ModelConfig fields. `worker.config.parse_config` validates the shared fields and merges
these in."""
