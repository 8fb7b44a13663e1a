"""Typed dataclass configs from YAML files with dotted ``key=value`` overrides.

Generic machinery only (no project fields): :mod:`leviathan_pretrain.config` declares the schema.

- ``load(cls, path, overrides)`` reads a YAML file (which may name a ``base:`` YAML file, relative
  to itself, that it extends: mappings merge recursively, anything else replaces), applies
  overrides such as ``model.lev.heads=16`` or ``data.prefixes=[a,b]`` (values parsed as YAML),
  checks every key and type against the dataclasses, and calls each dataclass's ``validate()``.
- Every error is a :class:`ConfigError` that names the file and the dotted key.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config value is missing, unknown, of the wrong type or inconsistent; names the key."""


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form dotted.key=value")
    key, _, raw = text.partition("=")
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"override {text!r} has an empty key part")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({e})") from None
    return key.split("."), value


def read_yaml(path: str | Path, _seen: tuple = ()) -> dict:
    """Read a YAML mapping, resolving ``base:`` chains (relative to the including file)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    resolved = path.resolve()
    if resolved in _seen:
        raise ConfigError(f"config file {path}: 'base' chain loops back to itself")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"config file {path}: 'base' must be a path string")
    parent = read_yaml(path.parent / base, _seen + (resolved,))
    return deep_merge(parent, data)


def deep_merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def set_dotted(d: dict, keys: list[str], value: Any) -> None:
    for k in keys[:-1]:
        nxt = d.get(k)
        if not isinstance(nxt, dict):
            nxt = {}
            d[k] = nxt
        d = nxt
    d[keys[-1]] = value


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: {value!r} matches none of {tp}")
    if origin in (list, tuple):
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            value = [value]  # a single value where a list is expected
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (inner, *_) = typing.get_args(tp) or (Any,)
        items = [_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):  # e.g. "1e6" or "2_000"
            try:
                f = float(value.replace("_", ""))
                if f.is_integer():
                    return int(f)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        f = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            f = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads "1e-4" as a string
            try:
                f = float(value)
            except ValueError:
                pass
        if f is None:
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if not math.isfinite(f):  # no key means anything by nan or inf (null is "unset" where a key allows it)
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return f
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported field type {tp}")


def build(cls: type, data: Any, prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a mapping, rejecting unknown keys (named in full)."""
    if data is None:
        data = {}
    if dataclasses.is_dataclass(data):
        return data
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or '<root>'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(
            f"unknown config key(s) {', '.join(where + u for u in unknown)}; "
            f"valid keys here: {', '.join(sorted(fields))}"
        )
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(value, hints[name], f"{prefix}.{name}" if prefix else name)
    return cls(**kwargs)


def validate_tree(obj: Any, prefix: str = "") -> None:
    """Call ``validate(prefix)`` on every nested dataclass, innermost first."""
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            validate_tree(v, f"{prefix}.{f.name}" if prefix else f.name)
    if hasattr(obj, "validate"):
        obj.validate(prefix)


def apply_overrides(data: dict, overrides: list[str] | tuple) -> None:
    """Set each dotted ``key=value`` of ``overrides`` in the plain tree ``data``, in order."""
    for text in overrides:
        keys, value = parse_override(text)
        set_dotted(data, keys, value)


def load(cls: type, path: str | Path | None = None, overrides: list[str] | tuple = ()) -> Any:
    data: dict = read_yaml(path) if path is not None else {}
    apply_overrides(data, overrides)
    try:
        cfg = build(cls, data)
        validate_tree(cfg)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}" if path is not None else str(e)) from None
    return cfg


def to_dict(obj: Any) -> dict:
    return dataclasses.asdict(obj)


def require(cond: bool, key: str, message: str) -> None:
    """Raise a ConfigError naming ``key`` unless ``cond`` holds."""
    if not cond:
        raise ConfigError(f"{key}: {message}")
