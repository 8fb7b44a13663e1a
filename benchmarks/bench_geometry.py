"""What one token-vector geometry measurement costs the trainer (``logging.geometry_interval``), against one step.

    python benchmarks/bench_geometry.py --config configs/1.2b-lev.yaml [--reps 3] [key=value ...]

One process: the trainer's engine (``build_engine``) on the config's device, then, side by side in the same
process, the median of ``--reps`` training steps (random tokens) and of ``--reps`` calls of
``trainer.geometry_log.geometry_stats`` (the input rows and the head rows over the 2,048 seeded ids, on the
device where the parameters are); prints both and their ratio, i.e. what a measurement every N steps adds: ratio / N.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/tiny-cpu-lev.yaml")
    ap.add_argument("--reps", type=int, default=3, help="timed steps and measurements, each (default 3)")
    ap.add_argument("overrides", nargs="*", metavar="key=value")
    args = ap.parse_args(argv)
    from leviathan_pretrain.config import load_config
    from leviathan_pretrain.model.settings import resolve_device

    cfg = load_config(args.config, [*args.overrides, "train.steps=1000"])
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if resolve_device(cfg.parallel.device).type == "cpu" else "cuda")
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)
    import torch

    from leviathan_pretrain.parallel.groups import destroy_distributed, init_distributed, parallel_dims, seed_everything
    from leviathan_pretrain.trainer.engine import build_engine
    from leviathan_pretrain.trainer.geometry_log import geometry_stats, id_groups

    denv = init_distributed(cfg.parallel)
    device = denv.device

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    from benchmarks.bench_step import zipf_batches

    batches = zipf_batches(cfg, args.reps + 1)  # bench_step's micro-batches: Zipf ids, labels the next id
    seed_everything(cfg.train.seed, device)
    eng = build_engine(cfg, device)
    eng.set_lr(cfg.optim.lr)
    dims = parallel_dims(cfg.train.micro_batch_size, cfg.train.global_batch_size)
    done = []

    def step() -> None:
        eng.train_step(batches[len(done)])
        done.append(1)

    groups = id_groups(cfg)
    timings = {"step": [], "geometry": []}
    stats = {}
    for i in range(args.reps + 1):  # the first of each untimed (warm-up)
        for name, fn in (
            ("step", step),
            ("geometry", lambda: stats.update(geometry_stats(cfg, eng.module(), dims, groups))),
        ):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if i:
                timings[name].append(time.perf_counter() - t0)
    s, g = statistics.median(timings["step"]), statistics.median(timings["geometry"])
    print(f"{args.config} on {device}: step {s:.3f} s, geometry measurement {g:.3f} s (median of {args.reps}); "
          f"geometry / step {g / s:.3f}: every 100 steps it adds {g / s / 100:.2%} to the run")  # fmt: skip
    print("  " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(stats.items())))
    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
