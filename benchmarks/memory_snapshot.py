"""What is live at a step's memory peak, by allocation site: for checking ``plan/planner.py``'s transient term on a GPU.

``record_step(fn, device, repo)`` runs ``fn`` (one training step) under the CUDA caching allocator's history
(``torch.cuda.memory._record_memory_history``, Python stacks), takes ``torch.cuda.memory._snapshot()`` and
returns :func:`peak_breakdown` of its trace. ``peak_breakdown(events, base_bytes, repo)`` is pure Python (tested on
the CPU with a made-up trace): it replays the ``alloc`` / ``free_completed`` events, finds the moment the
allocated bytes were highest, and sorts what was live then

- by **category**, from the innermost frame that names one (see :data:`CATEGORIES`): the states held before the
  step (``before_step``: weights, gradients, optimizer states, everything the trace never saw allocated), the
  loss, LEV's input layer, the transformer layers' forward (activations), backward (allocations under a
  ``backward`` call with a Python frame of ours; autograd's own threads have none: ``autograd_thread``), the
  optimizer / DeepSpeed's buffers, the data, else ``other``;
- by **site**: the innermost frame of this repository, DeepSpeed or megatron-core (``file:line function``).

The plan's terms (plan/planner.py: activations, the loss chunk, DeepSpeed's reduce bucket) can then be set against
the measured categories; ``python benchmarks/bench_step.py --memory-snapshot PATH`` writes the result.
"""

from __future__ import annotations

import collections
from pathlib import Path

# (category, substrings of a frame's file name that put an allocation in it), tried innermost frame first
CATEGORIES = (
    ("loss", ("model/loss", "liger_kernel/")),
    ("lev_input", ("model/lev.py", "model/spline", "model/inputs.py")),
    ("optimizer", ("bf16_optimizer.py", "zero/stage", "torch/optim/", "trainer/faults.py")),
    ("deepspeed", ("deepspeed/",)),
    ("data", ("data/transfer.py", "data/datasets.py")),
    ("activations", ("megatron/core/", "model/gpt.py", "model/attention.py", "model/assembly.py", "model/head.py")),
)
BACKWARD_FILES = ("torch/_tensor.py", "torch/autograd/", "deepspeed/runtime/engine.py")
OURS = ("leviathan_pretrain/", "deepspeed/", "megatron/core/", "benchmarks/")


def _in_backward(frames: list[dict]) -> bool:
    return any(f.get("name") == "backward" and any(k in f.get("filename", "") for k in BACKWARD_FILES) for f in frames)


def _category(frames: list[dict]) -> str:
    """The category of an allocation from its Python frames (innermost first). Autograd's own threads run
    backward with no Python frame: an allocation without one is ``autograd_thread`` (gradients, mostly)."""
    if not frames:
        return "autograd_thread"
    backward = _in_backward(frames)
    for f in frames:
        name = f.get("filename", "")
        for cat, keys in CATEGORIES:
            if any(k in name for k in keys):
                # made inside backward (a custom Function's backward, recompute): a gradient or its temporaries
                return "backward" if backward and cat in ("activations", "lev_input") else cat
    return "backward" if backward else "other"


def _site(frames: list[dict], repo: str) -> str:
    for f in frames:
        name = f.get("filename", "")
        if any(k in name for k in OURS):
            short = name[len(repo) + 1 :] if repo and name.startswith(repo) else name.split("site-packages/")[-1]
            return f"{short}:{f.get('line')} {f.get('name')}"
    return "(no frame of ours, DeepSpeed or megatron-core)"


def peak_breakdown(events: list[dict], base_bytes: int, repo: str = "", top: int = 25) -> dict:
    """The allocated bytes' peak over ``events`` (the allocator's trace entries: ``action``, ``addr``, ``size``,
    ``frames``) on top of ``base_bytes`` live before them, and what was live then, by category and by site."""

    def replay(stop: int | None):
        live: dict[int, dict] = {}
        now = peak = 0
        peak_at = -1
        for i, e in enumerate(events[:stop]):
            act = e.get("action")
            if act == "alloc":
                live[e["addr"]] = e
                now += e["size"]
                if now > peak:
                    peak, peak_at = now, i
            elif act == "free_completed" and e["addr"] in live:
                now -= live.pop(e["addr"])["size"]
        return live, peak, peak_at

    _, peak, peak_at = replay(None)  # two passes: where the peak is, then what was live there
    at_peak, _, _ = replay(peak_at + 1)
    cats: collections.Counter = collections.Counter({"before_step": base_bytes})
    sites: dict[str, list] = {}
    for e in at_peak.values():
        frames = e.get("frames") or []
        cat = _category(frames)
        cats[cat] += e["size"]
        s = sites.setdefault(_site(frames, repo), [0, 0, cat])
        s[0] += e["size"]
        s[1] += 1
    order = sorted(sites.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "peak_gib": (base_bytes + peak) / 2**30,
        "before_step_gib": base_bytes / 2**30,
        "by_category_gib": {k: v / 2**30 for k, v in cats.most_common()},
        "top_sites": [{"site": k, "gib": v[0] / 2**30, "count": v[1], "category": v[2]} for k, v in order],
        "events": len(events),
    }


def record_step(fn, device, repo: Path | str, max_entries: int = 400_000) -> dict:
    """Run ``fn()`` under the allocator's history on ``device`` (CUDA) and return :func:`peak_breakdown` of it,
    with ``max_memory_allocated`` over the same step for comparison."""
    import torch

    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=max_entries)
    try:
        fn()
        torch.cuda.synchronize(device)
        snap = torch.cuda.memory._snapshot(device)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    traces = snap.get("device_traces") or [[]]
    index = device.index if device.index is not None else torch.cuda.current_device()
    out = peak_breakdown(traces[index] if index < len(traces) else traces[0], base, str(repo))
    out["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out
