"""GGUF checkpoints (the llama.cpp / Ollama format); the `gguf` package supplies the type tables and
the dequantizing kernels.

Everything GGUF-specific stays in this package: `file` opens and validates a file, `names` maps
llama.cpp's tensor names and Q/K row order back to ShardLM's, `config` turns the metadata into a
`ModelConfig`, and `reader` serves tensors (dequantized, or as packed blocks) to the model loader.
The header itself (metadata and tensor table) is read by `shardlm.gguf_header`, which the
gateway's tokenizer shares.
"""
