"""The training loss alone, forward + backward on one device: ``python benchmarks/bench_loss.py``.

The head's linear + cross entropy of ``--tokens`` hidden states ``[T, D]`` against a ``[V, D]`` head weight (the
training mean over a loss mask; gradients of both), each implementation on the same inputs, alternating:

- ``fused``: ours before, ``model.loss_impl=fused`` (model/loss.py: per chunk of at most 2 GiB of fp32 logits on
  CUDA, the log-sum-exp and softmax as fp32 passes, the head gradient summed in fp32);
- ``liger``: ``model.loss_impl=liger`` (model/loss_liger.py: Liger-Kernel's Triton cross entropy on the
  model-dtype logits in place, the same byte budget at the model dtype's size, no host sync);
- ``liger_flce``: Liger-Kernel's own ``LigerFusedLinearCrossEntropyFunction`` (``accum_dtype=torch.float32``,
  ``chunk_mem_const`` chosen so that its chunk, ``next_power_of_2(ceil(T / ceil(V / (C * D))))``, is the first
  power of two at or above ``liger``'s; it reads the token count with ``.item()``);
- ``unfused``: ``F.cross_entropy((h @ W^T).float())``, the whole ``[T, V]`` logits (what megatron's loss holds).

Per implementation: the median and minimum of ``--reps`` timed forward + backward calls (wall time, CUDA-
synchronised), the peak memory of one call (``torch.cuda.max_memory_allocated``, and above what was allocated
before it; CUDA only), its chunk, and after the timing, its loss and gradients against ``fused``'s: the relative
loss difference and the largest gradient difference relative to the largest element (hidden, head weight).
An implementation that raises, or disagrees with ``fused`` beyond :data:`TOL`, is listed in the JSON's
``failures`` (benchmarks/gpu_summary.py's check format) and the exit status is 1; the others are still measured.

    python benchmarks/bench_loss.py [--tokens 8192] [--hidden 1024] [--vocab 200064] [--dtype bf16]
        [--device cuda] [--reps 20] [--warmup 3] [--chunk N] [--masked 0.0] [--impls fused liger ...] [--json OUT]
    python benchmarks/bench_loss.py --dry   # CPU, tiny shapes, Triton's interpreter: a check that it runs

``--dry`` sets ``TRITON_INTERPRET=1`` before anything imports Liger-Kernel (the kernels run on the CPU under
Triton's interpreter: slow, and its times mean nothing).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

IMPLS = ("fused", "liger", "liger_flce", "unfused")
# agreement with fused: the loss (fp32 from the same logits); a gradient's largest difference over its largest
# element: bf16 1-2 ulps (a bf16 GEMM output against fused's fp32 sum: 0.4-0.9% measured, tests/test_fused_loss.py)
TOL = {"loss": 1e-4, "bf16": 2e-2, "fp32": 1e-4}
DRY = {"tokens": 96, "hidden": 32, "vocab": 512, "device": "cpu", "reps": 3, "warmup": 1, "chunk": 40}


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192, help="T, tokens of one micro-batch (default 8192)")
    ap.add_argument("--hidden", type=int, default=1024, help="D (default 1024: 400M)")
    ap.add_argument("--vocab", type=int, default=200_064, help="V, the padded head rows (default 200064)")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=20, help="timed calls of each implementation (default 20)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls of each first (Triton compiles)")
    ap.add_argument("--chunk", type=int, default=None, help="tokens per chunk of ours (model.loss_chunk_tokens)")
    ap.add_argument("--masked", type=float, default=0.0, help="share of tokens out of the loss mask (default 0)")
    ap.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--dry", action="store_true", help="CPU, tiny shapes, Triton's interpreter (a smoke check)")
    args = ap.parse_args(argv)
    if args.dry:
        for k, v in DRY.items():
            setattr(args, k, v)
    return args


def flce_chunk(T: int, V: int, D: int, C: int) -> int:
    """Liger's FLCE chunk for ``chunk_mem_const`` C (fused_linear_cross_entropy_forward, Liger-Kernel 0.8.5)."""
    inc = -(-V // (C * D))
    return min(1 << max(0, math.ceil(math.log2(-(-T // inc)))), T)


def flce_const(T: int, V: int, D: int, target: int) -> int:
    """The smallest ``chunk_mem_const`` whose chunk is at least ``target`` tokens (or all of them)."""
    C = 1
    while flce_chunk(T, V, D, C) < min(target, T):
        C += 1
    return C


def problem(args, torch):
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    dev = torch.device(args.device)
    g = torch.Generator().manual_seed(args.seed)
    T, D, V = args.tokens, args.hidden, args.vocab
    h = torch.randn(T, D, generator=g).to(dev, dtype).requires_grad_()
    W = (0.02 * torch.randn(V, D, generator=g)).to(dev, dtype).requires_grad_()
    y = torch.randint(0, V, (T,), generator=g).to(dev)
    mask = (torch.rand(T, generator=g) >= args.masked).float().to(dev)
    return h, W, y, mask


def contestants(args, torch, y, mask) -> tuple[dict, dict]:
    """``({name: fn(h, W) -> loss}, {name: chunk description})``."""
    import torch.nn.functional as F

    from leviathan_pretrain.model import loss as fused
    from leviathan_pretrain.model import loss_liger, sizes

    T, D, V = args.tokens, args.hidden, args.vocab
    dev = "cpu" if args.device == "cpu" else "cuda"
    e = 2 if args.dtype == "bf16" else 4
    c_fused = sizes.loss_chunk_tokens(V, dev, args.chunk)
    c_liger = sizes.loss_chunk_tokens(V, dev, args.chunk, e)
    w = mask / mask.sum().clamp(min=1.0)
    y_ign = torch.where(mask > 0, y, -100)
    out, chunks = {}, {}
    for name in args.impls:
        if name == "fused":
            out[name] = lambda h, W: fused.mean_loss(h, W, y, w, chunk=c_fused)
            chunks[name] = len(sizes.loss_spans(T, c_fused)), sizes.balanced_chunk(T, c_fused)
        elif name == "liger":
            out[name] = lambda h, W: loss_liger.mean_loss(h, W, y, w, c_liger)
            chunks[name] = len(sizes.loss_spans(T, c_liger)), sizes.balanced_chunk(T, c_liger)
        elif name == "liger_flce":
            from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction as FLCE

            C = flce_const(T, V, D, sizes.balanced_chunk(T, c_liger))
            c = flce_chunk(T, V, D, C)
            # (input, weight, target, bias, ce_weight, ignore_index, lse_square_scale, label_smoothing, reduction,
            #  softcap, return_z_loss, accum_dtype, use_token_scaling, return_token_accuracy,
            #  return_predicted_tokens, ce_impl, ce_mode, chunk_mem_const)
            flce_args = (None, None, -100, 0.0, 0.0, "mean", None, False, torch.float32)
            flce_tail = (False, False, False, None, None, C)
            out[name] = lambda h, W, a=flce_args, t=flce_tail: FLCE.apply(h, W, y_ign, *a, *t)[0]
            chunks[name] = -(-T // c), c
            chunks[name + "_const"] = C
        else:
            out[name] = lambda h, W: F.cross_entropy((h @ W.t()).float(), y_ign, ignore_index=-100)
            chunks[name] = 1, T
    return out, chunks


def main(argv=None) -> dict:
    args = parse(argv)
    if args.dry:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton / liger_kernel
    import torch

    cuda = args.device.startswith("cuda")

    def sync():
        if cuda:
            torch.cuda.synchronize()

    h, W, y, mask = problem(args, torch)
    fns, chunks = contestants(args, torch, y, mask)

    def call(fn):
        h.grad = W.grad = None
        loss = fn(h, W)
        loss.backward()
        return loss

    failures = []  # gpu_summary.py's check format: an implementation that raised, or disagrees with fused
    for name, fn in list(fns.items()):
        try:
            for _ in range(max(1, args.warmup)):
                call(fn)
            sync()
        except Exception as e:  # noqa: BLE001 - recorded; the others are still measured
            traceback.print_exc()
            failures.append(f"{name}: raised {type(e).__name__}: {e}")
            del fns[name]
    times = {n: [] for n in fns}
    peak, above = {}, {}
    names = list(fns)
    for r in range(args.reps):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotating order
            h.grad = W.grad = None
            sync()
            if cuda:
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            call(fns[name])
            sync()
            times[name].append(time.perf_counter() - t0)
            if cuda:
                p = torch.cuda.max_memory_allocated()
                peak[name], above[name] = max(peak.get(name, 0), p), max(above.get(name, 0), p - before)
    # agreement with fused (after the timing: the reference gradients would count in the peaks)
    res, ref = {}, None
    grad_tol = TOL[args.dtype]
    for name in ["fused", *(n for n in names if n != "fused")] if "fused" in fns else names:
        loss = call(fns[name])
        got = (float(loss.detach()), h.grad.detach().float().clone(), W.grad.detach().float().clone())
        if ref is None and name == "fused":
            ref = got
        diff = {}
        if ref is not None:
            rel = lambda a, b: float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))  # noqa: E731
            diff = {
                "loss_rel": abs(got[0] - ref[0]) / abs(ref[0]),
                "grad_hidden_rel": rel(got[1], ref[1]),
                "grad_weight_rel": rel(got[2], ref[2]),
            }
        n_chunks, chunk = chunks[name]
        res[name] = {
            "median_ms": 1e3 * statistics.median(times[name]),
            "min_ms": 1e3 * min(times[name]),
            "peak_gib": peak[name] / 2**30 if name in peak else None,
            "above_inputs_gib": above[name] / 2**30 if name in above else None,
            "chunks": n_chunks,
            "chunk_tokens": chunk,
            "loss": got[0],
            **diff,
        }
        if name == "liger_flce":
            res[name]["chunk_mem_const"] = chunks["liger_flce_const"]
        for key, tol in (("loss_rel", TOL["loss"]), ("grad_hidden_rel", grad_tol), ("grad_weight_rel", grad_tol)):
            if key in diff and not diff[key] <= tol:  # NaN fails too
                failures.append(f"{name}: {key} {diff[key]:.3g} against fused (tolerance {tol:g})")
        del got
    out = {
        "shape": {"tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab, "dtype": args.dtype},
        "device": torch.cuda.get_device_name() if cuda else "cpu" + (" (Triton interpreter)" if args.dry else ""),
        "torch": torch.__version__,
        "reps": args.reps,
        "masked": args.masked,
        "tolerances": {"loss_rel": TOL["loss"], "grad_rel": grad_tol},
        "impls": res,
        "failures": failures,
    }
    report(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


def report(out: dict) -> None:
    s = out["shape"]
    print(
        f"training loss, forward + backward: T {s['tokens']}, D {s['hidden']}, V {s['vocab']}, {s['dtype']}; "
        f"{out['device']}, torch {out['torch']}; {out['reps']} reps, rotating order, wall time (synchronised)"
    )
    gib = lambda x: f"{x:8.2f}" if x is not None else f"{'n/a':>8}"  # noqa: E731
    print(
        f"  {'impl':<11} {'median ms':>10} {'min ms':>9} {'peak GiB':>8} {'+GiB':>8} {'chunks':>13} "
        f"{'loss':>10} {'loss rel':>9} {'dh rel':>9} {'dW rel':>9}"
    )
    for name, r in out["impls"].items():
        rel = lambda k: f"{r[k]:9.2e}" if k in r else f"{'':9}"  # noqa: E731, B023
        print(
            f"  {name:<11} {r['median_ms']:10.2f} {r['min_ms']:9.2f} {gib(r['peak_gib'])} {gib(r['above_inputs_gib'])} "
            f"{r['chunks']:>4} x {r['chunk_tokens']:>6} {r['loss']:10.5f} {rel('loss_rel')} {rel('grad_hidden_rel')} "
            f"{rel('grad_weight_rel')}"
        )
    for f in out["failures"]:
        print(f"  FAILED: {f}")
    if "fused" in out["impls"]:
        base = out["impls"]["fused"]["median_ms"]
        print(
            "  median time over fused's: "
            + ", ".join(f"{n} {r['median_ms'] / base:.3f}" for n, r in out["impls"].items())
        )


if __name__ == "__main__":
    sys.exit(1 if main()["failures"] else 0)
