"""Flax NNX decoder-only transformer (Llama / Qwen2 / Qwen3), sharding rules, loaders, tokenizers."""
