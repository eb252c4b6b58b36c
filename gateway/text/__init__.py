"""Text: tokenizers (Hugging Face and GGUF), the incremental detokenizer, stop sequences and token bytes."""
