"""specdec: lossless speculative decoding for llama.cpp GGUF models."""

__version__ = "0.1.0"
