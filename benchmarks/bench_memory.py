"""The per-rank memory estimate (``leviathan_pretrain.plan.planner``) against the real trainer's measured peak, on CPU.

    python benchmarks/bench_memory.py [--variants lev tied] [--zero 0 1] [--tp 1 2] [--recompute none full ...]
        [--sp off on]
        [key=value ...]
    python benchmarks/bench_memory.py --loss [--vocab 200064 --hidden 512 --micro 8 --seq 256 --pairs 3]

Each case trains a small-but-not-tiny model (default: hidden 512, 8 layers, 8 heads, vocabulary 32,000,
sequence 256, micro batch 8 x accumulation 2, fp32, 2 optimizer steps) with the real trainer
(``python -m leviathan_pretrain.train --config configs/tiny-cpu-<variant>.yaml ...``, under
``launchers/local.py -n TP``) on a synthetic Zipf shard (``bench_train.write_zipf_shard``), for LEV and TIED
at ZeRO 0 and 1, TP = 1 (and TP = 2 with ``--tp 1 2``; ``--dp 2`` runs two data-parallel replicas, and
``--micro 1 --seq 64`` makes the optimizer step, not the activations, the peak). The trainer is not changed:
the worker wraps the names ``trainer.loop`` calls (``build_engine``, the engine's ``train_step``,
``Trainer.save``) to read ``/proc/self`` at these points:

- **baseline**: the resident set (RSS) right before the engine is built (imports, process groups, start-up
  checks: nothing the estimate counts). The high-water mark (VmHWM) is reset there (``/proc/self/clear_refs``).
- **after step**: RSS after each optimizer step, minus the baseline: what stays between steps (weights,
  optimizer states, and whatever gradients the optimizer keeps).
- **peak**: VmHWM at the end of the last step (before the final checkpoint is written), minus the
  baseline: the training peak, compared with the estimate's ``total``.

``--sp off on`` repeats every case at TP >= 2 with ``parallel.sequence_parallel`` off and on (docs/training.md,
"Memory levers": SP divides the norms' and residuals' activations by TP).

``--recompute MODE ...`` repeats every case per ``model.recompute`` mode: ``none``, ``selective`` (megatron's default
module, the core attention), ``selective:mlp`` (or ``selective:core_attn,mlp``), ``full``, ``full:N`` (the first N
layers); the estimate counts what each keeps (docs/training.md, "Memory levers").

``MALLOC_MMAP_THRESHOLD_=65536`` is set for the ranks so that every tensor above 64 KiB is its own mapping,
returned to the OS when freed: RSS then follows live tensors (as the CUDA allocator's allocated bytes do)
instead of glibc's heap high-water. Only the CPU-applicable parts are checkable here: the CPU estimate has
no runtime allowance (CUDA context, NCCL), uses SDPA attention (no s^2 softmax term) and counts only the
touched part of DeepSpeed's bucket; the GPU-only terms are not measured. Each rank reports; the largest is
shown (TP ranks are alike).

``--loss`` measures the loss path alone, side by side: ``model.loss_impl=fused`` (model/loss.py) against
``megatron`` (``vocab_parallel_cross_entropy`` on the full logits), each in its own process (a clean VmHWM),
alternating A/B for ``--pairs`` pairs. A process holds the head weight ``[V, D]``, the hidden states
``[s, b, D]`` and their ``.grad`` (preallocated: the model's gradients, not the loss path's), resets VmHWM, and
runs ``--steps`` forward + backward steps of the head and loss (``model.head.head_forward`` with a
``LossRequest``: what the trainer runs). Printed per pair: the peak above that baseline and the median step
time, and the megatron/fused ratios of both.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

GIB = 2**30


# ---------------------------------------------------------------- worker: the real trainer, observed


def status_kb(key: str) -> int:
    return int(re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def worker(train_args: list[str]) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    from leviathan_pretrain import train
    from leviathan_pretrain.trainer import loop

    rec = {"rank": int(os.environ.get("RANK", "0")), "after_step": [], "peak_step": []}
    real_build = loop.build_engine
    real_save = loop.Trainer.save

    def build_engine(cfg, device):
        rec["baseline"] = rss_bytes()
        _reset_peak()
        eng = real_build(cfg, device)
        rec["after_build"] = rss_bytes() - rec["baseline"]
        real_step = eng.train_step

        def train_step(mbs):
            out = real_step(mbs)
            rec["after_step"].append(rss_bytes() - rec["baseline"])
            rec["peak_step"].append(status_kb("VmHWM") * 1024 - rec["baseline"])
            return out

        eng.train_step = train_step
        return eng

    def save(self):
        rec.setdefault("peak", status_kb("VmHWM") * 1024 - rec["baseline"])
        return real_save(self)

    loop.build_engine = build_engine
    loop.Trainer.save = save
    code = train.main(train_args)
    out = Path(os.environ["BENCH_MEMORY_OUT"]) / f"rank{rec['rank']}.json"  # a file each: ranks' stdout interleave
    out.write_text(json.dumps(rec))
    return code


# ---------------------------------------------------------------- --loss: the loss path alone


def loss_worker(impl: str, args) -> dict:
    import torch

    from leviathan_pretrain.model import sizes
    from leviathan_pretrain.model.head import HeadOptions, LossRequest, head_forward
    from leviathan_pretrain.parallel.groups import one_process_group

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.precision]
    b, s, D, V = args.micro, args.seq, args.hidden, args.vocab
    torch.manual_seed(0)
    with one_process_group():  # megatron's loss all-reduces over its (one-rank) tensor-parallel group
        from megatron.core import parallel_state as ps

        ps.initialize_model_parallel(1)
        weight = (0.02 * torch.randn(V, D)).to(dtype).requires_grad_()
        hidden = torch.randn(s, b, D).to(dtype).requires_grad_()
        labels = torch.randint(0, V, (b, s))
        mask = torch.ones(b, s)
        weight.grad, hidden.grad = torch.zeros_like(weight), torch.zeros_like(hidden)
        opts = HeadOptions(impl, sizes.loss_chunk_tokens(V, "cpu", args.loss_chunk))
        baseline = rss_bytes()
        _reset_peak()
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            head_forward(LossRequest(hidden, labels, mask), weight, None, opts).backward()
            times.append(time.perf_counter() - t0)
        peak = status_kb("VmHWM") * 1024 - baseline
        ps.destroy_model_parallel()
    return {"impl": impl, "peak": peak, "step": sorted(times)[len(times) // 2], "chunk": opts.chunk}


def loss_bench(args) -> int:
    rows = []
    for pair in range(args.pairs):
        got = {}
        for impl in ("megatron", "fused"):
            cmd = [sys.executable, str(Path(__file__).resolve()), "--loss-worker", impl, *sys.argv[1:]]
            env = dict(os.environ, PYTHONPATH=str(REPO), MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="2")
            p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
            line = [x for x in p.stdout.splitlines() if x.startswith("LOSS ")]
            if p.returncode or not line:
                sys.exit(
                    f"error: the {impl} loss worker failed (exit {p.returncode}):\n"
                    f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
                )
            got[impl] = json.loads(line[0][5:])
        rows.append(got)
        m, f = got["megatron"], got["fused"]
        print(
            f"pair {pair + 1}: megatron peak {m['peak'] / GIB:.3f} GiB, step {m['step']:.2f} s | fused (chunk "
            f"{f['chunk']}) peak {f['peak'] / GIB:.3f} GiB, step {f['step']:.2f} s | memory ratio "
            f"{m['peak'] / f['peak']:.2f}x, step-time ratio fused/megatron {f['step'] / m['step']:.3f}",
            flush=True,
        )
    mem = sorted(r["megatron"]["peak"] / r["fused"]["peak"] for r in rows)
    fresh = args.vocab * args.hidden * (4 if args.precision == "fp32" else 2)  # autograd's new head-weight gradient
    own = sorted((r["megatron"]["peak"] - fresh) / max(1, r["fused"]["peak"] - fresh) for r in rows)
    tim = sorted(r["fused"]["step"] / r["megatron"]["step"] for r in rows)
    T = args.micro * args.seq
    print(
        f"loss path, V {args.vocab:,}, D {args.hidden}, {T:,} tokens ({args.micro} x {args.seq}), {args.precision}, "
        f"{args.steps} steps a process, {args.pairs} pairs: peak memory megatron/fused {mem[len(mem) // 2]:.2f}x "
        f"(range {mem[0]:.2f}-{mem[-1]:.2f}); step time fused/megatron {tim[len(tim) // 2]:.3f} "
        f"(range {tim[0]:.3f}-{tim[-1]:.3f}; < 1 is faster)\n"
        f"both peaks include the head weight's fresh gradient ({fresh / GIB:.3f} GiB: V x D, which both paths make "
        f"before it is added into .grad); without it, the loss path's own peak megatron/fused {own[len(own) // 2]:.2f}x"
    )
    return 0


# ---------------------------------------------------------------- driver


def case_overrides(args, variant: str, zero: int, tp: int, data: str, out_dir: str) -> list[str]:
    return [
        f"model.vocab_size={args.vocab}",
        f"model.hidden_size={args.hidden}",
        f"model.num_layers={args.layers}",
        f"model.num_attention_heads={args.heads}",
        f"model.seq_length={args.seq}",
        "model.lev.seed_dim=128",  # the spec's defaults (the tiny-cpu configs scale LEV down for D = 256)
        "model.lev.heads=8",
        "model.lev.knots=16",
        "model.lev.rank=64",
        f"train.micro_batch_size={args.micro}",
        f"train.global_batch_size={args.micro * args.accum * args.dp}",
        f"train.steps={args.steps}",
        "train.eval_interval=0",
        f"train.out_dir={out_dir}",
        f"data.prefixes=[{data}]",
        "data.split=98,1,1",
        f"parallel.tensor_parallel={tp}",
        f"parallel.zero_stage={zero}",
        f"parallel.precision={args.precision}",
        "parallel.device=cpu",
        "logging.tensorboard=false",
        "logging.log_interval=1000",
        "checkpoint.save_interval=1000",
        "checkpoint.resume=false",
        *args.overrides,
    ]


def recompute_overrides(mode: str) -> list[str]:
    """``--recompute`` spelling -> config overrides: none, selective[:modules], full[:N]."""
    kind, _, arg = mode.partition(":")
    if kind not in ("none", "selective", "full") or (kind == "none" and arg):
        sys.exit(f"error: --recompute {mode!r}: use none, selective, selective:mlp, full or full:N")
    out = [f"model.recompute={kind}"]
    if arg and kind == "selective":
        out.append(f"model.recompute_modules=[{arg}]")
    elif arg:
        out.append(f"model.recompute_layers={arg}")
    return out


def run_case(args, variant: str, zero: int, tp: int, data: str, tmp: str, recompute: str = "none", sp: bool = False):
    out_dir = str(Path(tmp) / f"{variant}-z{zero}-tp{tp}-{recompute.replace(':', '-').replace(',', '-')}-sp{int(sp)}")
    n = tp * args.dp
    config = str(REPO / f"configs/tiny-cpu-{variant}.yaml")
    overrides = [*case_overrides(args, variant, zero, tp, data, out_dir), *recompute_overrides(recompute)]
    overrides.append(f"parallel.sequence_parallel={str(sp).lower()}")
    cmd = [sys.executable, str(REPO / "launchers/local.py"), "-n", str(n), "--", str(Path(__file__).resolve())]
    cmd += ["--worker", "--config", config, *overrides]
    results = Path(out_dir) / "memory"
    results.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), DS_ACCELERATOR="cpu", MALLOC_MMAP_THRESHOLD_="65536")
    env["BENCH_MEMORY_OUT"] = str(results)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    ranks = [json.loads(f.read_text()) for f in sorted(results.glob("rank*.json"))]
    if proc.returncode or len(ranks) != n:
        sys.exit(
            f"error: {variant} ZeRO {zero} TP {tp} failed (exit {proc.returncode}):\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    from leviathan_pretrain.config import load_config
    from leviathan_pretrain.plan.planner import make_plan

    plan = make_plan(load_config(config, overrides), 1, n, device="cpu", mem_limit_gb=None)
    top = max(ranks, key=lambda r: r["peak"])
    took = time.monotonic() - t0
    return {"variant": variant, "zero": zero, "tp": tp, "recompute": recompute, "sp": sp, "plan": plan,
            "measured": top, "seconds": took}  # fmt: skip


def _name(r: dict) -> str:
    mode = "" if r.get("recompute", "none") == "none" else f" {r['recompute']}"
    return f"{r['variant']} Z{r['zero']} TP{r['tp']} DP{r['plan'].dp}{' SP' if r.get('sp') else ''}{mode}"


def report(rows: list[dict], precision: str) -> None:
    keys = ("parameters", "gradients", "optimizer", "activations", "logits", "buffers", "step")
    print(f"\nestimate per rank (leviathan_pretrain.plan.planner, device=cpu, {precision}), GiB")
    print(f"{'case':<32} " + " ".join(f"{k[:11]:>11}" for k in keys) + f" {'total':>11}")
    for r in rows:
        mem = r["plan"].memory
        print(f"{_name(r):<32} " + " ".join(f"{mem[k] / GIB:11.3f}" for k in (*keys, "total")))
    print(
        "\nestimate vs measured (RSS above the baseline taken right before the engine is built), GiB; ratio = est/meas"
    )
    print(
        f"{'case':<32} {'peak: est':>10} {'meas':>7} {'ratio':>6} | {'kept: est':>10} {'meas':>7} {'ratio':>6} | "
        f"{'transient: est':>15} {'meas':>7} {'ratio':>6}"
    )
    ratios = []
    for r in rows:
        mem, meas = r["plan"].memory, r["measured"]
        kept = mem["parameters"] + mem["optimizer"]  # the gradients are freed after the step (ZeRO 0 and 1 alike)
        after = meas["after_step"][-1]
        trans, mtrans = mem["total"] - kept, meas["peak"] - after
        ratios.append(mem["total"] / meas["peak"])
        print(
            f"{_name(r):<32} {mem['total'] / GIB:10.3f} {meas['peak'] / GIB:7.3f} {ratios[-1]:6.2f} | "
            f"{kept / GIB:10.3f} {after / GIB:7.3f} {kept / after:6.2f} | "
            f"{trans / GIB:15.3f} {mtrans / GIB:7.3f} {trans / mtrans:6.2f}"
        )
    print(
        "peak: the estimate's total (runtime 0 on CPU) vs VmHWM over the steps; kept: parameters + optimizer vs RSS "
        "after the last step; transient: the rest (gradients + max(activations + logits, buffers, step)) vs peak "
        f"minus kept. Peak ratio range: {min(ratios):.2f}-{max(ratios):.2f}"
    )
    for r in rows:
        m = r["measured"]
        print(
            f"  {_name(r)}: after build {m['after_build'] / GIB:.3f}, after each step "
            + ", ".join(f"{x / GIB:.3f}" for x in m["after_step"])
            + ", peak by step "
            + ", ".join(f"{x / GIB:.3f}" for x in m["peak_step"])
            + f" GiB; {r['plan'].params_per_rank / 1e6:.1f}M parameters per rank; {r['seconds']:.0f} s"
        )


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(argv[1:])
    loss_impl = None
    if argv[:1] == ["--loss-worker"]:
        loss_impl, argv = argv[1], argv[2:]
    ap = argparse.ArgumentParser(
        prog="python benchmarks/bench_memory.py",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  python benchmarks/bench_memory.py --tp 1 2\n"
        "  python benchmarks/bench_memory.py --precision bf16 --zero 1\n"
        "  python benchmarks/bench_memory.py --variants tied --micro 1 --seq 64 --dp 2   # optimizer-step peak",
    )
    ap.add_argument("--variants", nargs="+", default=["lev", "tied"], help="model variants (default lev tied)")
    ap.add_argument("--zero", type=int, nargs="+", default=[0, 1], help="ZeRO stages (default 0 1)")
    ap.add_argument("--tp", type=int, nargs="+", default=[1], help="TP sizes, one process per rank (default 1)")
    ap.add_argument(
        "--recompute",
        nargs="+",
        default=["none"],
        metavar="MODE",
        help="model.recompute per case: none (default), selective, selective:mlp, full, full:N",
    )
    ap.add_argument(
        "--sp",
        nargs="+",
        choices=["off", "on"],
        default=["off"],
        help="parallel.sequence_parallel per case at TP >= 2: off (default), on, or both: --sp off on",
    )
    ap.add_argument("--dp", type=int, default=1, help="data-parallel size: TP x DP processes (default 1)")
    ap.add_argument("--hidden", type=int, default=512, help="model.hidden_size (default 512)")
    ap.add_argument("--layers", type=int, default=8, help="model.num_layers (default 8)")
    ap.add_argument("--heads", type=int, default=8, help="model.num_attention_heads (default 8)")
    ap.add_argument("--vocab", type=int, default=32000, help="model.vocab_size (default 32000)")
    ap.add_argument("--seq", type=int, default=256, help="model.seq_length (default 256)")
    ap.add_argument("--micro", type=int, default=8, help="micro batch (default 8)")
    ap.add_argument("--accum", type=int, default=2, help="gradient accumulation steps (default 2)")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps (default 2: the second has every state)")
    ap.add_argument("--precision", default="fp32", help="fp32 (default) or bf16")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per case")
    ap.add_argument("--loss", action="store_true", help="the loss path alone: fused vs megatron (see above)")
    ap.add_argument("--pairs", type=int, default=3, help="--loss: A/B pairs of processes (default 3)")
    ap.add_argument("--loss-chunk", type=int, default=None, help="--loss: model.loss_chunk_tokens (default auto)")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="more config overrides for every case")
    args = ap.parse_args(argv)
    if loss_impl is not None:
        print("LOSS " + json.dumps(loss_worker(loss_impl, args)), flush=True)
        return 0
    if args.loss:
        return loss_bench(args)
    import warnings

    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed.*")
    from bench_train import write_zipf_shard

    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        tokens = args.steps * args.micro * args.accum * args.dp * (args.seq + 1) * 4 + 50_000
        data = write_zipf_shard(str(Path(tmp) / "zipf"), args.vocab, tokens)
        rows = []
        for tp in args.tp:
            for variant in args.variants:
                for zero in args.zero:
                    for mode in args.recompute:
                        for sp in sorted({s == "on" and tp > 1 for s in args.sp}):
                            rows.append(run_case(args, variant, zero, tp, data, tmp, mode, sp))
                            r = rows[-1]
                            print(
                                f"done: {_name(r)}: peak {r['measured']['peak'] / GIB:.3f} GiB measured, "
                                f"{r['plan'].memory['total'] / GIB:.3f} GiB estimated ({r['seconds']:.0f} s)",
                                flush=True,
                            )
    report(rows, args.precision)
    return 0


if __name__ == "__main__":
    sys.exit(main())
