"""model/deferred_compile.py: megatron-core's ``torch.compile`` decorations are made at the first call, not at import.

What must hold: importing our package, then megatron-core (a rank's start) imports none of torch's compiler stack;
megatron's fused functions give what they gave (their own function compiled by torch.compile, at the first call,
once); inside a
region torch.compile traces, one is inlined as a nested torch.compile is (one graph, no break); imported before our
package, megatron-core keeps its own decorator.
"""

from __future__ import annotations

import json

import torch

from leviathan_pretrain.model import deferred_compile
from tests.multiproc import run_python

PROBE = """
import json, sys
{first}
import megatron.core.jit as jit
from megatron.core.fusions import fused_bias_swiglu as fused
import megatron.core.models.gpt  # what a rank imports of megatron-core
before = "torch._dynamo" in sys.modules
import torch
x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
got = fused.swiglu(x)  # compiled at this call (inductor: not bit-equal to eager, equal to its own compile)
same = torch.equal(got, torch.compile(fused.swiglu.__wrapped__)(x))
print(json.dumps({{"dynamo_at_import": before, "fuser": jit.jit_fuser.__name__, "same": same,
                  "dynamo_after_call": "torch._dynamo" in sys.modules}}))
"""


def probe(first: str) -> dict:
    p = run_python("-c", PROBE.format(first=first), timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_a_rank_start_imports_no_compiler_and_the_fused_function_is_compiled_at_its_first_call():
    got = probe("import leviathan_pretrain.train")
    assert got == {"dynamo_at_import": False, "fuser": "lazy_compile", "same": True, "dynamo_after_call": True}


def test_megatron_imported_first_keeps_its_own_decorator():
    got = probe("import megatron.core\nimport leviathan_pretrain.train")
    assert got["dynamo_at_import"] is True and got["fuser"] == "compile" and got["same"] is True


def test_compiled_once_at_the_first_call(monkeypatch):
    made, real = [], torch.compile

    def compile_eager(fn, **options):
        made.append(options)
        return real(fn, backend="eager", **options)

    def f(x):
        return torch.nn.functional.silu(x) * x

    lazy = deferred_compile.lazy_compile(f)
    monkeypatch.setattr(torch, "compile", compile_eager)
    x = torch.randn(4, 8)
    assert made == [] and lazy.__wrapped__ is f
    assert torch.equal(lazy(x), f(x)) and torch.equal(lazy(x + 1), f(x + 1))
    assert made == [{}]  # once
    with_options = deferred_compile.lazy_compile(dynamic=False)(f)
    assert torch.equal(with_options(x), f(x)) and made == [{}, {"dynamic": False}]


def test_inside_a_compiled_region_it_is_inlined_into_one_graph():
    calls = []

    def f(x):
        return torch.nn.functional.silu(x) * x

    lazy = deferred_compile.lazy_compile(f)

    def outer(x):
        return lazy(x) + 1

    def count(gm, inputs):
        calls.append(gm)
        return gm.forward

    x = torch.randn(4, 8)
    got = torch.compile(outer, backend=count, fullgraph=True)(x)  # a graph break would fail here
    assert torch.equal(got, f(x) + 1) and len(calls) == 1
