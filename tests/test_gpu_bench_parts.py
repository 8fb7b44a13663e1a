"""The GPU check's own arithmetic, on the CPU: the parts of benchmarks/ whose numbers a GPU run reports
must mean what they say before the run spends its minutes.

- hf_reference.py: Liger's ``chunk_mem_const`` cuts a micro-batch into our number of loss chunks (Liger 0.8.5's
  own formula, checked against its code's chunk for the same sizes);
- bench_step.py: the rotating order puts every contestant first equally often;
- memory_snapshot.py: the peak of an allocator trace and what was live there, by category and site;
- gpu_summary.py: per-scale ratios and the step-speed goals from training rows and bench_step results.
"""

from __future__ import annotations

import collections
import math

import pytest

from tests import benchmark_scripts


@pytest.fixture(scope="module")
def hf():
    return benchmark_scripts.load("hf_reference")


def liger_chunk(tokens: int, vocab: int, hidden: int, mem_const: int) -> int:
    """Liger 0.8.5's chunk, as its ``fused_linear_cross_entropy_forward`` computes it (triton.cdiv and
    next_power_of_2 spelled out; read from its source)."""
    triton = pytest.importorskip("triton")
    inc = triton.cdiv(vocab, mem_const * hidden)
    return min(triton.next_power_of_2(triton.cdiv(tokens, inc)), tokens)


SIZES = [(8192, 200_064, 1024, 2), (8192, 200_064, 1024, 1), (4096, 200_064, 2048, 2), (128, 512, 64, 1)]


@pytest.mark.parametrize("tokens, vocab, hidden, chunks", SIZES)
def test_liger_mem_const_gives_our_number_of_chunks(hf, tokens, vocab, hidden, chunks):
    c = hf.liger_chunk_mem_const(tokens, vocab, hidden, chunks)
    chunk = liger_chunk(tokens, vocab, hidden, c)
    assert hf.liger_chunk_tokens(tokens, vocab, hidden, c) == chunk
    assert math.ceil(tokens / chunk) == chunks, (c, chunk)
    if (tokens, vocab, hidden, chunks) == (8192, 200_064, 1024, 2):
        assert (c, chunk) == (98, 4096)


def test_rounds_rotate_every_contestant_to_every_place():
    bench_step = benchmark_scripts.load("bench_step")
    names = ["ours", "old", "ref", "liger"]
    orders = [bench_step._rounds(names, r) for r in range(8)]
    assert all(sorted(o) == sorted(names) for o in orders)
    for place in range(4):
        assert collections.Counter(o[place] for o in orders) == dict.fromkeys(names, 2)


def frame(path: str, line: int = 1, name: str = "f") -> dict:
    return {"filename": path, "line": line, "name": name}


def test_memory_peak_and_what_was_live_there():
    ms = benchmark_scripts.load("memory_snapshot")
    repo = "/r"
    loss = [frame("/r/leviathan_pretrain/model/loss.py", 50, "_exp_stats")]
    act = [frame("/x/site-packages/megatron/core/transformer/mlp.py", 9, "forward"), frame("/r/a.py")]
    ev = [
        {"action": "alloc", "addr": 1, "size": 300, "frames": act},
        {"action": "alloc", "addr": 2, "size": 500, "frames": loss},
        {"action": "alloc", "addr": 3, "size": 100, "frames": []},  # autograd's thread: no Python frame
        {"action": "free_completed", "addr": 2, "size": 500},  # the peak (900) was just before this
        {"action": "alloc", "addr": 4, "size": 550, "frames": act},  # 950 > 900: the new peak
        {"action": "free_requested", "addr": 4, "size": 550},  # requested, not completed: still counted
    ]
    out = ms.peak_breakdown(ev, base_bytes=1000, repo=repo)
    assert out["peak_gib"] * 2**30 == pytest.approx(1000 + 950)
    cats = {k: round(v * 2**30) for k, v in out["by_category_gib"].items()}
    assert cats == {"before_step": 1000, "activations": 850, "autograd_thread": 100}
    top = out["top_sites"][0]
    assert top["site"] == "megatron/core/transformer/mlp.py:9 forward" and round(top["gib"] * 2**30) == 850
    assert top["count"] == 2 and top["category"] == "activations"
    backward = [frame("/r/leviathan_pretrain/model/lev.py", 3), frame("/t/torch/_tensor.py", 5, "backward")]
    assert ms._category(backward) == "backward" and ms._category(loss) == "loss"


def test_summary_gives_the_step_speed_ratios_and_goals_per_scale():
    gs = benchmark_scripts.load("gpu_summary")
    common = {"tflops_per_device": 1.0, "final_loss": 9.0, "peak_gib": 1.0, "plan_gib": 2.0}
    rows = [
        {"run": "/w/400m-tied", "variant": "tied", "step_s": 0.30, "mfu": 0.31, "tokens_per_s": 1.0, **common},
        {"run": "/w/400m-lev", "variant": "lev", "step_s": 0.33, "mfu": 0.28, "tokens_per_s": 0.9, **common},
        {"run": "/w/1.2b-tied", "variant": "tied", "step_s": 0.40, "mfu": 0.36, "tokens_per_s": 1.0, **common},
        {"run": "/w/1.2b-lev", "variant": "lev", "error": "OOM"},
    ]
    step = {"config": "configs/400m-tied.yaml", "ratio_pairs": 0.8, "ratio_pairs_vs": {"ref": 0.8, "liger": 1.02}}
    old = {"config": "configs/1.2b-tied.yaml", "ratio_pairs": 0.9}  # a result from before the four contestants
    sc = gs.scales(rows, {"results": [{"step": step}, {"step": old}]})
    a, b = sc["400m"], sc["1.2b"]
    assert a["lev_over_tied"] == pytest.approx(1.1) and a["ours_over_ref"] == 0.8 and a["ours_over_liger"] == 1.02
    goals = {k: v["met"] for k, v in a["goals"].items()}
    assert goals == {"ours_over_ref": True, "ours_over_liger": False, "lev_over_tied": False, "mfu_tied": True}
    assert "lev_over_tied" not in b and b["ours_over_ref"] == 0.9
    assert b["goals"]["mfu_tied"] == {"value": 0.36, "goal": ">= 0.38", "met": False}  # 1.2B's own bound
    assert b["goals"]["lev_over_tied"]["met"] is None  # LEV failed: not measured, never "met"
    checks = {"compile": {"training": {"failures": ["x"]}}}
    md = gs.report_md(rows, {"results": [], "sections": [], "checks": checks}, sc)
    assert "| 400m | ours_over_liger | 1.020 | <= 1 | **no** |" in md and "- compile: FAILED: x" in md


def test_a_contestant_that_failed_is_named_in_the_summary_not_lost():
    """bench_step.py keeps measuring the others when (A) or (D) fails to build or warm up (a Triton compile error
    on a GPU, say); the summary says which failed and why, beside the ones measured."""
    gs = benchmark_scripts.load("gpu_summary")
    step = {
        "config": "configs/400m-tied.yaml",
        "precision": "bf16",
        "micro_batch": 16,
        "global_batch": 64,
        "contestants": ["ours", "ref"],
        "describe": {"ours": "loss liger", "ref": "HF"},
        "failed_contestants": {"liger": "Traceback ...\nRuntimeError: PassManager::run failed\n"},
        "tokens_per_s": {"ours": 2.0, "ref": 1.0},
        "median_wall_s": {"ours": 0.5, "ref": 1.0},
        "ratio_pairs": 0.5,
        "ratio_pairs_vs": {"ref": 0.5},
        "median_s": {"ours": 0.5, "ref": 1.0},
    }
    md = gs.report_md([], {"results": [{"step": step}], "sections": [], "checks": {}})
    assert "- **liger: failed, not measured**: RuntimeError: PassManager::run failed" in md
    assert "| ours | 2 | n/a | 500.0 | 1 |" in md and "| ref | 1 | n/a | 1000.0 | 0.500 |" in md
    sc = gs.scales([], {"results": [{"step": step}]})["400m"]
    assert sc["goals"]["ours_over_liger"]["met"] is None and sc["goals"]["ours_over_ref"]["met"] is True
