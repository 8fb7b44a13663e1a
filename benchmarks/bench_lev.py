"""LEV efficiency, side by side in one run (CPU):

(a) step time of the ``tiny-cpu`` model, forward + backward + AdamW step, LEV / TIED (target <= 1.10),
    interleaved A-B-B-A repetitions on the same batch, one torch thread by default. The machine is shared
    and wall times swing by 2-4x, so the headline ratio uses the process's CPU time (``process_time``, which
    does not count time the process waits for a core) as the median of the ratios of back-to-back pairs
    (steps of one model still swing by +-15% here; a pair shares the machine's state); the medians' ratio,
    wall-time medians and best-of-N are shown too, and the input layer's own forward + backward (the only
    part of the step that differs) is timed alone over many short interleaved reps.
    Also shown: LEV with the spec's default hyper-parameters (d_seed=128, h=8, r=64) on the same tiny model,
    in its own A-B run against TIED (its ~1 GB of per-step work buffers, freed and re-faulted, would slow
    whichever step follows it).
(b) peak memory of the LEV layer's forward + backward for 16k tokens (V=50,257, D=1,024, spec defaults)
    against the same layer done naively (tests/lev_reference.py: per token, dense basis, no unique ids, no
    chunking) and against a dense ``V x D`` table. Each case runs in a fresh subprocess and reports
    ``VmHWM`` (peak resident set) minus the resident set just before the forward (parameters, inputs
    and imports excluded; PyTorch's CPU allocator returns large blocks to the OS, so RSS tracks live tensors).
    The naive layer needs ~1.3 MB per token: it is measured at 1k / 2k tokens and extrapolated linearly to
    16k (flagged), since 16k tokens would need ~20 GiB on this 24 GiB shared machine.
(c) the efficient path against the readable reference: max |difference| of outputs (tolerance 1e-5) and
    of every parameter gradient (relative to its largest entry, 1e-5), with an fp64 reference as ground
    truth. (``materialize()`` == the per-token path is asserted in tests/test_lev.py.)

Token ids are drawn from a Zipf(1) distribution over a random permutation of the vocabulary (text-like:
many repeats), seeded; the number of unique ids is printed.

    python benchmarks/bench_lev.py [--reps 21] [--mem-reps 2] [--only a,b,c] [--chunk-mib MIB]

``--chunk-mib`` sets ``model.lev.chunk_mib`` (the spline product's work memory per chunk; default: the
device's, 48 MiB on the CPU) for every LEV case.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_memory import rss_bytes, status_kb  # noqa: E402

MEM_V, MEM_D, MEM_TOKENS = 50257, 1024, 16384
NAIVE_POINTS = (1024, 2048)
LEV_OVERRIDES: list[str] = []  # extra model.lev.* overrides for every LEV case (--chunk-mib)


def zipf_ids(shape, vocab: int, seed: int):
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    p = 1.0 / (np.arange(vocab) + 2.7)
    ids = rng.permutation(vocab)[rng.choice(vocab, size=shape, p=p / p.sum())]
    return torch.from_numpy(ids).long()


# -- (a) step time -----------------------------------------------------------------------------------
def bench_step_time(reps: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from megatron.core import parallel_state as ps

    from leviathan_pretrain.config import load_config
    from leviathan_pretrain.model.assembly import build_model
    from leviathan_pretrain.model.settings import BuildSettings
    from leviathan_pretrain.parallel.groups import init_distributed, seed_everything

    cases = {
        "tied": load_config(REPO / "configs/tiny-cpu-tied.yaml"),
        "lev": load_config(REPO / "configs/tiny-cpu-lev.yaml", LEV_OVERRIDES),
        "lev(spec d128 h8 r64)": load_config(
            REPO / "configs/tiny-cpu-lev.yaml",
            ["model.lev.seed_dim=128", "model.lev.heads=8", "model.lev.rank=64", *LEV_OVERRIDES],
        ),
    }
    cfg = cases["tied"]
    env = init_distributed(cfg.parallel)
    b, s, V = cfg.train.micro_batch_size, cfg.model.seq_length, cfg.model.vocab_size
    ids = zipf_ids((b, s + 1), V, seed=0)
    x, y, pos = ids[:, :-1], ids[:, 1:], torch.arange(s)[None].expand(b, s)
    models, opts = {}, {}
    for name, c in cases.items():
        seed_everything(1234, env.device)
        models[name] = build_model(
            c.model,
            BuildSettings.from_parallel(c.parallel, tp_group=ps.get_tensor_model_parallel_group(), device=env.device),
        )
        opts[name] = torch.optim.AdamW(models[name].parameters(), lr=1e-4)

    def step(name):
        t, c = time.perf_counter(), time.process_time()
        loss = models[name](x, pos, None, labels=y).mean()
        loss.backward()
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)
        return time.perf_counter() - t, time.process_time() - c

    def measure(names):
        """Interleaved A-B-B-A reps of ``names`` after 2 warm-up steps each; per-step (wall, cpu) lists."""
        for n in names:  # warm-up (allocator, first-call overheads)
            step(n)
            step(n)
        wall, cpu = {n: [] for n in names}, {n: [] for n in names}
        for r in range(reps):
            for n in names if r % 2 == 0 else names[::-1]:
                w, c = step(n)
                wall[n].append(w)
                cpu[n].append(c)
        return wall, cpu

    # The headline pair alone: the spec-default case frees ~1 GB per step, and the step after it pays the
    # page faults of re-growing the heap; it gets its own run against TIED afterwards.
    wall, cpu = measure(["tied", "lev"])
    spec = "lev(spec d128 h8 r64)"
    wall_s, cpu_s = measure(["tied", spec])
    wall[spec], cpu[spec] = wall_s[spec], cpu_s[spec]
    ref_cpu = {n: cpu_s["tied"] if n == spec else cpu["tied"] for n in cpu}
    ref_wall = {n: wall_s["tied"] if n == spec else wall["tied"] for n in cpu}
    names = list(cpu)
    layer = bench_input_layers(models, x, pos, reps=10 * reps)
    med = {n: statistics.median(t) for n, t in cpu.items()}
    med_wall = {n: statistics.median(t) for n, t in wall.items()}
    best = {n: min(t) for n, t in wall.items()}
    pair = {n: statistics.median(a / b for a, b in zip(cpu[n], ref_cpu[n])) for n in names}
    return {
        "tokens_per_step": b * s,
        "unique_ids": int(x.unique().numel()),
        "threads": threads,
        "wall": wall,
        "cpu": cpu,
        "median_cpu": med,
        "median_wall": med_wall,
        "best_wall": best,
        "ratio_cpu": {n: med[n] / statistics.median(ref_cpu[n]) for n in names},
        "ratio_pairs_cpu": pair,
        "ratio_wall": {n: med_wall[n] / statistics.median(ref_wall[n]) for n in names},
        "ratio_best_wall": {n: best[n] / min(ref_wall[n]) for n in names},
        "input_layer": layer,
    }


def bench_input_layers(models, x, pos, reps: int) -> dict:
    """CPU ms of the input layer's forward + backward alone (TIED's table lookup vs LEV), interleaved: the
    part of the step that differs, measured over many short reps (far less noisy than whole steps)."""
    import torch

    grads = torch.randn(x.shape[1], x.shape[0], models["tied"].config.hidden_size)
    times = {"tied": [], "lev": []}
    for r in range(reps + 3):
        for n in ("tied", "lev") if r % 2 == 0 else ("lev", "tied"):
            c = time.process_time()
            models[n].input_layer(x, pos).backward(grads)
            if r >= 3:
                times[n].append(time.process_time() - c)
    for m in models.values():
        m.zero_grad(set_to_none=True)
    return {n: statistics.median(t) for n, t in times.items()}


# -- (b) peak memory, one case per fresh process ---------------------------------------------------------
def _lev_layer():
    import torch

    from leviathan_pretrain.config import load_config
    from leviathan_pretrain.model.gpt import build_transformer_config
    from leviathan_pretrain.model.lev import LEVInput
    from leviathan_pretrain.model.settings import BuildSettings

    cfg = load_config(
        None,
        [
            f"model.vocab_size={MEM_V}",
            f"model.hidden_size={MEM_D}",
            "model.num_attention_heads=16",
            "parallel.device=cpu",
            "parallel.precision=fp32",
            *LEV_OVERRIDES,
        ],
    )
    torch.manual_seed(0)
    return LEVInput(build_transformer_config(cfg.model, BuildSettings.from_parallel(cfg.parallel)), cfg.model)


def memory_case(case: str, tokens: int) -> dict:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    if case == "uniform":
        ids = torch.randint(0, MEM_V, (1, tokens))
    else:
        ids = zipf_ids((1, tokens), MEM_V, seed=1)
    if case in ("lev", "uniform", "naive"):
        layer = _lev_layer()
        if case == "naive":
            from tests.lev_reference import lev_reference_from_layer

            fn = lambda: lev_reference_from_layer(layer, ids.reshape(-1))  # noqa: E731
        else:
            fn = lambda: layer(ids)  # noqa: E731
        params = sum(p.numel() for p in layer.parameters())
    else:  # dense V x D table, as a TIED/UNTIED input (its gradient is a dense V x D tensor on CPU)
        table = torch.nn.Parameter(torch.randn(MEM_V, MEM_D) * 0.02)
        fn = lambda: F.embedding(ids.t(), table)  # noqa: E731
        params = table.numel()
    w = torch.randn(tokens, MEM_D)
    gc.collect()
    before = rss_bytes()
    t, c = time.perf_counter(), time.process_time()
    out = fn()
    (out.reshape(tokens, MEM_D) * w).sum().backward()
    elapsed, cpu = time.perf_counter() - t, time.process_time() - c
    peak = status_kb("VmHWM") * 1024  # this process's peak (ru_maxrss would also keep the parent's, before exec)
    return {
        "case": case,
        "tokens": tokens,
        "unique": int(ids.unique().numel()),
        "param_bytes": params * 4,
        "peak_delta": peak - before,
        "seconds": elapsed,
        "cpu_seconds": cpu,
    }


def run_memory_case(case: str, tokens: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, __file__, "--_mem", case, "--_tokens", str(tokens), *chunk_args()],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"memory case {case}@{tokens} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def chunk_args() -> list[str]:
    """``--chunk-mib`` again for a memory-case subprocess."""
    return [f"--chunk-mib={o.split('=', 1)[1]}" for o in LEV_OVERRIDES if o.startswith("model.lev.chunk_mib=")]


def bench_memory(reps: int) -> dict:
    plan = [("lev", MEM_TOKENS), ("uniform", MEM_TOKENS), ("dense", MEM_TOKENS)] + [("naive", n) for n in NAIVE_POINTS]
    runs = {p: [] for p in plan}
    for _ in range(reps):  # interleaved repetitions, fresh process each
        for p in plan:
            runs[p].append(run_memory_case(*p))
    out = {}
    for (case, n), rs in runs.items():
        r = dict(rs[0])
        r["peak_delta"] = statistics.median(x["peak_delta"] for x in rs)
        r["seconds"] = statistics.median(x["seconds"] for x in rs)
        r["cpu_seconds"] = statistics.median(x["cpu_seconds"] for x in rs)
        out[f"{case}@{n}"] = r
    (n1, n2) = NAIVE_POINTS
    m1, m2 = out[f"naive@{n1}"]["peak_delta"], out[f"naive@{n2}"]["peak_delta"]
    slope = (m2 - m1) / (n2 - n1)
    out["naive@16384(extrapolated)"] = {"peak_delta": m2 + slope * (MEM_TOKENS - n2), "per_token": slope}
    return out


# -- (c) equality with the readable reference ------------------------------------------------------------
def bench_equality(tokens: int = 512) -> dict:
    """Efficient fp32 path vs the readable reference (fp32, and fp64 as ground truth)."""
    import torch

    from tests.lev_reference import lev_reference_from_layer

    layer = _lev_layer()
    ids = zipf_ids((1, tokens), MEM_V, seed=2)
    ids[0, :4] = torch.tensor([0, MEM_V - 1, 37**2, 36])  # edge ids
    flat = ids.reshape(-1)
    out = layer(ids).reshape(tokens, MEM_D)
    ref = lev_reference_from_layer(layer, flat)
    layer64 = _lev_layer().double()
    ref64 = lev_reference_from_layer(layer64, flat)
    w = torch.randn(tokens, MEM_D, generator=torch.Generator().manual_seed(0))
    params, params64 = dict(layer.named_parameters()), dict(layer64.named_parameters())
    g_out = torch.autograd.grad((out * w).sum(), list(params.values()))
    g_ref = torch.autograd.grad((ref * w).sum(), list(params.values()))
    g_64 = torch.autograd.grad((ref64 * w.double()).sum(), list(params64.values()))
    rel = lambda a, b: float((a.double() - b).abs().max() / b.abs().max())  # noqa: E731
    return {
        "tokens": tokens,
        "unique": int(flat.unique().numel()),
        "out_max_abs": float(out.detach().abs().max()),
        "forward_max_diff": float((out - ref).abs().max()),
        "forward_max_diff_fp64": float((out.double() - ref64).abs().max()),
        "forward_fp32_ref_vs_fp64": float((ref.double() - ref64).abs().max()),
        "grad_rel_diff": {n: rel(a, c) for n, a, c in zip(params, g_out, g_64)},
        "grad_rel_fp32_ref": {n: rel(b, c) for n, b, c in zip(params, g_ref, g_64)},
    }


# -- report ------------------------------------------------------------------------------------------
def mib(x):
    return f"{x / 2**20:,.0f} MiB"


def report_a(r):
    print(
        f"(a) tiny-cpu training step (fwd + bwd + AdamW), {r['tokens_per_step']} tokens/step, "
        f"{r['unique_ids']} unique ids, {r['threads']} thread(s); {len(r['cpu']['tied'])} interleaved reps (the "
        "spec-default case in its own run against TIED). "
        "CPU time of the process (robust to other jobs on the machine) and wall time:"
    )
    for n in r["median_cpu"]:
        print(
            f"    {n:<22} CPU median {r['median_cpu'][n] * 1e3:7.0f} ms  ratio {r['ratio_cpu'][n]:.3f} "
            f"(paired {r['ratio_pairs_cpu'][n]:.3f}) | wall median {r['median_wall'][n] * 1e3:7.0f} ms "
            f"ratio {r['ratio_wall'][n]:.3f}, best-of {r['best_wall'][n] * 1e3:6.0f} ms "
            f"ratio {r['ratio_best_wall'][n]:.3f}"
        )
    li = r["input_layer"]
    extra = (li["lev"] - li["tied"]) / r["median_cpu"]["tied"]
    print(
        f"    input layer alone, fwd + bwd (the part that differs): TIED {li['tied'] * 1e3:.1f} ms, LEV "
        f"{li['lev'] * 1e3:.1f} ms = {extra * 100:+.1f}% of a TIED step"
    )
    ratio = r["ratio_pairs_cpu"]["lev"]
    ok = ratio <= 1.10
    print(
        f"    LEV / TIED = {ratio:.3f} (median of back-to-back pairs' CPU-time ratios; medians' ratio "
        f"{r['ratio_cpu']['lev']:.3f}; target <= 1.10: {'met' if ok else 'NOT met'})"
    )


def report_b(r):
    print(
        f"(b) peak memory of forward + backward, V={MEM_V}, D={MEM_D}, LEV spec defaults "
        f"(VmHWM - RSS before the forward, fresh 1-thread process per case, median of reps)"
    )
    lev, uni, dense = r[f"lev@{MEM_TOKENS}"], r[f"uniform@{MEM_TOKENS}"], r[f"dense@{MEM_TOKENS}"]
    naive = r["naive@16384(extrapolated)"]
    print(
        f"    LEV efficient, {MEM_TOKENS} tokens ({lev['unique']} unique, Zipf): {mib(lev['peak_delta'])}  "
        f"[{lev['cpu_seconds']:.1f} CPU s; params {mib(lev['param_bytes'])}]"
    )
    print(
        f"    LEV efficient, {MEM_TOKENS} tokens ({uni['unique']} unique, uniform): {mib(uni['peak_delta'])}  "
        f"[{uni['cpu_seconds']:.1f} CPU s]"
    )
    for n in NAIVE_POINTS:
        k = r[f"naive@{n}"]
        print(f"    LEV naive (reference), {n} tokens: {mib(k['peak_delta'])}  [{k['cpu_seconds']:.1f} CPU s]")
    print(
        f"    LEV naive (reference), {MEM_TOKENS} tokens: ~{mib(naive['peak_delta'])}  "
        f"(EXTRAPOLATED linearly, {naive['per_token'] / 2**20:.2f} MiB/token)"
    )
    print(
        f"    dense V x D table, {MEM_TOKENS} tokens: {mib(dense['peak_delta'])}  [params {mib(dense['param_bytes'])}]"
    )
    print(
        f"    naive / efficient = {naive['peak_delta'] / lev['peak_delta']:.0f}x ; "
        f"efficient / dense = {lev['peak_delta'] / dense['peak_delta']:.2f}"
    )


def report_c(r):
    worst = max(r["grad_rel_diff"], key=r["grad_rel_diff"].get)
    floor = max(r["grad_rel_fp32_ref"].values())
    ok = r["forward_max_diff"] < 1e-5 and r["grad_rel_diff"][worst] < 1e-5
    print(
        f"(c) efficient path vs the readable reference (tests/lev_reference.py), {r['tokens']} tokens "
        f"({r['unique']} unique), V={MEM_V}, D={MEM_D}, spec defaults:"
    )
    print(
        f"    forward: max |efficient - reference| = {r['forward_max_diff']:.2e} (|G| <= {r['out_max_abs']:.2f}); "
        f"vs an fp64 reference {r['forward_max_diff_fp64']:.2e} (the fp32 reference itself: "
        f"{r['forward_fp32_ref_vs_fp64']:.2e})"
    )
    print(
        f"    gradients: max |diff| / max |grad| vs fp64 = {r['grad_rel_diff'][worst]:.2e} ({worst}); "
        f"the fp32 reference's own: {floor:.2e}"
    )
    print(f"    -> {'PASS' if ok else 'FAIL'} (forward 1e-5 absolute, gradients 1e-5 relative)")


def main():
    ap = argparse.ArgumentParser(description="LEV efficiency benchmark")
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for (a) (1: no OpenMP barrier stalls when another job takes a core)",
    )
    ap.add_argument("--mem-reps", type=int, default=2)
    ap.add_argument("--only", default="a,b,c")
    ap.add_argument("--json", help="also write the raw results here")
    ap.add_argument("--chunk-mib", type=float, help="model.lev.chunk_mib for every LEV case (default: per device)")
    ap.add_argument("--_mem", help=argparse.SUPPRESS)
    ap.add_argument("--_tokens", type=int, default=MEM_TOKENS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.chunk_mib is not None:
        LEV_OVERRIDES.append(f"model.lev.chunk_mib={args.chunk_mib}")
    if args._mem:
        print(json.dumps(memory_case(args._mem, args._tokens)))
        return
    parts = set(args.only.split(","))
    results = {}
    if "b" in parts:
        results["b"] = bench_memory(args.mem_reps)
        report_b(results["b"])
    if "c" in parts:
        results["c"] = bench_equality()
        report_c(results["c"])
    if "a" in parts:
        results["a"] = bench_step_time(args.reps, args.threads)
        report_a(results["a"])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    if "a" in parts:
        from leviathan_pretrain.parallel.groups import destroy_distributed

        destroy_distributed()


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    main()
