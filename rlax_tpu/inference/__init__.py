"""Inference worker service: paged-attention engine with continuous batching, served over gRPC."""
