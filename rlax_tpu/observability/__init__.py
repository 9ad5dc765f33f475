"""Metrics writers (TensorBoard + JSONL), progress display and the run report."""
