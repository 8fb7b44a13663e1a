"""The stack's step time over bare PyTorch's, side by side in one process: ``python benchmarks/bench_step.py``.

**Ours**: the trainer's own path, ``trainer.engine.build_engine`` + ``ModelEngine.train_step`` (DeepSpeed engine,
megatron-core layers, the fused chunked loss, our AdamW wrapper and clipping) for ``--config`` (default
``configs/tiny-cpu-tied.yaml``, fp32, ZeRO 0) plus ``key=value`` overrides. **Reference**: Hugging Face
``LlamaForCausalLM`` of the same shape (``evaluation/hf_convert.llama_config``: hidden, layers, heads, GQA groups,
FFN, RoPE, RMSNorm eps, ``tie_word_embeddings`` for TIED; ``attn_implementation="sdpa"``), the vocabulary padded
as ours is (``--vocab padded``, default: the same head GEMM; ``exact``: the tokenizer's size), in the run's
precision (fp32, or bf16 weights for ``parallel.precision=bf16``), logits -> fp32 ``cross_entropy``, gradient
accumulation over the same micro-batches, ``torch.nn.utils.clip_grad_norm_`` at ``optim.clip_grad`` and
``torch.optim.AdamW`` with the same hyper-parameters, weight-decay groups and kernel flags
(``engine.adamw_kernel``: single-tensor on the CPU, fused on CUDA). Both get the same tokens (Zipf ids, seeded),
the same global batch (``train.global_batch_size`` / ``train.micro_batch_size`` micro-batches) and a constant LR.

Steps alternate (ours, ref, ref, ours, ...) after ``--warmup`` steps each. The headline is the median of the
back-to-back pairs' ratios ours/ref: of CPU time (``process_time``: time waiting for a core on this shared
machine does not count) on the CPU, of wall time (synchronised) on CUDA; the medians and their ratio are
printed too. Target: <= 1.10 (issue 19). ``--breakdown`` then times forward / backward / optimizer step
(with clipping) of both separately on the same batches, to show where a gap comes from.

``--probe`` (instead) or ``--probe-config YAML`` (after, in the same process): ours alone, one step's host syncs
(``torch.cuda.set_sync_debug_mode``, counted by the Python line that made them; CUDA only) and a
``torch.profiler`` table of one step. ``--json`` writes ``{"step": ..., "probe": ...}``.

    python benchmarks/bench_step.py [--pairs 15] [--threads 1] [--breakdown] [--json OUT.json] [key=value ...]
    # on a GPU (benchmarks/gpu_check.sh): 400M TIED, bf16, ZeRO 1, micro-batch 16
    python benchmarks/bench_step.py --config configs/400m-tied.yaml parallel.device=cuda parallel.precision=bf16 \\
        parallel.zero_stage=1 train.micro_batch_size=16 train.global_batch_size=64
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

    def __init__(self, cfg, device):
        from leviathan_pretrain.parallel import seed_everything
        from leviathan_pretrain.trainer.engine import build_engine

        seed_everything(cfg.train.seed, device)
        self.eng = build_engine(cfg, device)
        self.eng.set_lr(cfg.optim.lr)
        self.device = device

    def step(self, mbs: list[dict]) -> float:
        return self.eng.train_step(mbs)[0]

    def loss_chunk(self) -> int | None:
        """The built model's fused-loss chunk limit in tokens (``model.loss_chunk_tokens`` or the device's
        default); None: the unfused loss."""
        # the piece that holds the head (TIED: the input layer; else the output layer) carries its options
        opts = next(m.head_options for m in self.eng.module().modules() if hasattr(m, "head_options"))
        return opts.chunk if opts.impl == "fused" else None

    def phases(self, mbs: list[dict], clock) -> dict:
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


class Reference:
    """Hugging Face ``LlamaForCausalLM`` + torch AdamW in a plain loop."""

    name = "ref"

    def __init__(self, cfg, device, vocab: str):
        import torch
        from transformers import LlamaForCausalLM

        from leviathan_pretrain.evaluation.hf_convert import llama_config
        from leviathan_pretrain.model import sizes
        from leviathan_pretrain.model.accounting import weight_decay_groups
        from leviathan_pretrain.trainer.engine import adamw_kernel

        m, o = cfg.model, cfg.optim
        self.dtype = torch.bfloat16 if cfg.parallel.precision == "bf16" else torch.float32
        hf = llama_config(cfg, {"bos": 1, "eos": 2, "pad": 0}, "float32")
        if vocab == "padded":
            hf.vocab_size = sizes.padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, 1)
        hf._attn_implementation = "sdpa"
        torch.manual_seed(cfg.train.seed)
        with torch.device(device):
            self.model = LlamaForCausalLM(hf).to(self.dtype)
        self.model.train()
        self.vocab_size, self.device, self.clip = hf.vocab_size, device, o.clip_grad
        groups = weight_decay_groups(self.model, o.weight_decay)
        kernel = adamw_kernel(cfg, device.type == "cuda")
        self.opt = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, **kernel)
        self.params = [p for g in groups for p in g["params"]]

    def _loss(self, mb: dict):
        import torch.nn.functional as F

        x, pos, y = (mb[k].to(self.device) for k in ("tokens", "position_ids", "labels"))
        logits = self.model(input_ids=x, position_ids=pos).logits
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    def _update(self) -> None:
        import torch

        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def step(self, mbs: list[dict]) -> float:
        total = 0.0
        for mb in mbs:
            loss = self._loss(mb)
            (loss / len(mbs)).backward()
            total = total + loss.detach()
        self._update()
        return float(total / len(mbs))

    def phases(self, mbs: list[dict], clock) -> dict:
        t = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        for mb in mbs:
            c = clock()
            loss = self._loss(mb)
            t["forward"] += clock() - c
            c = clock()
            (loss / len(mbs)).backward()
            t["backward"] += clock() - c
        c = clock()
        self._update()
        float(loss.item())
        t["step"] += clock() - c
        return t


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
    batches = zipf_batches(cfg, args.warmup + 2, seed=args.seed)
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
    ours.eng.ds.destroy()
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


def measure(cfg, device, args, label: str) -> dict:
    import torch

    cpu = device.type == "cpu"
    if cpu:
        torch.set_num_threads(args.threads)
    clock, wall = make_clock(device, cpu), make_clock(device, False)
    models = {"ours": Ours(cfg, device), "ref": Reference(cfg, device, args.vocab)}
    n = args.warmup + args.pairs * 2
    batches = zipf_batches(cfg, n + (args.breakdown_pairs if args.breakdown else 0), seed=args.seed)
    times = {k: {"clock": [], "wall": []} for k in models}
    losses = {k: [] for k in models}
    for name in models:  # warm-up: allocator, first-call overheads, DeepSpeed's first step
        for i in range(args.warmup):
            losses[name].append(models[name].step(batches[i]))
    for r in range(args.pairs):
        mbs = batches[args.warmup + r]
        for name in ("ours", "ref") if r % 2 == 0 else ("ref", "ours"):
            c, w = clock(), wall()
            losses[name].append(models[name].step(mbs))
            times[name]["clock"].append(clock() - c)
            times[name]["wall"].append(wall() - w)
    res = {
        "config": label,
        "device": device.type,
        "precision": cfg.parallel.precision,
        "zero_stage": cfg.parallel.zero_stage,
        "micro_batch": cfg.train.micro_batch_size,
        "global_batch": cfg.train.global_batch_size,
        "seq_length": cfg.model.seq_length,
        "ref_vocab": models["ref"].vocab_size,
        "ref_attention": models["ref"].model.config._attn_implementation,
        "loss_chunk_tokens": models["ours"].loss_chunk(),
        "clock": "process_time" if cpu else "wall (synchronised)",
        "pairs": args.pairs,
        "median_s": {k: statistics.median(v["clock"]) for k, v in times.items()},
        "median_wall_s": {k: statistics.median(v["wall"]) for k, v in times.items()},
        "min_s": {k: min(v["clock"]) for k, v in times.items()},
        "ratio_pairs": statistics.median(a / b for a, b in zip(times["ours"]["clock"], times["ref"]["clock"])),
        "first_loss": {k: v[0] for k, v in losses.items()},
        "last_loss": {k: v[-1] for k, v in losses.items()},
    }
    res["ratio_medians"] = res["median_s"]["ours"] / res["median_s"]["ref"]
    res["ratio_wall_medians"] = res["median_wall_s"]["ours"] / res["median_wall_s"]["ref"]
    res["tokens_per_s"] = {
        k: cfg.train.global_batch_size * cfg.model.seq_length / v for k, v in res["median_wall_s"].items()
    }
    from leviathan_pretrain.model import model_flops_per_token
    from leviathan_pretrain.trainer.metrics import peak_flops

    peak = peak_flops(device, cfg.parallel.precision, cfg.logging.peak_flops)[0]
    res["tflops"] = {k: v * model_flops_per_token(cfg) / 1e12 for k, v in res["tokens_per_s"].items()}
    res["mfu"] = {k: v * 1e12 / peak for k, v in res["tflops"].items()} if peak else None
    if args.breakdown:
        ph = {k: [] for k in models}
        for r in range(args.breakdown_pairs):
            mbs = batches[n + r]
            for name in ("ours", "ref") if r % 2 == 0 else ("ref", "ours"):
                ph[name].append(models[name].phases(mbs, clock))
        res["phases_s"] = {k: {p: statistics.median(x[p] for x in v) for p in v[0]} for k, v in ph.items()}
    models["ours"].eng.ds.destroy()
    return res


def report(r: dict) -> None:
    ours, ref = r["median_s"], r["median_wall_s"]
    print(
        f"\nstep time, ours (build_engine + train_step) vs bare PyTorch (HF LlamaForCausalLM, SDPA, torch AdamW): "
        f"{r['config']}, {r['device']}, {r['precision']}, ZeRO {r['zero_stage']}, global batch {r['global_batch']} "
        f"(micro {r['micro_batch']}) x seq {r['seq_length']}, reference vocabulary {r['ref_vocab']}; {r['pairs']} "
        f"alternating pairs, clock: {r['clock']}; our loss: "
        + ("unfused" if r["loss_chunk_tokens"] is None else f"fused, {r['loss_chunk_tokens']} tokens a chunk")
    )
    head = f"{'median':>10} {'min':>10} {'wall median':>12} {'tokens/s':>12} {'TFLOP/s':>8} {'MFU':>7} {'loss 1st':>8}"
    print(f"  {'':6} {head}")
    for k in ("ours", "ref"):
        mfu = f"{100 * r['mfu'][k]:>6.2f}%" if r["mfu"] else f"{'n/a':>7}"
        print(
            f"  {k:6} {ours[k] * 1e3:>8.1f}ms {r['min_s'][k] * 1e3:>8.1f}ms {ref[k] * 1e3:>10.1f}ms "
            f"{r['tokens_per_s'][k]:>12,.0f} {r['tflops'][k]:>8.2f} {mfu} {r['first_loss'][k]:>8.4f}"
        )
    if "phases_s" in r:
        print("  breakdown (medians of separate timed steps): " + ", ".join(r["phases_s"]["ours"]))
        for k, ph in r["phases_s"].items():
            print(f"  {k:6} " + "  ".join(f"{p} {v * 1e3:8.1f}ms" for p, v in ph.items()))
    ok = "ok" if r["ratio_pairs"] <= 1.10 else "above"
    print(
        f"OURS/REF = {r['ratio_pairs']:.3f} (median of pair ratios; medians' ratio {r['ratio_medians']:.3f}, "
        f"wall medians' ratio {r['ratio_wall_medians']:.3f})  {ok} (target <= 1.10)"
    )


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
    ap.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (ours and the reference)")
    args = ap.parse_args(argv)
    import warnings

    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed.*")
    from leviathan_pretrain.config import load_config
    from leviathan_pretrain.model.settings import resolve_device

    cfg_overrides = [*args.overrides, f"train.steps={args.warmup + 2 * args.pairs + 10}"]
    cfg = load_config(args.config, cfg_overrides)
    if cfg.parallel.tensor_parallel * cfg.parallel.pipeline_parallel != 1:
        sys.exit("error: bench_step.py runs one process: parallel.tensor_parallel=1 parallel.pipeline_parallel=1")
    accel = "cpu" if resolve_device(cfg.parallel.device).type == "cpu" else "cuda"
    os.environ.setdefault("DS_ACCELERATOR", accel)  # before deepspeed is imported (as bench_train.launch_env)
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)  # one process of its own, whatever launched us
    import torch

    from leviathan_pretrain.parallel import destroy_distributed, init_distributed

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
    return 0


if __name__ == "__main__":
    sys.exit(main())
