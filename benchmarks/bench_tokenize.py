#!/usr/bin/env python
"""data_prep.tokenize vs the tokenizer library's own batch encode, side by side, per tokenizer kind (a script, not a
test).

  python benchmarks/bench_tokenize.py [--kind sentencepiece|huggingface|tiktoken|all] [--input FILE]
                                      [--tokenizer PATH] [--workers 2] [--reps 3]

Both are whole processes, timed from start to exit (files written) with subprocess + os.wait4:

  A  the yardstick: read the same jsonl(.zst) (zstandard + orjson), collect every text, one in-memory batch
     encode by the library with W threads - ``sp.encode(texts, num_threads=W)`` (SentencePiece),
     ``encode_batch_fast(texts)`` with RAYON_NUM_THREADS=W (tokenizers), ``encode_ordinary_batch(texts,
     num_threads=W)`` (tiktoken) - close to the ceiling of this tokenizer on W cores;
  B  ``python -m data_prep.tokenize --input FILE --tokenizer MODEL --workers W`` (shards, counts,
     manifest written).

After one warm-up each (page cache), A and B run in turn A B A B ... ``--reps`` times. Printed: every
run (wall, cpu, peak RSS), the medians and, last, ``ratio = median wall(A) / median wall(B)``
(>= 1 means data_prep is at least as fast as the bare encode loop), per kind. Defaults: the ~80 MB minipile
train split at /tmp/minipile/train/00.jsonl.zst (built with data_prep.make_corpus if missing); tokenizers: a 32k
SentencePiece BPE and a 32k byte-level BPE tokenizer.json trained on it (cached under --cache), GPT-2's ranks file
(r50k_base) from the test assets scripts/setup.sh fetches. Other work on the machine adds noise: only side-by-side
ratios are meaningful.
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

LIBRARY_ONLY = r"""
import os, sys
kind, model, workers, paths = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
os.environ["RAYON_NUM_THREADS"] = str(workers)
os.environ["TOKENIZERS_PARALLELISM"] = "true"
import orjson
import zstandard

texts = []
for path in paths:
    with open(path, "rb") as f:
        data = zstandard.ZstdDecompressor().stream_reader(f).read() if path.endswith(".zst") else f.read()
    texts.extend(orjson.loads(line)["text"] for line in data.split(b"\n") if line)
if kind == "sentencepiece":
    import sentencepiece as spm

    ids = spm.SentencePieceProcessor(model_file=model).encode(texts, num_threads=workers)
elif kind == "huggingface":
    import tokenizers

    ids = [e.ids for e in tokenizers.Tokenizer.from_file(model).encode_batch_fast(texts, add_special_tokens=False)]
else:
    import base64
    import tiktoken
    from tiktoken_ext import openai_public

    ranks = {}
    for line in open(model, "rb"):
        if line.strip():
            t, r = line.split()
            ranks[base64.b64decode(t)] = int(r)
    enc = tiktoken.Encoding("bench", pat_str=openai_public.r50k_pat_str, mergeable_ranks=ranks, special_tokens={})
    ids = enc.encode_ordinary_batch(texts, num_threads=workers)
print(len(texts), sum(map(len, ids)))
"""
KINDS = ("sentencepiece", "huggingface", "tiktoken")


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


def ensure_corpus(args) -> str:
    cache = Path(args.cache)
    inp = args.input
    if not os.path.exists(inp):
        corpus = cache / "minipile"
        inp = str(corpus / "train" / "00.jsonl.zst")
        if not os.path.exists(inp):
            print(f"building the corpus in {corpus} ...", flush=True)
            subprocess.run(
                [sys.executable, "-m", "data_prep.make_corpus", "--out", str(corpus), "--overwrite"],
                cwd=REPO,
                check=True,
            )
    return inp


def ensure_tokenizer(args, kind: str, inp: str) -> str:
    """``--tokenizer``, or this kind's default (trained on ``inp`` and cached, or GPT-2's ranks for tiktoken)."""
    cache = Path(args.cache)
    if args.tokenizer:
        return args.tokenizer
    if kind == "tiktoken":
        p = Path(sys.prefix) / "test-assets" / "gpt2.tiktoken"
        if not p.is_file():
            sys.exit(f"{p} is missing: run scripts/setup.sh (it fetches GPT-2's ranks), or pass --tokenizer")
        return str(p)
    if kind == "huggingface":
        d = cache / "bpe32k"
        tok = d / "tokenizer.json"
        if not tok.exists():
            print(f"training a 32k byte-level BPE in {d} ...", flush=True)
            subprocess.run([sys.executable, "-c", TRAIN_BPE, inp, str(d)], cwd=REPO, check=True)
        return str(tok)
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
                "--out",
                str(d),
                "--overwrite",
            ],
            cwd=REPO,
            check=True,
        )
    return tok


TRAIN_BPE = r"""
import sys, itertools, orjson, zstandard
from pathlib import Path
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
inp, out = sys.argv[1], Path(sys.argv[2])
with open(inp, "rb") as f:
    data = zstandard.ZstdDecompressor().stream_reader(f).read(20_000_000)
texts = [orjson.loads(x)["text"] for x in data.split(b"\n")[:-1] if x]
tk = Tokenizer(models.BPE())
tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tk.decoder = decoders.ByteLevel()
tk.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=32000, special_tokens=["<|endoftext|>"],
                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
out.mkdir(parents=True, exist_ok=True)
tk.save(str(out / "tokenizer.json"))
"""


def bench(args, kind: str, inp: str, work: Path) -> float:
    tok = ensure_tokenizer(args, kind, inp)
    script = work / "library_only.py"
    script.write_text(LIBRARY_ONLY)
    a_cmd = [sys.executable, str(script), kind, tok, str(args.workers), inp]
    extra = ["--tiktoken-pattern", "r50k"] if kind == "tiktoken" and args.tokenizer else []
    b_cmd = [sys.executable, "-m", "data_prep.tokenize", "--input", inp, "--tokenizer", tok, *extra]
    b_cmd += ["--out", str(work / kind / "train"), "--workers", str(args.workers), "--overwrite"]
    b_cmd += ["--quiet", *args.extra.split()]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    print(f"[{kind}] input {inp} ({os.path.getsize(inp) / 1e6:.1f} MB), tokenizer {tok}, workers {args.workers}")
    print("warm-up ...", flush=True)
    base = run(a_cmd, env)
    run(b_cmd, env)
    docs, toks = map(int, base["out"].split())
    m = json.loads((work / kind / "train.manifest.json").read_text())
    assert m["documents"] == docs and m["tokens"] == toks + docs, (m["documents"], m["tokens"], docs, toks)
    res = {"A": [], "B": []}
    for i in range(args.reps):
        for k, cmd in (("A", a_cmd), ("B", b_cmd)):
            r = run(cmd, env)
            res[k].append(r)
            print(
                f"  rep {i + 1} {k}: wall {r['wall']:6.2f} s  cpu {r['cpu']:6.2f} s  peak RSS {r['rss_mb']:7.1f} MB",
                flush=True,
            )
    med = {k: {f: statistics.median(r[f] for r in v) for f in ("wall", "cpu", "rss_mb")} for k, v in res.items()}
    mb = m["text_bytes"] / 1e6
    for k, name in (("A", f"{kind} library only"), ("B", "data_prep.tokenize")):
        print(
            f"{k} {name:26s} median wall {med[k]['wall']:6.2f} s ({mb / med[k]['wall']:.2f} MB/s)  "
            f"cpu {med[k]['cpu']:6.2f} s  peak RSS {med[k]['rss_mb']:7.1f} MB"
        )
    pairs = [a["wall"] / b["wall"] for a, b in zip(res["A"], res["B"])]
    print(f"pairwise A/B: {', '.join(f'{p:.3f}' for p in pairs)}")
    ratio = med["A"]["wall"] / med["B"]["wall"]
    print(f"[{kind}] ratio {ratio:.3f}", flush=True)
    return ratio


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", default="all", choices=(*KINDS, "all"))
    ap.add_argument("--input", default="/tmp/minipile/train/00.jsonl.zst")
    ap.add_argument("--tokenizer", help="the tokenizer (default: per kind, see above); needs one --kind")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cache", default=str(REPO / ".cache" / "bench"))
    ap.add_argument("--extra", default="", help="extra arguments for data_prep.tokenize (quoted)")
    args = ap.parse_args()
    if args.tokenizer and args.kind == "all":
        ap.error("--tokenizer needs one --kind")
    inp = ensure_corpus(args)
    work = Path(tempfile.mkdtemp(prefix="bench_tokenize_"))
    try:
        ratios = {k: bench(args, k, inp, work) for k in (KINDS if args.kind == "all" else (args.kind,))}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        "ratio (library only / data_prep, whole process, >= 0.85 wanted): "
        + ", ".join(f"{k} {r:.3f}" for k, r in ratios.items())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
