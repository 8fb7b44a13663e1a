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
``train_log.jsonl`` and ``config.json`` (``benchmarks/gpu_summary.py``, which ``benchmarks/gpu_check.sh`` calls).
"""

from __future__ import annotations

import argparse
import json
import os
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
    from leviathan_pretrain.data.datasets import Batches, build_datasets, data_summary
    from leviathan_pretrain.parallel.groups import init_distributed, parallel_dims, seed_everything
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
    from leviathan_pretrain.parallel.groups import destroy_distributed

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
    if args.summarize is not None:  # benchmarks/gpu_summary.py's, kept here for the command lines that use it
        from benchmarks.gpu_summary import main as summary_main

        extra = [*(["--json", args.json] if args.json else []), *(["--md", args.md] if args.md else [])]
        return summary_main([*args.summarize, "--warmup", str(args.warmup), "--attach", *args.attach, *extra])
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
