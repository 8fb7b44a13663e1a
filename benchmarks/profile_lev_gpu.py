"""LEV's input path on a GPU: the chunk budget and the one host synchronisation (``torch.unique``).

At a scale's shapes (V = 200,019, spec LEV defaults, one rank's heads = 8 / --tp, one micro-batch of Zipf ids):

(1) forward + backward of the LEV input layer alone for each ``model.lev.chunk_mib`` in --chunk-mib (ms per
    micro-batch, median of --reps, device-synchronised), and of the TIED input (a ``V x D`` table lookup);
(1b) the spline product's implementation and the output GEMM's dtype: forward + backward of the layer with bf16
    parameters (a GPU run's model dtype) for ``model.lev.kernel`` torch (the default chunk budget) and triton, each
    with ``model.lev.gemm_dtype`` fp32 and model, and the spline product alone (forward, forward + backward); then
    the check line ``LEV kernel check: ... ok/FAILED``: the Triton kernels against the torch path on this device,
    fp32 (the spline product's M and its gradients of u and S; the whole layer's rows and every parameter's
    gradient), max |difference| relative to the largest element, against --check-tol;
(2) (``model.lev.kernel`` and ``gemm_dtype`` at their defaults from here on) what the sync costs: the same
    forward + backward queued behind ~--queued-ms of GPU work (a matmul chain standing in for the previous
    micro-batch's backward), once as the layer runs (the host waits for
    ``torch.unique``'s size, so the GPU idles while the host launches what follows) and once with the unique
    ids computed beforehand (the same kernels, no sync); the difference is the sync's cost per micro-batch.
    In training the engine's blocking ``.to(device)`` of the micro-batch already drains the queue, so this is
    an upper bound;
(3) host synchronisations per micro-batch counted by CUDA's sync debug mode: LEV expects 1, the table 0;
(4) --trace DIR: a torch.profiler chrome trace of 3 LEV micro-batches at the default budget.

    python benchmarks/profile_lev_gpu.py --scale 400m [--tp 1] [--chunk-mib 48,128,256,512,1024] [--reps 20]
        [--json FILE]

``--device cpu`` runs (1), (1b) and (2) on the CPU (a smoke test; the numbers mean nothing for a GPU); the Triton
kernels run there only under Triton's interpreter (``TRITON_INTERPRET=1``, slow: use ``--dry``, which shrinks it
to d_seed 8, 2 heads, 48 tokens and 1 rep). ``--json FILE`` also writes every number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_lev import zipf_ids  # noqa: E402

# D, micro-batch tokens; "dry" (--dry): a LEV small enough for Triton's interpreter on the CPU
SCALES = {"400m": (1024, 16 * 512), "1.2b": (2048, 8 * 512), "tiny": (256, 8 * 256), "dry": (64, 48)}
WARMUP = [2]  # calls before the timed ones (--dry: 1)
VOCAB = 200_019


def build(scale: str, tp: int, device, tokens: int | None = None, precision: str = "fp32", over=()):
    """The LEV layer (this rank's heads), a TIED table, one micro-batch of Zipf ids and an output gradient."""
    import torch

    from leviathan_pretrain.config import load_config
    from leviathan_pretrain.model.gpt import build_transformer_config
    from leviathan_pretrain.model.lev import LEVInput
    from leviathan_pretrain.model.settings import BuildSettings

    D, scale_tokens = SCALES[scale]
    tokens = tokens or scale_tokens
    over = [f"model.hidden_size={D}", "model.num_attention_heads=16", f"model.lev.heads={8 // tp}", *over]
    if scale == "tiny":  # a CPU smoke test: the tiny-cpu LEV (d_seed 32, r 16)
        over += ["model.lev.seed_dim=32", "model.lev.rank=16"]
    if scale == "dry":  # smaller still: d_seed 8, 2 heads, kappa 5, r 16
        over += ["model.lev.seed_dim=8", "model.lev.heads=2", "model.lev.knots=5", "model.lev.rank=16"]
    V = VOCAB if scale not in ("tiny", "dry") else 8000
    cfg = load_config(None, [f"model.vocab_size={V}", *over])
    torch.manual_seed(0)
    build = BuildSettings(device="cpu", precision=precision)
    layer = LEVInput(build_transformer_config(cfg.model, build), cfg.model).to(device)
    table = torch.nn.Parameter(0.02 * torch.randn(V, D, device=device))
    ids = zipf_ids((tokens // 512 if tokens >= 512 else 1, min(tokens, 512)), V, seed=0).to(device)
    grad = torch.randn(ids.shape[1], ids.shape[0], D, device=device, dtype=build.params_dtype)
    return layer, table, ids, grad


def rel_diff(a, b) -> float:
    """max |a - b| relative to the largest |b|."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def kernel_section(args, device, out: dict) -> None:
    """(1b): model.lev.kernel x model.lev.gemm_dtype, the spline product alone, and the check line."""
    import torch

    from leviathan_pretrain.model import lev as lev_mod
    from leviathan_pretrain.model.spline import spline_product

    mod, err = lev_mod.triton_kernels()
    usable = mod is not None and (device.type == "cuda" or mod.interpreted())
    why = "" if usable else (f"triton does not import ({err})" if mod is None else "no TRITON_INTERPRET=1 on the CPU")
    layer, _, ids, grad = build(args.scale, args.tp, device, args.tokens, precision="bf16")
    uniq = torch.unique(ids)
    print(f"(1b) bf16 parameters; LEV forward + backward, ms per micro-batch (median of {args.reps})")
    kernels = ["torch", "triton"] if usable else ["torch"]
    res = out.setdefault("kernels", {})
    for kernel in kernels:
        for gemm in ("fp32", "model"):
            layer.lev.kernel, layer.lev.gemm_dtype = kernel, gemm
            ms = timed(lambda: layer(ids).backward(grad), args.reps, device)
            res[f"{kernel}/{gemm}"] = ms
            print(f"    LEV kernel={kernel:6s} gemm_dtype={gemm:5s}: {ms:8.2f} ms")
    if not usable:
        print(f"    LEV kernel=triton: skipped, {why}")
    with torch.no_grad():
        u = layer.spline_inputs(uniq).detach()
        S = (1.0 + layer.spline_delta.float()).detach()
    eps, chunk = layer.lev.log_eps, layer.chunk_for(device)
    gM = torch.randn(u.shape[0], u.shape[1], S.shape[-1], device=device)
    fns = {"torch": lambda a, b: spline_product(a, b, eps, chunk)}
    if usable:
        fns["triton"] = lambda a, b: mod.spline_product_triton(a, b, eps)

    def spline_run(fn, backward=True):
        a, b = u.clone().requires_grad_(backward), S.clone().requires_grad_(backward)
        M = fn(a, b)
        if backward:
            M.backward(gM)
        return M.detach(), a.grad, b.grad

    for name, fn in fns.items():
        f_ms = timed(lambda fn=fn: spline_run(fn, backward=False), args.reps, device)
        fb_ms = timed(lambda fn=fn: spline_run(fn), args.reps, device)
        res[f"spline/{name}/forward"], res[f"spline/{name}/forward_backward"] = f_ms, fb_ms
        print(f"    spline product alone, {name:6s}: forward {f_ms:8.2f} ms, forward + backward {fb_ms:8.2f} ms")
    if not usable:
        print(f"LEV kernel check: skipped ({why})")
        out["check"] = {"ok": None, "why": why}
        return
    got, ref = spline_run(fns["triton"]), spline_run(fns["torch"])
    check = {name: rel_diff(a, b) for name, a, b in zip(("M", "grad_u", "grad_S"), got, ref)}
    fp32 = {}
    for kernel in ("torch", "triton"):  # the whole layer, fp32 parameters and GEMM
        lay, _, ids32, g32 = build(args.scale, args.tp, device, args.tokens, over=[f"model.lev.kernel={kernel}"])
        rows = lay(ids32)
        params = dict(lay.named_parameters())
        grads = torch.autograd.grad((rows * g32).sum(), list(params.values()))
        fp32[kernel] = (rows.detach(), dict(zip(params, grads)))
    check["rows"] = rel_diff(fp32["triton"][0], fp32["torch"][0])
    grads = {n: rel_diff(fp32["triton"][1][n], g) for n, g in fp32["torch"][1].items()}
    worst = max(grads, key=grads.get)
    check["param_grad"], check["param_grad_worst"] = grads[worst], worst
    ok = all(v <= args.check_tol for k, v in check.items() if k != "param_grad_worst")
    out["check"] = {**check, "tol": args.check_tol, "ok": ok}
    print(
        f"LEV kernel check: spline product ({u.shape[0]} ids) M {check['M']:.2e}, grad_u {check['grad_u']:.2e}, "
        f"grad_S {check['grad_S']:.2e}; layer rows {check['rows']:.2e}, parameter gradients {grads[worst]:.2e} "
        f"(worst: {worst}); fp32, max |triton - torch| / max |torch|, tolerance {args.check_tol:g}: "
        f"{'ok' if ok else 'FAILED'}"
    )


def sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, reps: int, device) -> float:
    """Median ms of ``fn()`` (device-synchronised before and after), after ``WARMUP`` warm-up calls."""
    for _ in range(WARMUP[0]):
        fn()
    out = []
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def main():
    import torch
    import torch.nn.functional as F

    from leviathan_pretrain.model.inputs import check_token_ids

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", choices=sorted(SCALES), default="400m")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size: one rank's heads (8 / tp)")
    ap.add_argument("--chunk-mib", default="48,128,256,512,1024")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--queued-ms", type=float, default=30.0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--trace", help="write a torch.profiler chrome trace of 3 LEV micro-batches here")
    ap.add_argument("--tokens", type=int, help="tokens in the micro-batch (default: the scale's)")
    ap.add_argument("--check-tol", type=float, default=1e-5, help="the kernel check's relative tolerance")
    ap.add_argument("--dry", action="store_true", help="a smoke test: a tiny LEV, 48 tokens, 1 rep, 1 warm-up")
    ap.add_argument("--json", help="also write the numbers to this file")
    args = ap.parse_args()
    if args.dry:
        args.scale, args.reps, args.chunk_mib, args.queued_ms = "dry", 1, "48,512", 2.0
        WARMUP[0] = 1
    device = torch.device(args.device)
    out = {"scale": args.scale, "tp": args.tp, "device": str(device)}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    layer, table, ids, grad = build(args.scale, args.tp, device, args.tokens)
    uniq, inverse = torch.unique(ids, return_inverse=True)
    print(
        f"LEV input path, scale {args.scale} (D {layer.hidden_size}, V {layer.vocab_size}), heads/rank "
        f"{layer.heads_local}, {ids.numel()} tokens, {uniq.numel()} unique ids, {device}"
    )

    def lev_step():
        layer(ids).backward(grad)

    def lev_step_no_sync():  # the same kernels as layer.forward, the unique ids known beforehand
        check_token_ids(ids, layer.vocab_size)
        rows = layer.compute_rows(uniq, record=True)
        layer._finish(rows, partial=layer.partial_over_tp, indexed=False, inverse=inverse).backward(grad)

    def tied_step():
        F.embedding(ids.t(), table).backward(grad)

    # (1) chunk budgets
    default_chunk = layer.chunk_for(device)
    print(f"(1) forward + backward, ms per micro-batch (median of {args.reps}); default chunk {default_chunk} ids")
    tied_ms = timed(tied_step, args.reps, device)
    print(f"    TIED table lookup: {tied_ms:.2f} ms")
    out.update(unique_ids=uniq.numel(), tokens=ids.numel(), tied_ms=tied_ms, chunk_mib={})
    layer.lev.kernel, layer.lev.gemm_dtype = "torch", "fp32"  # (1) is the torch path's chunk budget, as before
    for mib in [float(x) for x in args.chunk_mib.split(",")]:
        layer.lev.chunk_mib = mib
        chunk = layer.chunk_for(device)
        ms = timed(lev_step, args.reps, device)
        chunks = -(-uniq.numel() // chunk)
        out["chunk_mib"][f"{mib:g}"] = ms
        print(f"    LEV chunk_mib {mib:6g}: {chunk:5d} ids/chunk, {chunks:3d} chunks: {ms:.2f} ms")
    layer.lev.chunk_mib = None
    layer.lev.kernel, layer.lev.gemm_dtype = "auto", "auto"  # (2)-(4): the defaults (the kernel on CUDA)

    # (1b) the kernel and the output GEMM's dtype
    kernel_section(args, device, out)

    # (2) the sync's cost behind queued work
    w = torch.randn(2048, 2048, device=device)
    x = torch.randn(2048, 2048, device=device)
    sync(device)
    t = time.perf_counter()
    for _ in range(10):
        x = x @ w
    sync(device)
    per = max(1e-3, (time.perf_counter() - t) * 1e3 / 10)
    n_mm = max(1, int(args.queued_ms / per))

    def behind(fn):
        def run():
            y = x
            for _ in range(n_mm):
                y = y @ w
            fn()

        return run

    queued = timed(behind(lambda: None), args.reps, device)
    with_sync = timed(behind(lev_step), args.reps, device)
    without = timed(behind(lev_step_no_sync), args.reps, device)
    out["sync"] = {"queued_ms": queued, "with_sync_ms": with_sync - queued, "without_ms": without - queued}
    print(
        f"(2) behind {queued:.1f} ms of queued GPU work: LEV fwd + bwd {with_sync - queued:.2f} ms as run "
        f"(torch.unique syncs), {without - queued:.2f} ms with the unique ids known (no sync): the sync costs "
        f"{with_sync - without:+.3f} ms per micro-batch"
    )

    # (3) syncs counted by CUDA
    if device.type == "cuda":
        for name, fn in (("LEV", lev_step), ("TIED", tied_step)):
            torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                fn()
            torch.cuda.set_sync_debug_mode("default")
            syncs = [str(c.message).splitlines()[0] for c in caught if "synchroniz" in str(c.message)]
            print(f"(3) {name}: {len(syncs)} host synchronisation(s) per micro-batch {syncs[:3]}")
    if args.trace:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            for _ in range(3):
                behind(lev_step)()
            sync(device)
        Path(args.trace).mkdir(parents=True, exist_ok=True)
        out = Path(args.trace) / f"lev-{args.scale}-tp{args.tp}.json"
        prof.export_chrome_trace(str(out))
        print(f"(4) trace: {out}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"numbers: {args.json}")


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    main()
