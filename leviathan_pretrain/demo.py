"""The main job on the embedded default corpus: ``python -m leviathan_pretrain.demo`` (what ``make demo`` runs).

1. Prepares the data with ``python -m data_prep.demo --out <out>`` (a corpus from the Python standard
   library's sources -> SentencePiece tokenizer -> megatron-core shards; idempotent).
2. Trains the ``tiny-cpu`` LEV model on 2 local processes with tensor parallelism 2
   (``launchers/local.py``), with periodic validation and checkpoints, for a few minutes.
3. Prints where the checkpoints and TensorBoard logs are.

Re-running continues from the last checkpoint (and does nothing once the run is complete); ``--fresh``
starts the training over. Exit code: the trainer's (0 done; 75 stopped early with a checkpoint: re-run).
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def find_training_data(out: Path) -> tuple[str, str | None, int | None]:
    """(shard prefix, tokenizer path, tokenizer vocabulary) from the data_prep manifests under ``out``."""
    manifests = []
    for path in sorted(out.rglob("*.manifest.json")):
        try:
            m = json.loads(path.read_text())
        except ValueError:
            continue
        prefix = str(path)[: -len(".manifest.json")]
        if Path(prefix + ".idx").is_file() and Path(prefix + ".bin").is_file():
            manifests.append((prefix, m))
    if not manifests:
        raise SystemExit(f"error: no data_prep shard (PREFIX.manifest.json with .bin/.idx) under {out}")
    named = [x for x in manifests if "train" in Path(x[0]).name]
    prefix, m = max(named or manifests, key=lambda x: x[1].get("tokens", 0))
    tok = m.get("tokenizer") if isinstance(m.get("tokenizer"), dict) else {}
    return prefix, tok.get("path"), tok.get("vocab_size")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m leviathan_pretrain.demo", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="extra key=value overrides go to the trainer, e.g. train.steps=60")
    ap.add_argument("--out", default="runs/demo", help="demo directory (default runs/demo)")
    ap.add_argument("--config", default=str(REPO / "configs/tiny-cpu-lev.yaml"), help="training config")
    ap.add_argument("--nprocs", type=int, default=2, help="local ranks (default 2, all tensor-parallel)")
    ap.add_argument("--steps", type=int, default=150, help="training steps (default 150: a few minutes on 2 cores)")
    ap.add_argument("--data-prefix", default=None, help="use this shard instead of running data_prep.demo")
    ap.add_argument("--fresh", action="store_true", help="delete the previous demo training run first")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="more trainer overrides")
    args = ap.parse_args(argv)
    out = Path(args.out)
    run_dir = out / "train"

    if args.data_prefix:
        prefix, tokenizer, vocab = args.data_prefix, None, None
    else:
        print(f"[demo] 1/3 preparing data: python -m data_prep.demo --out {out}", flush=True)
        rc = subprocess.call([sys.executable, "-m", "data_prep.demo", "--out", str(out)], cwd=REPO)
        if rc != 0:
            print(f"[demo] error: data preparation failed (exit {rc})", file=sys.stderr)
            return rc
        prefix, tokenizer, vocab = find_training_data(out)
    print(f"[demo] training data: {prefix}" + (f" (tokenizer {tokenizer}, {vocab} pieces)" if tokenizer else ""),
          flush=True)

    if args.fresh and run_dir.exists():
        shutil.rmtree(run_dir)
    overrides = [f"data.prefixes=[{prefix}]", f"train.out_dir={run_dir}", f"train.steps={args.steps}",
                 f"parallel.tensor_parallel={args.nprocs}", "data.split=95,5,0", "train.eval_interval=50",
                 "train.eval_iters=4", "checkpoint.save_interval=50", "logging.log_interval=10"]
    if tokenizer and Path(tokenizer).is_file():
        overrides.append(f"data.tokenizer={tokenizer}")
    if vocab:
        overrides.append(f"model.vocab_size={vocab}")
    overrides += args.overrides
    cmd = [sys.executable, str(REPO / "launchers/local.py"), "-n", str(args.nprocs), "--", "-m",
           "leviathan_pretrain.train", "--config", args.config, *overrides]
    print(f"[demo] 2/3 training the tiny-cpu LEV model on {args.nprocs} local processes (TP={args.nprocs}):\n"
          f"       {' '.join(cmd[1:])}", flush=True)
    rc = subprocess.call(cmd, cwd=REPO)

    print("[demo] 3/3 results", flush=True)
    log = run_dir / "train_log.jsonl"
    if log.is_file():
        recs = [json.loads(x) for x in log.read_text().splitlines()]
        train = [r for r in recs if "loss" in r]
        valid = [r for r in recs if "valid_loss" in r]
        if train:
            print(f"[demo] train loss: step 1 {train[0]['loss']:.3f} -> step {train[-1]['step']} {train[-1]['loss']:.3f}")
        if valid:
            print(f"[demo] validation loss at step {valid[-1]['step']}: {valid[-1]['valid_loss']:.3f} "
                  f"(perplexity {valid[-1]['valid_perplexity']:.1f})")
    ck = run_dir / "checkpoints"
    if (ck / "latest").is_file():
        print(f"[demo] checkpoint: {ck / (ck / 'latest').read_text().strip()}  (re-run to continue from it)")
    print(f"[demo] TensorBoard: tensorboard --logdir {run_dir / 'tensorboard'}")
    if rc == 75:
        print("[demo] training stopped early with a checkpoint; run the demo again to continue")
    elif rc != 0:
        print(f"[demo] error: training failed (exit {rc})", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
