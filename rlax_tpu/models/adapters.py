"""LoRA adapters in a model's pure-dict parameters (model.lora_rank > 0): split from the frozen
base the trainer does not train, and joined back for a forward; the adapters alone are what a
LoRA run publishes."""

from __future__ import annotations

from typing import Any

Params = dict[str, Any]


def is_adapter_key(key: object) -> bool:
    """An adapter's subtree in the model's parameters: ``layers.<i>.<module>.<proj>_lora``."""
    return isinstance(key, str) and key.endswith("_lora")


def split_adapters(params: Params) -> tuple[Params, Params]:
    """(adapters, base): the subtrees under adapter keys, and everything else (same nesting)."""
    adapters: Params = {}
    base: Params = {}
    for key, value in params.items():
        if is_adapter_key(key):
            adapters[key] = value
        elif isinstance(value, dict):
            a, b = split_adapters(value)
            if a:
                adapters[key] = a
            base[key] = b
        else:
            base[key] = value
    return adapters, base


def join(base: Params, adapters: Params) -> Params:
    """The whole model's parameters from ``split_adapters``' two parts (no copies)."""
    out = dict(base)
    for key, value in adapters.items():
        out[key] = join(base[key], value) if key in base and not is_adapter_key(key) else value
    return out
