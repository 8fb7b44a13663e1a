"""``"package.module:name"`` -> the object it names, imported on first use: how a table names code it must not
import at start (the command table: ``lev --help`` imports no command; the variant registry: the config stays
torch-free). The spelling is pyproject's entry-point spelling, and it is what tests/test_import_graph.py reads as an
import edge: a module that imports by name does it through here, with such a literal."""

from __future__ import annotations

import importlib


def resolve(spec: str):
    """The object ``spec`` (``"package.module:name"``) names."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"{spec!r} is not 'package.module:name'")
    return getattr(importlib.import_module(module), name)
