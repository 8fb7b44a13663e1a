"""Typed dataclass configs from YAML files with dotted ``key=value`` overrides.

Generic machinery only (no project fields): :mod:`leviathan_pretrain.config` declares the schema.

- ``load(cls, path, overrides)`` reads a YAML file (which may name a ``base:`` YAML file, relative
  to itself, that it extends: mappings merge recursively, anything else replaces), applies
  overrides such as ``model.lev.heads=16`` or ``data.prefixes=[a,b]`` (values parsed as YAML),
  checks every key and type against the dataclasses, and calls each dataclass's ``validate()``.
- Every error is a :class:`ConfigError` that names the dotted key and where it came from: the file, or
  ``command line (key=value)`` when an override set that key; an unknown key gets a "did you mean" (at
  its level, or the same name in another section, e.g. ``train.keep_last`` -> ``checkpoint.keep_last``).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config value is missing, unknown, of the wrong type or inconsistent; names the key."""


class UnknownKeyError(ConfigError):
    """Keys that no dataclass field names: ``unknown`` (full dotted), ``valid`` (the field names at that level)."""

    def __init__(self, unknown: list[str], valid: list[str], prefix: str, all_keys: list[str] = ()):
        self.unknown, self.valid, self.prefix = unknown, valid, prefix
        super().__init__(unknown_key_message(unknown, valid, prefix, all_keys))


def schema_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of dataclass ``cls`` (sections too), through ``X | None`` fields."""
    out = []
    for name, tp in typing.get_type_hints(cls).items():
        key = f"{prefix}.{name}" if prefix else name
        out.append(key)
        for t in (tp, *typing.get_args(tp)):
            if dataclasses.is_dataclass(t):
                out += schema_keys(t, key)
                break
    return out


def suggest(key: str, valid: list[str], all_keys: list[str] = ()) -> list[str]:
    """Close matches for unknown dotted ``key``: the same name in another section first, then a close name at
    its level, then a close name anywhere."""
    head, _, name = key.rpartition(".")
    same = [k for k in all_keys if k.rpartition(".")[2] == name and k != key]
    if same:
        return same[:2]
    where = f"{head}." if head else ""
    local = difflib.get_close_matches(name, valid, n=2, cutoff=0.6)
    if local:
        return [where + m for m in local]
    leaves: dict[str, list[str]] = {}
    for k in all_keys:
        leaves.setdefault(k.rpartition(".")[2], []).append(k)
    return [k for m in difflib.get_close_matches(name, list(leaves), n=2, cutoff=0.75) for k in leaves[m]][:2]


def unknown_key_message(unknown: list[str], valid: list[str], prefix: str, all_keys: list[str] = ()) -> str:
    parts = []
    for u in unknown:
        hints = suggest(u, valid, all_keys)
        parts.append(f"{u} (did you mean {' or '.join(hints)}?)" if hints else u)
    noun = "key" if len(unknown) == 1 else "keys"
    return f"unknown config {noun} {', '.join(parts)}; valid keys {f'in {prefix}' if prefix else 'here'}: " + (
        ", ".join(sorted(valid))
    )


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
                errors.append(e)
        if len(errors) == 1:
            raise errors[0]  # its own type (an UnknownKeyError stays one)
        raise ConfigError(f"{key}: {value!r} matches none of {tp}")
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
        raise UnknownKeyError([where + str(u) for u in unknown], sorted(fields), prefix)
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


def apply_overrides(data: dict, overrides: list[str] | tuple) -> dict[str, str]:
    """Set each dotted ``key=value`` of ``overrides`` in the plain tree ``data``, in order; returns
    ``{dotted key: override text}`` (the last override of each key)."""
    origins = {}
    for text in overrides:
        keys, value = parse_override(text)
        set_dotted(data, keys, value)
        origins[".".join(keys)] = text.strip()
    return origins


_KEY = re.compile(r"(?:unknown config keys? )?([A-Za-z_][\w.\[\]]*)[:;( ]")


def origin_of(e: ConfigError, origins: dict[str, str]) -> str | None:
    """The override text that set the key ``e`` names (or a section above it, or a key below an unknown one),
    None when the key came from the file."""
    if isinstance(e, UnknownKeyError):
        keys = e.unknown
    else:
        m = _KEY.match(str(e))
        keys = [re.sub(r"\[\d+\]", "", m.group(1))] if m else []
    hits = [
        text
        for o, text in origins.items()
        for k in keys
        if k == o or k.startswith(o + ".") or (isinstance(e, UnknownKeyError) and o.startswith(k + "."))
    ]
    return hits[-1] if hits else None


def load(cls: type, path: str | Path | None = None, overrides: list[str] | tuple = ()) -> Any:
    """Read ``path``, apply ``overrides``, build and validate ``cls``; a :class:`ConfigError` is prefixed with
    where its key came from: ``command line (key=value)`` or the file."""
    data: dict = read_yaml(path) if path is not None else {}
    origins = apply_overrides(data, overrides)
    try:
        cfg = build(cls, data)
        validate_tree(cfg)
    except ConfigError as e:
        msg = str(e)
        if isinstance(e, UnknownKeyError):
            msg = unknown_key_message(e.unknown, e.valid, e.prefix, schema_keys(cls))
        text = origin_of(e, origins)
        where = f"command line ({text})" if text is not None else path
        raise ConfigError(f"{where}: {msg}" if where is not None else msg) from None
    return cfg


def to_dict(obj: Any) -> dict:
    return dataclasses.asdict(obj)


def require(cond: bool, key: str, message: str) -> None:
    """Raise a ConfigError naming ``key`` unless ``cond`` holds."""
    if not cond:
        raise ConfigError(f"{key}: {message}")
