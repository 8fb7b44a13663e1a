"""Step time with ``model.compile`` over eager, side by side in one launch: ``python benchmarks/bench_compile.py``.

For each ``--layouts`` entry one launch (``launchers/local.py``, one process per rank) builds two engines from the
same seed with the trainer's own ``build_engine``: eager and with ``model.compile=true`` (plus any ``key=value``
overrides, e.g. ``model.activation_fusion=true``, for both). Their optimizer steps alternate on the same global
batches (eager, compiled, eager, ...) at a constant LR, so a noisy neighbour slows both alike. Reported per
layout: the compile cost (the compiled engine's first step minus the eager one's, wall time), the median step
time of each after ``--warmup`` steps and the ratio compiled/eager (< 1: compile is faster), and the largest
difference of the two engines' losses over every step, which must stay within ``--tol`` (exit code 1
otherwise: the check that compiled layers train as eager ones do, on every layout). Step time: CPU time
(``process_time``) for a one-process CPU launch, else wall time between barriers (synchronised on CUDA).

Layouts: ``z0`` (1 process, ZeRO 0); ``z1`` / ``z2`` / ``z3`` (2 processes, data parallel at that ZeRO stage,
micro-batch 4); ``tp2`` (tensor parallel 2, ZeRO 1); ``pp2`` (DeepSpeed's pipeline engine, 2 stages, ZeRO 1).

    python benchmarks/bench_compile.py                          # tiny-cpu LEV, z0, 20 steps
    python benchmarks/bench_compile.py --layouts z1 z3 tp2 pp2 --steps 5 --warmup 1   # the layout check
    python benchmarks/bench_compile.py --config configs/400m-lev.yaml --layouts z0 parallel.device=cuda \\
        parallel.precision=bf16 model.activation_fusion=true     # on a GPU
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

HALF = "train.micro_batch_size=4"  # data parallel 2: the tiny-cpu global batch of 8 is 2 x 4 per step
LAYOUTS = {  # name: (processes, overrides)
    "z0": (1, ["parallel.zero_stage=0"]),
    "z1": (2, ["parallel.zero_stage=1", HALF]),
    "z2": (2, ["parallel.zero_stage=2", HALF]),
    "z3": (2, ["parallel.zero_stage=3", HALF]),
    "tp2": (2, ["parallel.zero_stage=1", "parallel.tensor_parallel=2"]),
    "pp2": (2, ["parallel.zero_stage=1", "parallel.pipeline_parallel=2"]),
}


def worker(args) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    from benchmarks.bench_train import paired_engines
    from leviathan_pretrain.config import load_config
    from leviathan_pretrain.parallel.groups import destroy_distributed

    common = [
        f"data.prefixes=[{args.data}]",
        "train.eval_interval=0",
        "data.split=90,5,5",
        f"train.steps={args.warmup + args.steps}",
        *LAYOUTS[args.layouts[0]][1],
        *args.overrides,
    ]
    cfgs = {
        "eager": load_config(args.config, [*common, "model.compile=false"]),
        "compiled": load_config(args.config, [*common, "model.compile=true"]),
    }
    denv, engines, batches = paired_engines(cfgs, "eager")
    cuda = denv.device.type == "cuda"
    t = cfgs["eager"].train
    cpu_clock = dist.get_world_size() == 1 and not cuda
    clock = time.process_time if cpu_clock else time.perf_counter
    times, losses, first = {n: [] for n in engines}, {n: [] for n in engines}, {}
    for step in range(args.warmup + args.steps):
        mbs = batches.global_batch(step * t.global_batch_size)
        for name, eng in engines.items():
            eng.set_lr(cfgs[name].optim.lr)  # a constant LR: the same for both
            dist.barrier()
            if cuda:
                torch.cuda.synchronize()
            t0, w0 = clock(), time.perf_counter()
            loss, _ = eng.train_step(mbs)
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()
            dt = clock() - t0
            losses[name].append(loss)
            if step == 0:
                first[name] = time.perf_counter() - w0  # wall: inductor compiles in worker processes too
            elif step >= args.warmup:
                times[name].append(dt)
    if dist.get_rank() == 0:
        med = {n: statistics.median(ts) for n, ts in times.items()}
        out = {
            "layout": args.layouts[0],
            "clock": "cpu" if cpu_clock else "wall",
            "median_s": med,
            "ratio": med["compiled"] / med["eager"],
            "compile_s": first["compiled"] - first["eager"],
            "max_loss_diff": max(abs(a - b) for a, b in zip(losses["eager"], losses["compiled"])),
            "losses": losses,
        }
        print("RESULT " + json.dumps(out), flush=True)
    for eng in engines.values():
        eng.ds.destroy()
    destroy_distributed()


def run_layout(layout: str, args, data: str) -> dict:
    from leviathan_pretrain.config import load_config
    from leviathan_pretrain.model.settings import resolve_device

    cfg = load_config(args.config, [*LAYOUTS[layout][1], *args.overrides])
    accel = "cpu" if resolve_device(cfg.parallel.device).type == "cpu" else "cuda"
    env = dict(os.environ, PYTHONPATH=str(REPO), DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", accel))
    cmd = [sys.executable, str(REPO / "launchers" / "local.py"), "-n", str(LAYOUTS[layout][0]), "--"]
    cmd += [str(Path(__file__).resolve()), "--worker", "--layouts", layout, "--data", data, "--config", args.config]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), *args.overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return {"layout": layout, "error": f"exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python benchmarks/bench_compile.py",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--config", default=str(REPO / "configs/tiny-cpu-lev.yaml"), help="model/run config")
    ap.add_argument("--layouts", nargs="+", default=["z0"], choices=sorted(LAYOUTS), help="default: z0")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per engine (default 20)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first, the compile among them (default 3)")
    ap.add_argument("--tol", type=float, default=1e-5, help="largest allowed |loss difference| (default 1e-5)")
    ap.add_argument("--data", default=None, help="shard prefix (default: a synthetic Zipf shard)")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per launch")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for both engines")
    args = ap.parse_args(argv)
    if args.warmup < 1:
        ap.error("--warmup must be >= 1 (the first step compiles)")
    if args.worker:
        worker(args)
        return 0
    import warnings

    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed.*")
    from benchmarks.bench_train import shard_for_steps
    from leviathan_pretrain.config import load_config

    cfg = load_config(args.config, args.overrides)
    with tempfile.TemporaryDirectory(prefix="bench-compile-") as tmp:
        data = args.data or shard_for_steps(cfg, args.steps + args.warmup, tmp)
        results = [run_layout(layout, args, data) for layout in args.layouts]
    print(
        f"\nmodel.compile vs eager, {Path(args.config).name} {' '.join(args.overrides)}: median of {args.steps} "
        f"alternating steps after {args.warmup} warm-up"
    )
    print(
        f"{'layout':8} {'clock':>5} {'eager s':>9} {'compiled s':>10} {'ratio':>7} {'compile s':>9} {'max |dloss|':>11}"
    )
    bad = 0
    for r in results:
        if "error" in r:
            print(f"{r['layout']:8} failed: {r['error']}")
            bad += 1
            continue
        ok = r["max_loss_diff"] <= args.tol
        bad += not ok
        print(
            f"{r['layout']:8} {r['clock']:>5} {r['median_s']['eager']:>9.4f} {r['median_s']['compiled']:>10.4f} "
            f"{r['ratio']:>7.3f} {r['compile_s']:>9.1f} {r['max_loss_diff']:>11.2e}"
            + ("" if ok else f"  over --tol {args.tol:g}")
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
