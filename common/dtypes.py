"""The floating-point dtypes every command names, in one table: our short names (``fp32``, ``bf16``, ``fp16``,
as ``parallel.precision`` and ``--dtype`` spell them), the torch / Hugging Face names (``float32``, ...) accepted
as aliases, and the bytes per element. Torch-free until :func:`torch_dtype` is called."""

from __future__ import annotations

# short name -> (torch / Hugging Face name, bytes per element)
DTYPES = {"fp32": ("float32", 4), "bf16": ("bfloat16", 2), "fp16": ("float16", 2)}
ALIASES = {long: short for short, (long, _) in DTYPES.items()}


def canonical(name: str) -> str:
    """``fp32`` | ``bf16`` | ``fp16`` for a short or long name; ``ValueError`` naming the choices otherwise."""
    name = str(name)
    if name in DTYPES:
        return name
    if name in ALIASES:
        return ALIASES[name]
    raise ValueError(f"unknown dtype {name!r} (one of {', '.join(DTYPES)}, or {', '.join(ALIASES)})")


def long_name(name: str) -> str:
    """The torch / Hugging Face name (``torch_dtype`` in a ``config.json``)."""
    return DTYPES[canonical(name)][0]


def nbytes(name: str) -> int:
    return DTYPES[canonical(name)][1]


def torch_dtype(name: str):
    import torch

    return getattr(torch, long_name(name))
