"""GGUF checkpoints (llama.cpp's format): read with the `gguf` package and
converted once into a Hugging Face model directory that every loader of
the project (and transformers, vLLM) reads unchanged (docs/models.md, GGUF).

Torch-free: the router resolves models too.
"""
