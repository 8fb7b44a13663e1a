#!/usr/bin/env python
"""data_prep.train_tokenizer --kind bpe (tokenizers' byte-level BPE) vs --kind sentencepiece (SentencePiece BPE),
side by side on the same seeded sample (a script, not a test).

  python benchmarks/bench_train_tokenizer.py [--input FILE] [--vocab-size 32000] [--sample-bytes 20] [--reps 3]

Each run is the whole command (sample + train + write), timed with wall clock, alternating S B S B ... after one
warm-up each; the training time is the one each writes into tokenizer_meta.json (``elapsed_s.train``). Printed: every
run, the medians and ``ratio = median train(SentencePiece) / median train(BPE)`` (> 1: the BPE trains faster).
Default input: the minipile train split (/tmp/minipile/train/00.jsonl.zst, built with data_prep.make_corpus if
missing). Other work on the machine adds noise: only the side-by-side ratio is meaningful.
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


def once(kind: str, args, out: Path) -> dict:
    cmd = [sys.executable, "-m", "data_prep.train_tokenizer", "--kind", kind, "--input", args.input]
    cmd += ["--vocab-size", str(args.vocab_size), "--sample-bytes", str(args.sample_bytes), "--out", str(out)]
    cmd += ["--overwrite", "--threads", str(args.threads)]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), check=True, capture_output=True)
    wall = time.perf_counter() - t0
    meta = json.loads((out / "tokenizer_meta.json").read_text())
    return {"wall": wall, "train": meta["elapsed_s"]["train"], "vocab": meta["vocab_size"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", default="/tmp/minipile/train/00.jsonl.zst")
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--sample-bytes", type=float, default=20.0, metavar="MB")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    if not os.path.exists(args.input):
        corpus = Path(args.input).parents[1]
        print(f"building the corpus in {corpus} ...", flush=True)
        subprocess.run(
            [sys.executable, "-m", "data_prep.make_corpus", "--out", str(corpus), "--overwrite"], cwd=REPO, check=True
        )
    work = Path(tempfile.mkdtemp(prefix="bench_train_tokenizer_"))
    kinds = (("S", "sentencepiece"), ("B", "bpe"))
    print(f"input {args.input}, vocab {args.vocab_size:,}, sample {args.sample_bytes} MB, threads {args.threads}")
    for _, kind in kinds:
        once(kind, args, work / kind)  # warm-up (page cache, imports)
    res = {k: [] for k, _ in kinds}
    for i in range(args.reps):
        for k, kind in kinds:
            r = once(kind, args, work / kind)
            res[k].append(r)
            print(f"  rep {i + 1} {kind:13s} train {r['train']:6.2f} s  whole command {r['wall']:6.2f} s", flush=True)
    med = {k: statistics.median(r["train"] for r in v) for k, v in res.items()}
    for k, kind in kinds:
        print(f"{kind:13s} median train {med[k]:6.2f} s  ({res[k][0]['vocab']:,} ids)")
    pairs = [a["train"] / b["train"] for a, b in zip(res["S"], res["B"])]
    print("pairwise S/B: " + ", ".join(f"{p:.3f}" for p in pairs))
    print(f"ratio (SentencePiece train / byte-level BPE train) {med['S'] / med['B']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
