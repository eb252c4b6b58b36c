"""GGUF checkpoints (the llama.cpp / Ollama format), read through the `gguf` package.

Everything GGUF-specific stays in this package: `file` opens and validates a file, `names` maps
llama.cpp's tensor names and Q/K row order back to ShardLM's, `config` turns the metadata into a
`ModelConfig`, and `reader` serves tensors (dequantized, or as packed blocks) to the model loader.
"""
