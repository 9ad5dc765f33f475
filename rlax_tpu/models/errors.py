"""The one exception type for unusable model inputs (checkpoints, configs, tokenizer files)."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A checkpoint, config or tokenizer file cannot be used.

    The message names the file and, where one is at fault, the tensor or field, and says why,
    e.g. ``/ckpt/model.safetensors: tensor 'model.norm.weight' has shape (64,), expected (128,)``.
    """

    def __init__(self, source: str, why: str):
        self.source, self.why = source, why
        super().__init__(f"{source}: {why}")
