#!/usr/bin/env python
"""data_prep.tokenize on Parquet vs on jsonl.zst, the same documents, side by side (a script, not a test).

  python benchmarks/bench_tokenize_parquet.py [--input FILE.jsonl.zst] [--workers 2] [--reps 3] [--row-group 1000]

The jsonl input (default: the ~80 MB minipile train split, built if missing, as bench_tokenize.py does) is written
once as Parquet (text column, ``meta`` as a struct, zstd pages, ``--row-group`` rows a group: FineWeb's files hold
~1k-100k rows a group), cached beside the 32k SentencePiece tokenizer under ``--cache``. Then, after one warm-up
each, J (``python -m data_prep.tokenize --input FILE.jsonl.zst``) and P (the same on the Parquet file) run in turn
J P J P ... ``--reps`` times, whole processes (shards, counts and manifest written). Printed: every run, the medians,
the pairwise ratios and ``ratio = median wall(J) / median wall(P)``: the Parquet path's rate as a share of the jsonl
path's (>= 0.95 wanted). The two shards are checked to be byte-identical first.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_tokenize as bt  # noqa: E402  (its corpus, tokenizer and process timing)


def to_parquet(src: str, dest: Path, row_group: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    with open(src, "rb") as f:
        raw = zstandard.ZstdDecompressor().stream_reader(f).read() if src.endswith(".zst") else f.read()
    recs = [json.loads(line) for line in raw.splitlines() if line.strip()]
    table = pa.table({"text": [r["text"] for r in recs], "meta": [r.get("meta") or {} for r in recs]})
    tmp = dest.with_suffix(".tmp")
    pq.write_table(table, tmp, row_group_size=row_group, compression="zstd")
    os.replace(tmp, dest)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", default="/tmp/minipile/train/00.jsonl.zst", help="a jsonl(.zst) file")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--row-group", type=int, default=1000, help="rows per Parquet row group (default 1000)")
    ap.add_argument("--cache", default=str(bt.REPO / ".cache" / "bench"))
    args = ap.parse_args()
    args.tokenizer = None
    inp = bt.ensure_corpus(args)
    tok = bt.ensure_tokenizer(args, "sentencepiece", inp)
    pqf = Path(args.cache) / f"{Path(inp).name.split('.')[0]}-{os.path.getsize(inp)}-rg{args.row_group}.parquet"
    if not pqf.exists():
        print(f"writing {pqf} ...", flush=True)
        to_parquet(inp, pqf, args.row_group)
    work = Path(tempfile.mkdtemp(prefix="bench_tokenize_parquet_"))
    env = dict(os.environ, PYTHONPATH=str(bt.REPO))
    cmds = {}
    for k, src in (("J", inp), ("P", str(pqf))):
        cmds[k] = [sys.executable, "-m", "data_prep.tokenize", "--input", src, "--tokenizer", tok, "--quiet"]
        cmds[k] += ["--out", str(work / k), "--workers", str(args.workers), "--overwrite"]
    try:
        print(f"J {inp} ({os.path.getsize(inp) / 1e6:.1f} MB), P {pqf} ({pqf.stat().st_size / 1e6:.1f} MB)")
        print("warm-up ...", flush=True)
        for k in cmds:
            bt.run(cmds[k], env)
        for ext in (".bin", ".idx"):
            if not filecmp.cmp(f"{work / 'J'}{ext}", f"{work / 'P'}{ext}", shallow=False):
                sys.exit(f"the Parquet shard's {ext} differs from the jsonl shard's")
        res = {"J": [], "P": []}
        for i in range(args.reps):
            for k in ("J", "P"):
                r = bt.run(cmds[k], env)
                res[k].append(r)
                print(
                    f"  rep {i + 1} {k}: wall {r['wall']:6.2f} s  cpu {r['cpu']:6.2f} s  peak RSS {r['rss_mb']:7.1f} MB"
                )
        mb = json.loads((work / "J.manifest.json").read_text())["text_bytes"] / 1e6
        med = {k: {f: statistics.median(r[f] for r in v) for f in ("wall", "cpu", "rss_mb")} for k, v in res.items()}
        for k, name in (("J", "jsonl.zst"), ("P", "Parquet")):
            m = med[k]
            rate, rss = f"({mb / m['wall']:.2f} MB/s of text)", f"peak RSS {m['rss_mb']:7.1f} MB"
            print(f"{k} {name:10s} median wall {m['wall']:6.2f} s {rate}  cpu {m['cpu']:6.2f} s  {rss}")
        pairs = [j["wall"] / p["wall"] for j, p in zip(res["J"], res["P"])]
        print(f"pairwise J/P: {', '.join(f'{p:.3f}' for p in pairs)}")
        print(f"ratio (Parquet rate / jsonl rate, >= 0.95 wanted): {med['J']['wall'] / med['P']['wall']:.3f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
