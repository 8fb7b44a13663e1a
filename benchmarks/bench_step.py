"""Our step time against plain Hugging Face loops, side by side in one process: ``python benchmarks/bench_step.py``.

Contestants, each stepped on the same micro-batches, in rotating order, after ``--warmup``
steps each:

- **ours** (B): the trainer's own path for ``--config`` (default ``configs/tiny-cpu-tied.yaml``, fp32, ZeRO 0)
  plus ``key=value`` overrides: ``trainer.engine.build_engine`` + ``ModelEngine.train_step`` (DeepSpeed engine,
  megatron-core layers, our loss, our AdamW wrapper and clipping); its micro-batches are prepared ahead (host
  packing, pinned memory, unique ids: what the trainer's data loader does) when the engine offers it.
- **old** (A, ``--old "key=value ..."``): ours with those overrides on top: the old defaults, for a before/after
  in the same process (benchmarks/gpu_check.sh passes the keys that restore them).
- **ref** (C): Hugging Face ``LlamaForCausalLM`` of the same shape (benchmarks/hf_reference.py), SDPA, the
  vocabulary padded as ours (``--vocab padded``; ``exact``: the tokenizer's size), pure bf16 weights for a bf16
  run, fp32 ``cross_entropy`` of the logits, ``clip_grad_norm_`` and torch AdamW with our hyper-parameters.
- **liger** (D, ``--liger``): the same Hugging Face model with Liger-Kernel's RMSNorm, SwiGLU, RoPE and fused
  linear cross entropy in as many chunks as ours uses, and ``torch.compile`` of each decoder layer
  (``--liger-eager``: without compile): what a Hugging Face user who cares about speed runs.

The headline is the median over rounds of ours' step time over each other's, step by step in the same round
(``ratio_pairs``: ours/ref; ``ratio_pairs_vs``: every other contestant): of CPU time (``process_time``) on the
CPU, of wall time (synchronised) on CUDA. Targets: ours/ref <= 0.85 and ours/liger <= 1.00 on a GPU;
on the CPU ours/ref <= 1.05. ``--breakdown`` then times forward / backward / optimizer step of each separately.
On CUDA each contestant's memory is recorded: what it holds between steps (``static_gib``: states, measured
as the allocation growth from its build through its warm-up) and above that during a step (``transient_gib``).

``--probe`` (instead) or ``--probe-config YAML`` (after, in the same process): ours alone, one step's host syncs
(``torch.cuda.set_sync_debug_mode``, counted by the Python line that made them; CUDA only) and a
``torch.profiler`` table of one step. ``--memory-snapshot PATH``: after the comparison, one step of ours under
``torch.cuda.memory._record_memory_history`` and what was live at its peak, by allocation site
(benchmarks/memory_snapshot.py), written to PATH (CUDA only). ``--json`` writes ``{"step": ..., "probe": ...}``.

    python benchmarks/bench_step.py [--pairs 15] [--threads 1] [--breakdown] [--json OUT.json] [key=value ...]
    # on a GPU (benchmarks/gpu_check.sh): 400M TIED, bf16, ZeRO 1, micro-batch 16, all four contestants
    python benchmarks/bench_step.py --config configs/400m-tied.yaml --liger --old "model.loss_impl=fused" \\
        parallel.device=cuda parallel.precision=bf16 parallel.zero_stage=1 train.micro_batch_size=16 \\
        train.global_batch_size=64
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def zipf_batches(cfg, n_steps: int, seed: int = 0) -> list[list[dict]]:
    """``n_steps`` global batches of micro-batch dicts (tokens, labels, loss_mask, position_ids): Zipf ids over a
    random permutation of the vocabulary (text-like repeats), labels the next id."""
    import torch

    from benchmarks.bench_lev import zipf_ids

    t, m = cfg.train, cfg.model
    b, s, gas = t.micro_batch_size, m.seq_length, t.global_batch_size // t.micro_batch_size
    every = zipf_ids((n_steps, gas, b, s + 1), m.vocab_size, seed)  # one permutation for the whole run
    out = []
    for step in range(n_steps):
        mbs = []
        for k in range(gas):
            ids = every[step, k]
            pos = torch.arange(s)[None].expand(b, s)
            mb = {"tokens": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": torch.ones(b, s), "position_ids": pos}
            mbs.append(mb)
        out.append(mbs)
    return out


class Ours:
    """The trainer's engine (``build_engine``) and its ``train_step``."""

    name = "ours"

    def __init__(self, cfg, device, name: str = "ours"):
        from leviathan_pretrain.parallel.groups import seed_everything
        from leviathan_pretrain.trainer.engine import build_engine

        seed_everything(cfg.train.seed, device)
        self.name, self.cfg = name, cfg
        self.eng = build_engine(cfg, device)
        self.eng.set_lr(cfg.optim.lr)
        self.device = device

    def prepare(self, batches: list[list[dict]]) -> list[list]:
        """The micro-batches as the trainer's data loader hands them over (``engine.prepare``: packed, pinned on
        CUDA, unique ids on the host), done ahead of the timed steps as the loader does; plain dicts if this
        engine takes them as they are."""
        prep = getattr(self.eng, "prepare", None)
        return batches if prep is None else [[prep(mb) for mb in mbs] for mbs in batches]

    def step(self, mbs: list) -> float:
        return self.eng.train_step(mbs)[0]

    def head_options(self):
        # the piece that holds the head (TIED: the input layer; else the output layer) carries its options
        return next(m.head_options for m in self.eng.module().modules() if hasattr(m, "head_options"))

    def loss_chunk(self) -> int | None:
        """The built model's loss chunk limit in tokens (``model.loss_chunk_tokens`` or the device's default);
        None: the unfused loss (``megatron``)."""
        opts = self.head_options()
        return None if opts.impl == "megatron" else opts.chunk

    def loss_impl(self) -> str:
        return self.head_options().impl

    def loss_chunks(self) -> int:
        """How many chunks one micro-batch's loss takes (what D's Liger loss is cut into too)."""
        from leviathan_pretrain.model.sizes import loss_spans

        chunk = self.loss_chunk()
        tokens = self.cfg.train.micro_batch_size * self.cfg.model.seq_length
        return 1 if chunk is None else len(loss_spans(tokens, chunk))

    def describe(self) -> str:
        chunk = self.loss_chunk()
        return f"loss {self.loss_impl()}" + ("" if chunk is None else f" ({chunk} tokens a chunk)")

    def phases(self, mbs: list, clock) -> dict:
        """``train_step``'s body (``ModelEngine``) with a clock between forward, backward and step."""
        eng, t = self.eng, {"forward": 0.0, "backward": 0.0, "step": 0.0}
        for mb in mbs:
            c = clock()
            loss = eng._loss(mb)
            t["forward"] += clock() - c
            c = clock()
            eng.ds.backward(loss)
            t["backward"] += clock() - c
            c = clock()
            eng.ds.step()  # at the boundary: DeepSpeed's step (clipping, AdamW, zero_grad)
            t["step"] += clock() - c
        float(loss.item())
        return t

    def close(self) -> None:
        self.eng.ds.destroy()


def make_clock(device, cpu_time: bool):
    """The step clock: ``process_time`` on the CPU (``cpu_time``), else wall time after a CUDA synchronise."""
    import torch

    if cpu_time:
        return time.process_time
    if device.type == "cuda":

        def clock():
            torch.cuda.synchronize(device)
            return time.perf_counter()

        return clock
    return time.perf_counter


def probe(cfg, device, args, label: str) -> dict:
    """Ours alone: the host syncs of one step (``torch.cuda.set_sync_debug_mode``: each synchronising CUDA call
    warns from the Python line that made it; counted by file:line) and a ``torch.profiler`` table of one step."""
    import warnings

    import torch
    from torch.profiler import ProfilerActivity, profile

    ours = Ours(cfg, device)
    batches = ours.prepare(zipf_batches(cfg, args.warmup + 2, seed=args.seed))
    for i in range(args.warmup):
        ours.step(batches[i])
    syncs: dict[str, int] = {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                ours.step(batches[args.warmup])
            finally:
                torch.cuda.set_sync_debug_mode("default")
        for w in caught:
            if "synchroniz" in str(w.message):
                path = os.path.relpath(w.filename, REPO) if w.filename.startswith(str(REPO)) else w.filename
                where = f"{path}:{w.lineno}"
                syncs[where] = syncs.get(where, 0) + 1
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        ours.step(batches[args.warmup + 1])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=args.probe_rows)
    ours.close()
    return {"config": label, "device": device.type, "syncs": syncs, "profile_sort": key, "profile": table}


def report_probe(r: dict) -> None:
    print(f"\nprobe of ours, {r['config']} on {r['device']}: one step's host syncs and profile")
    if r["device"] != "cuda":
        print("  host syncs: n/a (torch.cuda.set_sync_debug_mode needs CUDA)")
    else:
        print(f"  host syncs in one step: {sum(r['syncs'].values())} (by the Python line that made them)")
        for where, n in sorted(r["syncs"].items(), key=lambda kv: -kv[1])[:25]:
            print(f"    {n:>5}  {where}")
    print(f"  profile of one step, sorted by {r['profile_sort']}:\n{r['profile']}")


def contestants(cfg, device, args) -> dict:
    """The contestants asked for, as builders (ours, old, ref, liger, built in that order), each from the seed."""
    from benchmarks.hf_reference import LigerReference, Reference
    from leviathan_pretrain.config import load_config

    out = {"ours": lambda built: Ours(cfg, device)}
    if args.old is not None:
        old = load_config(args.config, [*args.cfg_overrides, *args.old.split()])
        out["old"] = lambda built: Ours(old, device, name="old")
    out["ref"] = lambda built: Reference(cfg, device, args.vocab)
    if args.liger:  # Liger's loss in as many chunks as ours
        out["liger"] = lambda built: LigerReference(
            cfg, device, args.vocab, chunks=built["ours"].loss_chunks(), compile=not args.liger_eager
        )
    return out


def _rounds(names: list[str], r: int) -> list[str]:
    """Round ``r``'s order: rotated by ``r``, reversed every other pass, so no contestant always goes first or
    follows the same one."""
    k = r % len(names)
    order = names[k:] + names[:k]
    return order[::-1] if (r // len(names)) % 2 else order


def _gib(n: int) -> float:
    return n / 2**30


def measure(cfg, device, args, label: str) -> dict:
    import torch

    cpu, cuda = device.type == "cpu", device.type == "cuda"
    if cpu:
        torch.set_num_threads(args.threads)
    clock, wall = make_clock(device, cpu), make_clock(device, False)
    n = args.warmup + args.pairs
    plain = zipf_batches(cfg, n + (args.breakdown_pairs if args.breakdown else 0), seed=args.seed)
    models, batches, static, failed = {}, {}, {}, {}
    losses = {}
    for name, make in contestants(cfg, device, args).items():  # built and warmed up one after the other
        before = torch.cuda.memory_allocated(device) if cuda else 0
        try:
            models[name] = model = make(models)
            batches[name] = model.prepare(plain) if isinstance(model, Ours) else plain
            losses[name] = [model.step(batches[name][i]) for i in range(args.warmup)]  # allocator, compile, ...
        except Exception:  # noqa: BLE001 -- old / liger: recorded, the others still measured; ours / ref: fatal
            if name in ("ours", "ref"):
                raise
            traceback.print_exc()
            failed[name] = traceback.format_exc(limit=6)
            for d in (models, batches, losses):
                d.pop(name, None)
            gc.collect()
            continue
        if cuda:  # what it holds between steps: weights, gradients, optimizer states, caches
            torch.cuda.synchronize(device)
            static[name] = torch.cuda.memory_allocated(device) - before
    names = list(models)
    times = {k: {"clock": [], "wall": []} for k in names}
    transient = dict.fromkeys(names, 0)
    for r in range(args.pairs):
        for name in _rounds(names, r):
            mbs = batches[name][args.warmup + r]
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                start = torch.cuda.memory_allocated(device)
            c, w = clock(), wall()
            losses[name].append(models[name].step(mbs))
            times[name]["clock"].append(clock() - c)
            times[name]["wall"].append(wall() - w)
            if cuda:
                transient[name] = max(transient[name], torch.cuda.max_memory_allocated(device) - start)
    med = {k: statistics.median(v["clock"]) for k, v in times.items()}
    vs = {
        k: statistics.median(a / b for a, b in zip(times["ours"]["clock"], times[k]["clock"]))
        for k in names
        if k != "ours"
    }
    res = {
        "config": label,
        "device": device.type,
        "precision": cfg.parallel.precision,
        "zero_stage": cfg.parallel.zero_stage,
        "micro_batch": cfg.train.micro_batch_size,
        "global_batch": cfg.train.global_batch_size,
        "seq_length": cfg.model.seq_length,
        "contestants": names,
        "failed_contestants": failed,
        "describe": {k: m.describe() for k, m in models.items()},
        "old_overrides": args.old,
        "ref_vocab": models["ref"].vocab_size,
        "ref_attention": models["ref"].model.config._attn_implementation,
        "loss_chunk_tokens": models["ours"].loss_chunk(),
        "loss_impl": models["ours"].loss_impl(),
        "clock": "process_time" if cpu else "wall (synchronised)",
        "pairs": args.pairs,
        "median_s": med,
        "median_wall_s": {k: statistics.median(v["wall"]) for k, v in times.items()},
        "min_s": {k: min(v["clock"]) for k, v in times.items()},
        "ratio_pairs": vs["ref"],
        "ratio_pairs_vs": vs,
        "first_loss": {k: v[0] for k, v in losses.items()},
        "last_loss": {k: v[-1] for k, v in losses.items()},
    }
    res["ratio_medians"] = med["ours"] / med["ref"]
    res["ratio_wall_medians"] = res["median_wall_s"]["ours"] / res["median_wall_s"]["ref"]
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    res["tokens_per_s"] = {k: tokens / v for k, v in res["median_wall_s"].items()}
    from leviathan_pretrain.model.flops import model_flops_per_token
    from leviathan_pretrain.trainer.metrics import peak_flops

    peak = peak_flops(device, cfg.parallel.precision, cfg.logging.peak_flops)[0]
    res["tflops"] = {k: v * model_flops_per_token(cfg) / 1e12 for k, v in res["tokens_per_s"].items()}
    res["mfu"] = {k: v * 1e12 / peak for k, v in res["tflops"].items()} if peak else None
    if cuda:
        res["memory"] = {
            "static_gib": {k: _gib(v) for k, v in static.items()},
            "transient_gib": {k: _gib(v) for k, v in transient.items()},
        }
    if args.breakdown:
        ph = {k: [] for k in names}
        for r in range(args.breakdown_pairs):
            for name in _rounds(names, r):
                ph[name].append(models[name].phases(batches[name][n + r], clock))
        res["phases_s"] = {k: {p: statistics.median(x[p] for x in v) for p in v[0]} for k, v in ph.items()}
    if args.memory_snapshot:
        res["memory_snapshot"] = snapshot_step(models["ours"], batches["ours"][0], device, args.memory_snapshot)
    for m in models.values():
        if isinstance(m, Ours):
            m.close()
    return res


def snapshot_step(ours: Ours, mbs: list, device, path: str) -> dict:
    """One step of ours under the CUDA allocator's history; what was live at its peak (memory_snapshot.py)."""
    if device.type != "cuda":
        return {"error": "--memory-snapshot needs CUDA (torch.cuda.memory._record_memory_history)"}
    from benchmarks.memory_snapshot import record_step

    out = record_step(lambda: ours.step(mbs), device, REPO)
    Path(path).write_text(json.dumps(out, indent=1))
    return {"path": path, "peak_gib": out["peak_gib"], "by_category_gib": out["by_category_gib"]}


def report(r: dict) -> None:
    print(
        f"\nstep time, ours (build_engine + train_step) vs plain Hugging Face loops: {r['config']}, {r['device']}, "
        f"{r['precision']}, ZeRO {r['zero_stage']}, global batch {r['global_batch']} (micro {r['micro_batch']}) x seq "
        f"{r['seq_length']}, reference vocabulary {r['ref_vocab']}; {r['pairs']} rounds, clock: {r['clock']}"
    )
    for k, text in r["describe"].items():
        print(f"  {k:6} {text}" + (f"  [old: {r['old_overrides']}]" if k == "old" else ""))
    for k, err in r.get("failed_contestants", {}).items():
        print(f"  {k:6} FAILED, not measured: {err.strip().splitlines()[-1]}")
    head = f"{'median':>10} {'min':>10} {'wall median':>12} {'tokens/s':>12} {'TFLOP/s':>8} {'MFU':>7} {'loss 1st':>8}"
    mem = r.get("memory")
    print(f"  {'':6} {head}" + (f" {'held GiB':>9} {'step GiB':>9}" if mem else ""))
    for k in r["contestants"]:
        mfu = f"{100 * r['mfu'][k]:>6.2f}%" if r["mfu"] else f"{'n/a':>7}"
        print(
            f"  {k:6} {r['median_s'][k] * 1e3:>8.1f}ms {r['min_s'][k] * 1e3:>8.1f}ms "
            f"{r['median_wall_s'][k] * 1e3:>10.1f}ms {r['tokens_per_s'][k]:>12,.0f} {r['tflops'][k]:>8.2f} {mfu} "
            f"{r['first_loss'][k]:>8.4f}"
            + (f" {mem['static_gib'][k]:>9.2f} {mem['transient_gib'][k]:>9.2f}" if mem else "")
        )
    if mem:
        print("  held: allocated by its build and warm-up; step: allocated above that at its step's peak")
    if "phases_s" in r:
        print("  breakdown (medians of separate timed steps): " + ", ".join(r["phases_s"]["ours"]))
        for k, ph in r["phases_s"].items():
            print(f"  {k:6} " + "  ".join(f"{p} {v * 1e3:8.1f}ms" for p, v in ph.items()))
    target = 0.85 if r["device"] == "cuda" else 1.05
    ok = "ok" if r["ratio_pairs"] <= target else "above"
    print(
        f"OURS/REF = {r['ratio_pairs']:.3f} (median of pair ratios; medians' ratio {r['ratio_medians']:.3f}, "
        f"wall medians' ratio {r['ratio_wall_medians']:.3f})  {ok} (target <= {target:.2f})"
    )
    for k, x in r["ratio_pairs_vs"].items():
        if k != "ref":
            goal = {"liger": " (target <= 1.00)", "old": " (< 1: faster than the old defaults)"}.get(k, "")
            print(f"OURS/{k.upper()} = {x:.3f}{goal}")
    if "memory_snapshot" in r:
        ms = r["memory_snapshot"]
        if "error" in ms:
            print(f"memory snapshot: {ms['error']}")
        else:
            cats = ", ".join(f"{c} {g:.2f}" for c, g in ms["by_category_gib"].items())
            print(f"memory snapshot of one step of ours: peak {ms['peak_gib']:.2f} GiB ({cats} GiB) -> {ms['path']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python benchmarks/bench_step.py",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: python benchmarks/bench_step.py --pairs 15 --breakdown",
    )
    ap.add_argument("--config", default="configs/tiny-cpu-tied.yaml", help="our config (default tiny-cpu TIED)")
    ap.add_argument("--pairs", type=int, default=15, help="timed alternating pairs (default 15)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps of each first (default 2)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on the CPU (default 1)")
    ap.add_argument("--vocab", choices=("padded", "exact"), default="padded", help="reference vocabulary size")
    ap.add_argument("--breakdown", action="store_true", help="also time forward / backward / step separately")
    ap.add_argument("--breakdown-pairs", type=int, default=5, help="pairs for --breakdown (default 5)")
    ap.add_argument("--seed", type=int, default=0, help="token seed")
    ap.add_argument("--probe", action="store_true", help="instead: ours alone, host syncs + profile of one step")
    ap.add_argument("--probe-config", metavar="YAML", help="after the comparison, --probe this config (same overrides)")
    ap.add_argument("--probe-rows", type=int, default=25, help="profile table rows for --probe (default 25)")
    ap.add_argument("--old", metavar="'KEY=VALUE ...'", help="also time ours with these overrides (the old defaults)")
    ap.add_argument("--liger", action="store_true", help="also time HF + Liger-Kernel + torch.compile (needs triton)")
    ap.add_argument("--liger-eager", action="store_true", help="--liger without torch.compile")
    ap.add_argument("--memory-snapshot", metavar="PATH", help="after the comparison: ours' memory at its peak (CUDA)")
    ap.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (ours and the reference)")
    args = ap.parse_args(argv)
    import warnings

    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed.*")
    from leviathan_pretrain.config import load_config
    from leviathan_pretrain.model.settings import resolve_device

    cfg_overrides = [*args.overrides, f"train.steps={args.warmup + 2 * args.pairs + 10}"]
    args.cfg_overrides = cfg_overrides
    cfg = load_config(args.config, cfg_overrides)
    if args.old is not None:
        load_config(args.config, [*cfg_overrides, *args.old.split()])  # a bad --old key fails here, not later
    if cfg.parallel.tensor_parallel * cfg.parallel.pipeline_parallel != 1:
        sys.exit("error: bench_step.py runs one process: parallel.tensor_parallel=1 parallel.pipeline_parallel=1")
    accel = "cpu" if resolve_device(cfg.parallel.device).type == "cpu" else "cuda"
    os.environ.setdefault("DS_ACCELERATOR", accel)  # before deepspeed is imported (as bench_train.launch_env)
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)  # one process of its own, whatever launched us
    import torch

    from leviathan_pretrain.parallel.groups import destroy_distributed, init_distributed

    denv = init_distributed(cfg.parallel)
    jobs = [] if args.probe else [("step", measure, report, cfg, args.config)]
    if args.probe or args.probe_config:
        label = args.probe_config or args.config
        jobs.append(("probe", probe, report_probe, load_config(label, cfg_overrides), label))
    out, failed = {}, False
    try:
        for key, fn, show, c, label in jobs:  # one failing does not lose the other's numbers
            try:
                out[key] = fn(c, denv.device, args, label)
                show(out[key])
            except Exception:  # noqa: BLE001 -- reported, recorded, and the exit status says so
                traceback.print_exc()
                out[key], failed = {"config": label, "error": traceback.format_exc(limit=4)}, True
            gc.collect()
            if denv.device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        destroy_distributed()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
