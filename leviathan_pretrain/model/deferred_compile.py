"""megatron-core's fused functions compiled at their first call, not when megatron-core is imported.

megatron-core decorates its fused functions (bias + SwiGLU/GeLU, the norms, the MoE router, ...) with
``megatron.core.jit.jit_fuser``, which is ``torch.compile``, as its modules load. ``torch.compile`` compiles nothing
until the function is called, but decorating imports torch's whole compiler stack (dynamo, inductor, triton): 1.4
CPU-seconds of every process that imports megatron-core, 38% of its import (measured on a 2-core CPU machine,
``import megatron.core, deepspeed``: 3.8 -> 2.35 CPU-s), also in the processes that never call one of them (a CPU
rank, ``evaluate``, ``status``, every test's ranks).

:func:`install` (run by ``leviathan_pretrain/__init__.py``, so before any of our modules imports megatron-core)
makes ``jit_fuser`` a decorator that calls ``torch.compile`` on the function at its first call and calls the
compiled function from then on: the same compiled function as before, compiled at the same moment (its first call).
Inside a region torch.compile is tracing, the function is called as it is, which is what dynamo does with a nested
``torch.compile`` (it inlines the function into the outer graph). If megatron-core was imported before
:func:`install` ran, its functions keep megatron's own decorator: nothing changes but the start-up time.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys

JIT_MODULE = "megatron.core.jit"


def lazy_compile(fn=None, **options):
    """``torch.compile(fn, **options)`` made at ``fn``'s first call (outside torch.compile's tracing); usable as
    ``@lazy_compile`` and ``@lazy_compile(**options)``, as ``torch.compile`` is."""
    if fn is None:
        return lambda f: lazy_compile(f, **options)
    import torch  # loaded already where it decorates: megatron-core has imported it (kept off the per-call path)

    compiled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        if torch.compiler.is_compiling():  # an outer torch.compile traces it: inline, as a nested compile is
            return fn(*args, **kwargs)
        if compiled is None:
            compiled = torch.compile(fn, **options)
        return compiled(*args, **kwargs)

    return call


class _JitFinder(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core.jit`` as the normal path finder does; after the module has run, its ``jit_fuser`` (if
    it is ``torch.compile``, megatron's choice for torch >= 2.2) is replaced by :func:`lazy_compile`."""

    def find_spec(self, name, path, target=None):
        if name != JIT_MODULE:
            return None
        uninstall()  # once: the module is loaded once per process
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            import torch

            if getattr(module, "jit_fuser", None) is torch.compile:
                module.jit_fuser = lazy_compile

        spec.loader.exec_module = exec_module
        return spec


_FINDER = _JitFinder()


def install() -> None:
    """Defer megatron-core's compile decorations (see the module's docstring); a no-op once megatron-core's
    ``jit`` module is loaded, or when installed already."""
    if JIT_MODULE not in sys.modules and _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
