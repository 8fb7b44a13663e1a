#!/usr/bin/env python
"""data_prep.tokenize vs a minimal SentencePiece-only process, side by side (a script, not a test).

  python benchmarks/bench_tokenize.py [--input FILE] [--tokenizer MODEL] [--workers 2] [--reps 3]

Both are whole processes, timed from start to exit (files written) with subprocess + os.wait4:

  A  the yardstick: read the same jsonl(.zst) (zstandard + orjson), collect every text, one
     ``sp.encode(texts, num_threads=W)`` - close to the ceiling of this tokenizer on W cores;
  B  ``python -m data_prep.tokenize --input FILE --tokenizer MODEL --workers W`` (shards, counts,
     manifest written).

After one warm-up each (page cache), A and B run in turn A B A B ... ``--reps`` times. Printed: every
run (wall, cpu, peak RSS), the medians and, last, ``ratio = median wall(A) / median wall(B)``
(>= 1 means data_prep is at least as fast as the bare encode loop). Defaults: the ~80 MB minipile
train split at /tmp/minipile/train/00.jsonl.zst (built with data_prep.make_corpus if missing) and a
32k BPE tokenizer trained on it (cached under --cache). Other work on the machine adds noise: only
side-by-side ratios are meaningful.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SP_ONLY = r"""
import sys
import orjson
import sentencepiece as spm
import zstandard

model, workers, paths = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
sp = spm.SentencePieceProcessor(model_file=model)
texts = []
for path in paths:
    with open(path, "rb") as f:
        data = zstandard.ZstdDecompressor().stream_reader(f).read() if path.endswith(".zst") else f.read()
    texts.extend(orjson.loads(line)["text"] for line in data.split(b"\n") if line)
ids = sp.encode(texts, num_threads=workers)
print(len(texts), sum(map(len, ids)))
"""


def run(cmd, env=None) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        out = proc.stdout.read()
        _, status, ru = os.wait4(proc.pid, 0)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"command failed ({proc.returncode}): {' '.join(cmd)}")
    return {"wall": wall, "cpu": ru.ru_utime + ru.ru_stime, "rss_mb": ru.ru_maxrss / 1024, "out": out.decode()}


def ensure_inputs(args) -> tuple[str, str]:
    cache = Path(args.cache)
    inp = args.input
    if not os.path.exists(inp):
        corpus = cache / "minipile"
        inp = str(corpus / "train" / "00.jsonl.zst")
        if not os.path.exists(inp):
            print(f"building the corpus in {corpus} ...", flush=True)
            subprocess.run(
                [sys.executable, "-m", "data_prep.make_corpus", str(corpus), "--force"], cwd=REPO, check=True
            )
    tok = args.tokenizer
    if not tok:
        d = cache / "tokenizer32k"
        tok = str(d / "tokenizer.model")
        if not os.path.exists(tok):
            print(f"training a 32k tokenizer in {d} ...", flush=True)
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "data_prep.train_tokenizer",
                    "--input",
                    inp,
                    "--vocab-size",
                    "32000",
                    "--sample-bytes",
                    "20",
                    "--output",
                    str(d),
                    "--overwrite",
                ],
                cwd=REPO,
                check=True,
            )
    return inp, tok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", default="/tmp/minipile/train/00.jsonl.zst")
    ap.add_argument("--tokenizer", help="SentencePiece model (default: a cached 32k BPE trained on --input)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cache", default=str(REPO / ".cache" / "bench"))
    ap.add_argument("--extra", default="", help="extra arguments for data_prep.tokenize (quoted)")
    args = ap.parse_args()
    inp, tok = ensure_inputs(args)
    work = Path(tempfile.mkdtemp(prefix="bench_tokenize_"))
    try:
        script = work / "sp_only.py"
        script.write_text(SP_ONLY)
        a_cmd = [sys.executable, str(script), tok, str(args.workers), inp]
        b_cmd = [
            sys.executable,
            "-m",
            "data_prep.tokenize",
            "--input",
            inp,
            "--tokenizer",
            tok,
            "--output-prefix",
            str(work / "out" / "train"),
            "--workers",
            str(args.workers),
            "--overwrite",
            "--no-progress",
            *args.extra.split(),
        ]
        env = dict(os.environ, PYTHONPATH=str(REPO))
        print(f"input {inp} ({os.path.getsize(inp) / 1e6:.1f} MB), tokenizer {tok}, workers {args.workers}")
        print("warm-up ...", flush=True)
        base = run(a_cmd, env)
        run(b_cmd, env)
        docs, toks = map(int, base["out"].split())
        m = json.loads((work / "out" / "train.manifest.json").read_text())
        assert m["documents"] == docs and m["tokens"] == toks + docs, (m["documents"], m["tokens"], docs, toks)
        res = {"A": [], "B": []}
        for i in range(args.reps):
            for k, cmd in (("A", a_cmd), ("B", b_cmd)):
                r = run(cmd, env)
                res[k].append(r)
                print(
                    f"  rep {i + 1} {k}: wall {r['wall']:6.2f} s  cpu {r['cpu']:6.2f} s  peak RSS "
                    f"{r['rss_mb']:7.1f} MB",
                    flush=True,
                )
        med = {k: {f: statistics.median(r[f] for r in v) for f in ("wall", "cpu", "rss_mb")} for k, v in res.items()}
        mb = m["text_bytes"] / 1e6
        for k, name in (("A", "SentencePiece only"), ("B", "data_prep.tokenize")):
            print(
                f"{k} {name:20s} median wall {med[k]['wall']:6.2f} s ({mb / med[k]['wall']:.2f} MB/s)  "
                f"cpu {med[k]['cpu']:6.2f} s  peak RSS {med[k]['rss_mb']:7.1f} MB"
            )
        pairs = [a["wall"] / b["wall"] for a, b in zip(res["A"], res["B"])]
        print(f"pairwise A/B: {', '.join(f'{p:.3f}' for p in pairs)}")
        print(f"ratio {med['A']['wall'] / med['B']['wall']:.3f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
