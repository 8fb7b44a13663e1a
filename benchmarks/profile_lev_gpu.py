"""LEV's input path on a GPU (issue 19): the chunk budget and the one host synchronisation (``torch.unique``).

At a scale's shapes (V = 200,019, spec LEV defaults, one rank's heads = 8 / --tp, one micro-batch of Zipf ids):

(1) forward + backward of the LEV input layer alone for each ``model.lev.chunk_mib`` in --chunk-mib (ms per
    micro-batch, median of --reps, device-synchronised), and of the TIED input (a ``V x D`` table lookup);
(2) what the sync costs: the same forward + backward queued behind ~--queued-ms of GPU work (a matmul chain
    standing in for the previous micro-batch's backward), once as the layer runs (the host waits for
    ``torch.unique``'s size, so the GPU idles while the host launches what follows) and once with the unique
    ids computed beforehand (the same kernels, no sync); the difference is the sync's cost per micro-batch.
    In training the engine's blocking ``.to(device)`` of the micro-batch already drains the queue, so this is
    an upper bound;
(3) host synchronisations per micro-batch counted by CUDA's sync debug mode: LEV expects 1, the table 0;
(4) --trace DIR: a torch.profiler chrome trace of 3 LEV micro-batches at the default budget.

    python benchmarks/profile_lev_gpu.py --scale 400m [--tp 1] [--chunk-mib 48,128,256,512,1024] [--reps 20]

``--device cpu`` runs (1) and (2) on the CPU (a smoke test; the numbers mean nothing for a GPU).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_lev import zipf_ids  # noqa: E402

SCALES = {"400m": (1024, 16 * 512), "1.2b": (2048, 8 * 512), "tiny": (256, 8 * 256)}  # D, micro-batch tokens
VOCAB = 200_019


def build(scale: str, tp: int, device):
    import torch

    from leviathan_pretrain.config import load_config
    from leviathan_pretrain.model import BuildSettings, build_transformer_config
    from leviathan_pretrain.model.lev import LEVInput

    D, tokens = SCALES[scale]
    over = [f"model.hidden_size={D}", "model.num_attention_heads=16", f"model.lev.heads={8 // tp}"]
    if scale == "tiny":  # a CPU smoke test: the tiny-cpu LEV (d_seed 32, r 16)
        over += ["model.lev.seed_dim=32", "model.lev.rank=16"]
    V = VOCAB if scale != "tiny" else 8000
    cfg = load_config(None, [f"model.vocab_size={V}", *over])
    torch.manual_seed(0)
    layer = LEVInput(build_transformer_config(cfg.model, BuildSettings(device="cpu")), cfg.model).to(device)
    table = torch.nn.Parameter(0.02 * torch.randn(V, D, device=device))
    ids = zipf_ids((tokens // 512 if tokens >= 512 else 1, min(tokens, 512)), V, seed=0).to(device)
    grad = torch.randn(ids.shape[1], ids.shape[0], D, device=device)
    return layer, table, ids, grad


def sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, reps: int, device) -> float:
    """Median ms of ``fn()`` (device-synchronised before and after), after 2 warm-up calls."""
    for _ in range(2):
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
    args = ap.parse_args()
    device = torch.device(args.device)
    layer, table, ids, grad = build(args.scale, args.tp, device)
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
    for mib in [float(x) for x in args.chunk_mib.split(",")]:
        layer.lev.chunk_mib = mib
        chunk = layer.chunk_for(device)
        ms = timed(lev_step, args.reps, device)
        chunks = -(-uniq.numel() // chunk)
        print(f"    LEV chunk_mib {mib:6g}: {chunk:5d} ids/chunk, {chunks:3d} chunks: {ms:.2f} ms")
    layer.lev.chunk_mib = None

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


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    main()
