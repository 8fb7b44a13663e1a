"""Training throughput of LEV vs TIED, side by side: ``python benchmarks/bench_train.py``.

Default: the ``tiny-cpu`` configs at TP=1 (1 process) and TP=2 (2 processes via ``launchers/local.py``).
In each launch both models are built in the same processes (the trainer's own engine, data and step
code) and their optimizer steps alternate (TIED, LEV, TIED, LEV, ...), so a noisy neighbour slows both
alike; the reported tokens/s is global tokens per step over the median step time after the warm-up. The
table ends with LEV/TIED per TP size (target >= 0.90).

Data: ``--data PREFIX`` (megatron-core shard), else a synthetic shard written to a temporary directory: Zipf
(s = 1.1) distributed ids over the model's vocabulary, which gives LEV a realistic number of unique ids per
micro-batch (what its cost depends on).

``--summarize RUN_DIR ...`` instead prints tokens/s, TFLOP/s and MFU of finished training runs from their
``train_log.jsonl`` and ``config.json`` (used by ``benchmarks/gpu_check.sh``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def write_zipf_shard(prefix: str, vocab: int, tokens: int, seed: int = 0) -> str:
    """A megatron-core shard of Zipf-distributed ids (documents of 100-1000 tokens, EOD id 0)."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, vocab)
    p = 1.0 / ranks**1.1
    perm = rng.permutation(ranks)  # frequent ids spread over the id range (LEV digits differ)
    ids = perm[rng.choice(len(ranks), size=tokens, p=p / p.sum())]
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16 if vocab <= 65536 else np.int32)
    start = 0
    while start < tokens:
        doc = ids[start : start + int(rng.integers(100, 1000))].astype(np.int64)
        doc[-1] = 0
        b.add_document(torch.from_numpy(doc), [len(doc)])
        start += len(doc)
    b.finalize(prefix + ".idx")
    return prefix


# ---------------------------------------------------------------- worker: both models in one launch


def shard_for_steps(cfg, steps: int, tmp: str) -> str:
    """A synthetic Zipf shard under ``tmp`` with enough tokens for ``steps`` global batches of ``cfg`` (+20%)."""
    need = steps * cfg.train.global_batch_size * (cfg.model.seq_length + 1)
    return write_zipf_shard(str(Path(tmp) / "zipf"), cfg.model.vocab_size, int(need * 1.2) + 10000)


def paired_engines(cfgs: dict, ref: str):
    """The world from ``cfgs[ref]``, its training batches, and one engine per config built from the same seed
    (``build_engine``): ``(device env, engines, batches)``. Shared by the side-by-side benchmarks."""
    from leviathan_pretrain.parallel import init_distributed, parallel_dims, seed_everything
    from leviathan_pretrain.trainer.data import Batches, build_datasets, data_summary
    from leviathan_pretrain.trainer.engine import build_engine
    from leviathan_pretrain.trainer.loop import collective_check

    denv = init_distributed(cfgs[ref].parallel)
    lay = parallel_dims(cfgs[ref].train.micro_batch_size, cfgs[ref].train.global_batch_size)
    summary = collective_check(data_summary, cfgs[ref])
    train, _ = build_datasets(cfgs[ref], summary["eod_id"], True)
    engines = {}
    for name, cfg in cfgs.items():
        seed_everything(cfg.train.seed, denv.device)
        engines[name] = build_engine(cfg, denv.device)
    t = cfgs[ref].train
    return denv, engines, Batches(train, t.micro_batch_size, lay.dp, lay.dp_rank, t.global_batch_size)


def worker(args) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    from leviathan_pretrain.config import load_config
    from leviathan_pretrain.parallel import destroy_distributed

    common = [
        f"parallel.tensor_parallel={args.tp}",
        f"data.prefixes=[{args.data}]",
        "train.eval_interval=0",
        "data.split=90,5,5",
        f"train.steps={args.warmup + args.steps}",
        *args.overrides,
    ]
    cfgs = {name: load_config(path, common) for name, path in (("TIED", args.tied), ("LEV", args.lev))}
    _, engines, batches = paired_engines(cfgs, "LEV")
    t = cfgs["LEV"].train
    times = {name: [] for name in engines}
    for step in range(args.warmup + args.steps):
        mbs = batches.global_batch(step * t.global_batch_size)
        for name, eng in engines.items():
            dist.barrier()
            t0 = time.perf_counter()
            eng.train_step(mbs)
            dist.barrier()
            if step >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    tokens = t.global_batch_size * cfgs["LEV"].model.seq_length
    if dist.get_rank() == 0:
        print(
            "RESULT "
            + json.dumps(
                {
                    name: {"tokens_per_s": tokens / statistics.median(ts), "median_s": statistics.median(ts)}
                    for name, ts in times.items()
                }
            ),
            flush=True,
        )
    for eng in engines.values():
        eng.ds.destroy()
    destroy_distributed()
    del torch


def launch_env(cfg) -> dict:
    """The launch's environment: ``DS_ACCELERATOR`` as ``leviathan_pretrain.train`` sets it, ``cpu`` only for a
    CPU run (``parallel.device=cpu``, or ``auto`` without CUDA), else ``cuda``; one already set wins."""
    from leviathan_pretrain.model.settings import resolve_device

    accel = "cpu" if resolve_device(cfg.parallel.device).type == "cpu" else "cuda"
    return dict(os.environ, PYTHONPATH=str(REPO), DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", accel))


def run_worker(tp: int, args, data: str, env: dict) -> dict:
    cmd = [
        sys.executable,
        str(REPO / "launchers" / "local.py"),
        "-n",
        str(tp),
        "--",
        str(Path(__file__).resolve()),
        "--worker",
        "--tp",
        str(tp),
        "--data",
        data,
        "--lev",
        args.lev,
        "--tied",
        args.tied,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        *args.overrides,
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    sys.exit(
        f"error: the TP={tp} benchmark launch failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
        f"{proc.stderr[-3000:]}"
    )


# ---------------------------------------------------------------- summaries of finished runs


def peak_memory_gib(run: Path) -> float | None:
    """The trainer's last ``mem X GiB`` console figure (``torch.cuda.max_memory_allocated`` on a GPU, RSS on a
    CPU) from the run's console log ``<run dir>.log`` (``benchmarks/gpu_check.sh`` writes it), if any. Logs
    written before the label said GiB print ``GB`` for the same 2**30-byte unit: both are read."""
    log = Path(str(run) + ".log")
    found = re.findall(r"\| mem ([0-9.]+) GiB? \|", log.read_text(errors="replace")) if log.exists() else []
    return float(found[-1]) if found else None


def plan_gib(cfg, device: str, world: int) -> float | None:
    """``plan.py``'s per-rank memory estimate (GiB) for the run's config on ``world`` ranks of one node."""
    from leviathan_pretrain.plan import make_plan

    try:
        plan = make_plan(cfg, 1, world, device="gpu" if device == "cuda" else "cpu", mem_limit_gb=None)
    except Exception:  # noqa: BLE001 -- a summary column, never a reason to lose the others
        return None
    return plan.memory["total"] / 2**30


def summarize_run(d: Path, warmup: int) -> dict:
    from leviathan_pretrain.config import Config
    from leviathan_pretrain.configlib import build
    from leviathan_pretrain.model import model_flops_per_token

    cfg = build(Config, json.loads((d / "config.json").read_text()))
    recs = [json.loads(x) for x in (d / "train_log.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "step_time_s" in r and not r.get("skipped")][warmup:]
    if not steps:
        raise ValueError(f"{d}/train_log.jsonl has no timed steps after {warmup} warm-up steps")
    step_s = statistics.median(r["step_time_s"] for r in steps)
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    layout = next(r for r in reversed(recs) if r.get("event") == "layout")
    world, peak = layout["world"], layout.get("peak_flops")  # None: no known peak (CPU), no MFU
    tps = tokens / step_s
    flops = tps * model_flops_per_token(cfg) / world
    return {
        "run": str(d),
        "variant": cfg.model.variant,
        "steps": len(steps),
        "step_s": step_s,
        "tokens_per_s": tps,
        "tflops_per_device": flops / 1e12,
        "mfu": flops / peak if peak else None,
        "final_loss": steps[-1]["loss"],
        "peak_gib": peak_memory_gib(d),
        "plan_gib": plan_gib(cfg, layout.get("device", "cpu"), world),
    }


def summarize(dirs: list[str], warmup: int) -> list[dict]:
    """One row per run; a run that did not finish (or left no log) is a row with its ``error``."""
    rows = []
    for d in map(Path, dirs):
        try:
            rows.append(summarize_run(d, warmup))
        except (OSError, ValueError, KeyError, StopIteration) as e:
            rows.append({"run": str(d), "variant": d.name.rsplit("-", 1)[-1], "error": f"{type(e).__name__}: {e}"})
    return rows


def group_of(row: dict) -> str:
    """The scale of a ``<scale>-<variant>`` run directory (gpu_check.sh's names), else ''."""
    name = Path(row["run"]).name
    return name.rsplit("-", 1)[0] if "-" in name else ""


def lev_tied_ratios(rows: list[dict]) -> dict[str, float]:
    out = {}
    for g in dict.fromkeys(group_of(r) for r in rows):
        by = {r["variant"]: r for r in rows if group_of(r) == g and "error" not in r}
        if "lev" in by and "tied" in by:
            out[g] = by["lev"]["tokens_per_s"] / by["tied"]["tokens_per_s"]
    return out


def _gib(x) -> str:
    return f"{x:.2f}" if x is not None else "n/a"


def print_summary(rows: list[dict]) -> None:
    if not rows:
        print("no training runs to summarize")
        return
    print(
        f"{'run':<40} {'variant':>8} {'tokens/s':>12} {'TFLOP/s':>9} {'MFU':>7} {'final loss':>10} "
        f"{'peak GiB':>9} {'plan GiB':>9}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['run']:<40} {r['variant']:>8} failed: {r['error']}")
            continue
        print(
            f"{r['run']:<40} {r['variant']:>8} {r['tokens_per_s']:>12,.0f} {r['tflops_per_device']:>9.2f} "
            + (f"{100 * r['mfu']:>6.2f}%" if r["mfu"] is not None else f"{'n/a':>7}")
            + f" {r['final_loss']:>10.4f} {_gib(r['peak_gib']):>9} {_gib(r['plan_gib']):>9}"
        )
    for g, ratio in lev_tied_ratios(rows).items():
        print(f"LEV/TIED tokens/s{f' ({g})' if g else ''}: {ratio:.3f}")


def _pct(x) -> str:
    return f"{100 * x:.2f}%" if x is not None else "n/a"


def report_md(rows: list[dict], attached: dict) -> str:
    """gpu_check.sh's summary.md: its sections' states, the training runs, bench_step.py's comparisons, the probe."""
    out = ["# GPU check summary", ""]
    if attached.get("sections"):
        out += ["| section | state | seconds |", "|---|---|---:|"]
        out += [f"| {n} | {st} | {sec} |" for n, st, sec in attached["sections"]]
        out.append("")
    out += ["## Training runs (leviathan_pretrain.train)", ""]
    if rows:
        out += [
            "| run | variant | tokens/s | TFLOP/s | MFU | final loss | peak GiB | plan.py GiB |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
    else:
        out.append("None in this check.")
    for r in rows:
        if "error" in r:
            out.append(f"| {Path(r['run']).name} | {r['variant']} | failed: {r['error']} | | | | | |")
        else:
            out.append(
                f"| {Path(r['run']).name} | {r['variant']} | {r['tokens_per_s']:,.0f} | {r['tflops_per_device']:.2f} | "
                f"{_pct(r['mfu'])} | {r['final_loss']:.4f} | {_gib(r['peak_gib'])} | {_gib(r['plan_gib'])} |"
            )
    out += [f"\nLEV/TIED tokens/s ({g or 'all'}): {x:.3f}" for g, x in lev_tied_ratios(rows).items()]
    results = attached.get("results", [])
    steps = [r["step"] for r in results if "median_s" in r.get("step", {})]
    if steps:
        out += [
            "",
            "## Stack vs bare PyTorch (bench_step.py: HF LlamaForCausalLM, SDPA, torch AdamW, same batches)",
            "",
        ]
        out += [
            "| config | precision | micro x accum | ours loss chunk | ours tokens/s | ref tokens/s | ours MFU "
            "| ref MFU | ours/ref |"
        ]
        out += ["|---|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in steps:
            mfu = r.get("mfu") or {}
            chunk = r.get("loss_chunk_tokens", "?")  # JSONs before it was recorded: unknown
            out.append(
                f"| {r['config']} | {r['precision']} | {r['micro_batch']} x {r['global_batch'] // r['micro_batch']} | "
                f"{'unfused' if chunk is None else chunk} | "
                f"{r['tokens_per_s']['ours']:,.0f} | {r['tokens_per_s']['ref']:,.0f} | {_pct(mfu.get('ours'))} | "
                f"{_pct(mfu.get('ref'))} | {r['ratio_pairs']:.3f} |"
            )
            for k, ph in r.get("phases_s", {}).items():
                out.append(f"\n{r['config']} {k}: " + ", ".join(f"{p} {v * 1e3:.1f} ms" for p, v in ph.items()))
    failed = [(k, r[k]) for r in results for k in ("step", "probe") if "error" in r.get(k, {})]
    if failed:
        out += ["", "## bench_step.py parts that failed (whole tracebacks in gpu_check.log)", ""]
        out += [f"- {k} {r['config']}: {r['error'].strip().splitlines()[-1]}" for k, r in failed]
    for r in (r["probe"] for r in results if "syncs" in r.get("probe", {})):
        n = sum(r["syncs"].values())
        out += ["", f"## Host syncs in one step of {r['config']} ({r['device']}): {n}", ""]
        out += [f"- {c} x {where}" for where, c in sorted(r["syncs"].items(), key=lambda kv: -kv[1])[:15]]
    return "\n".join(out) + "\n"


def attachments(paths: list[str]) -> dict:
    """``--attach``: bench_step.py ``--json`` results (a missing one: its section failed) and gpu_check.sh's
    section table (``*.tsv``: name, state, seconds)."""
    out: dict = {"results": [], "sections": []}
    for p in map(Path, paths):
        if not p.exists():
            continue
        if p.suffix == ".tsv":
            out["sections"] += [line.split("\t")[:3] for line in p.read_text().splitlines() if line.strip()]
        else:
            out["results"].append(json.loads(p.read_text()))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python benchmarks/bench_train.py",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: python benchmarks/bench_train.py --steps 20 --warmup 3",
    )
    ap.add_argument("--lev", default=str(REPO / "configs/tiny-cpu-lev.yaml"), help="LEV config")
    ap.add_argument("--tied", default=str(REPO / "configs/tiny-cpu-tied.yaml"), help="TIED config")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="TP sizes (one process per TP rank)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per model (default 20)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ap.add_argument("--data", default=None, help="shard prefix (default: a synthetic Zipf shard)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    ap.add_argument(
        "--summarize",
        nargs="*",
        metavar="RUN_DIR",
        help="summarize finished runs instead (none: the attachments alone)",
    )
    ap.add_argument("--attach", nargs="*", default=[], metavar="FILE", help="--summarize: bench_step JSONs, *.tsv")
    ap.add_argument("--json", metavar="PATH", help="--summarize: also write rows + attachments as JSON")
    ap.add_argument("--md", metavar="PATH", help="--summarize: also write a Markdown report")
    ap.add_argument(
        "--write-shard",
        metavar="PREFIX",
        help="only write a synthetic Zipf shard for the --lev config's vocabulary (--tokens N)",
    )
    ap.add_argument("--tokens", type=int, default=2_000_000, help="tokens of --write-shard (default 2M)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for both models")
    args = ap.parse_args(argv)
    import warnings

    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed.*")
    if args.summarize is not None:
        rows, attached = summarize(args.summarize, args.warmup), attachments(args.attach)
        print_summary(rows)
        if args.json:
            Path(args.json).write_text(json.dumps({"runs": rows, **attached}, indent=1))
        if args.md:
            Path(args.md).write_text(report_md(rows, attached))
        return 0
    if args.write_shard:
        from leviathan_pretrain.config import load_config

        vocab = load_config(args.lev, args.overrides).model.vocab_size
        print(write_zipf_shard(args.write_shard, vocab, args.tokens))
        return 0
    if args.worker:
        args.tp = args.tp[0]
        worker(args)
        return 0
    from leviathan_pretrain.config import load_config

    cfg = load_config(args.lev, args.overrides)
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        data = args.data or shard_for_steps(cfg, args.steps + args.warmup, tmp)
        results = {tp: run_worker(tp, args, data, launch_env(cfg)) for tp in args.tp}
    print(
        f"\ntraining throughput, tokens/s (median of {args.steps} alternating steps after {args.warmup} warm-up; "
        f"global batch {cfg.train.global_batch_size} x seq {cfg.model.seq_length}; data: "
        f"{args.data or 'synthetic Zipf ids'})"
    )
    print(f"{'':8} {'TIED':>10} {'LEV':>10} {'LEV/TIED':>9}")
    for tp, r in results.items():
        ratio = r["LEV"]["tokens_per_s"] / r["TIED"]["tokens_per_s"]
        print(
            f"{'TP=' + str(tp):8} {r['TIED']['tokens_per_s']:>10,.0f} {r['LEV']['tokens_per_s']:>10,.0f} "
            f"{ratio:>9.3f}"
            f"  {'ok' if ratio >= 0.90 else 'below'} (target >= 0.90)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
