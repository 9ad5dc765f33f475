"""Dict <-> RunConfig: the checked conversion config files and flags go through."""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

import ml_collections

from rlax_tpu.config.checks import ConfigError
from rlax_tpu.config.run import RunConfig


def from_dict(cls: type, data: Mapping[str, Any], path: str = "") -> Any:
    """Builds dataclass ``cls`` from a (nested) mapping, checking keys, types and values.

    Raises ConfigError naming the dotted field path. Missing keys take their defaults.
    """
    if isinstance(data, ml_collections.ConfigDict):
        data = data.to_dict()
    if cls is RunConfig and not path and isinstance(data, Mapping):
        data = _fill_bucket(data)
    if not isinstance(data, Mapping):
        raise ConfigError(path, f"expected a section (mapping), got {type(data).__name__}", data)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        where = f"{path}.{key}" if path else key
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(where, f"unknown field{hint}")
        kwargs[key] = _convert(hints[key], value, where)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise e.prefixed(path) if path else e from None


BUCKET = "{bucket}"


def _fill_bucket(data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` with every "{bucket}" in its strings replaced by controller.bucket; ConfigError
    naming the fields that need it when it is unset."""
    bucket = str((data.get("controller") or {}).get("bucket", "") or "").rstrip("/")
    needing: list[str] = []

    def fill(value: Any, where: str) -> Any:
        if isinstance(value, Mapping):
            return {k: fill(v, f"{where}.{k}" if where else k) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(fill(v, where) for v in value)
        if isinstance(value, str) and BUCKET in value:
            needing.append(f"{where} = {value!r}")
            return value.replace(BUCKET, bucket)
        return value

    filled = fill(data, "")
    if needing and not bucket:
        raise ConfigError(
            "controller.bucket",
            f"required by {', '.join(needing)}: give the run's storage, e.g. "
            "--config.controller.bucket=gs://my-bucket (or a local directory)",
            "",
        )
    return filled


def _convert(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(where, f"must be one of {', '.join(map(repr, choices))}{hint}", value)
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, where)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(where, f"expected a tuple, got {type(value).__name__}", value)
        (item_tp, _ellipsis) = typing.get_args(tp)
        return tuple(_convert(item_tp, v, f"{where}[{i}]") for i, v in enumerate(value))
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(where, f"expected a float, got {type(value).__name__}", value)
        if math.isnan(value):
            raise ConfigError(where, "must be a number", value)
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(where, f"expected an int, got {type(value).__name__}", value)
        return value
    if tp in (bool, str):
        if not isinstance(value, tp):
            raise ConfigError(where, f"expected a {tp.__name__}, got {type(value).__name__}", value)
        return value
    raise TypeError(f"config field {where} has an unsupported annotation {tp!r}")


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict of a config dataclass (tuples kept)."""
    return {
        f.name: to_dict(v) if dataclasses.is_dataclass(v := getattr(cfg, f.name)) else v
        for f in dataclasses.fields(cfg)
    }


def diff(a: RunConfig, b: RunConfig) -> list[str]:
    """Dotted paths of fields whose values differ between two configs."""

    def flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            if isinstance(v, Mapping):
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out

    fa, fb = flat(to_dict(a)), flat(to_dict(b))
    return sorted(k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k))


def base_config_dict() -> ml_collections.ConfigDict:
    """A locked ConfigDict with every field of RunConfig at its default.

    Config files start from this, so an assignment to a misspelt field fails where it is made.
    """
    cfg = ml_collections.ConfigDict(to_dict(RunConfig()))
    cfg.lock()
    return cfg
