"""Parameter server: TensorStore-backed, versioned weights served over gRPC."""
