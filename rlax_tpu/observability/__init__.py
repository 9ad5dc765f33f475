"""Metrics (metrics.jsonl and the sinks: TensorBoard, Weights & Biases, plugins), progress display and the run report."""
