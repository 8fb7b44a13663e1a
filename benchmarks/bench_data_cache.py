#!/usr/bin/env python
"""Start-up data work at scale: ``build_data_cache`` on a synthetic >= 1e9-token shard (a script, not a test).

  python benchmarks/bench_data_cache.py [--tokens 1e9] [--seq-lengths 2048,512] [--global-batch 512]
                                        [--tmp DIR] [--pile-tokens 300e9] [--pile-docs 211e6]

1. Writes a uint16 shard of ``--tokens`` tokens into a temporary directory (deleted at the end, also on
   an error or SIGTERM; refused if the disk has < 3x its size free): GPT-2 vocabulary ids, documents of
   lognormal length (mean ~1,000 tokens, sigma 1, at least 1 token; last token EOD 50256), written in
   64 M-token chunks with numpy; its ``.idx`` with ``data_prep.shards.write_index`` (megatron's MMIDIDX),
   read back with megatron-core's ``IndexedDataset``. No ``counts.npy``: the first run must scan the shard.
2. For each sequence length: ``python -m leviathan_pretrain.build_data_cache`` in a subprocess for one
   epoch of training samples (``train.steps x train.global_batch_size`` = the train split's tokens /
   seq_length), split 969,30,1, ``train.eval_iters=10``: ``--repeats`` cold runs, each into a fresh cache
   dir with the shard evicted from the page cache (posix_fadvise), so each scans it from disk and builds
   all indices (the fastest is shown: the machine may be shared), then a warm run (everything cached:
   what a trainer start-up costs with a prebuilt cache). Wall time and peak RSS per
   process come from ``os.wait4``; steps and index file sizes from its ``--report``.
3. Prints a table and a linear extrapolation to the Pile: ``--pile-tokens`` (default 300e9: the Pile is
   ~825 GiB of text and the GPT-NeoX/Pythia papers count ~300 B GPT-2-style BPE tokens for one epoch of it;
   Pythia trained 299.9 B tokens = 1 epoch) and ``--pile-docs`` (211 M documents, the Pile paper's count).
   Times and index sizes are scaled by the token ratio (the sample and shuffle indices grow with tokens,
   the document index with documents: the Pile's documents are longer, ~1,420 tokens, so scaling document
   work by tokens overestimates it ~1.4x); peak RSS as the RSS before the index build + the build's own
   growth (its step peak minus that) x ratio.
Other work on the machine adds noise; the numbers are for one CPU process.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
VOCAB, EOD, MODEL_VOCAB = 50257, 50256, 50304  # GPT-2 ids; megatron pads the model vocab to 50304
CHUNK = 1 << 26  # tokens per write


def doc_lengths(tokens: int, rng, mean: float = 1000) -> np.ndarray:
    """Lognormal document lengths (mean ~``mean``, >= 1) summing to exactly ``tokens``."""
    mu, sigma = math.log(mean) - 0.5, 1.0  # mean of a lognormal = exp(mu + sigma^2 / 2)
    parts, total = [], 0
    while total < tokens:
        n = np.maximum(1, np.rint(rng.lognormal(mu, sigma, 1 << 20))).astype(np.int64)
        parts.append(n)
        total += int(n.sum())
    lengths = np.concatenate(parts)
    ends = np.cumsum(lengths)
    k = int(np.searchsorted(ends, tokens))  # first document reaching the total
    lengths = lengths[: k + 1]
    lengths[-1] -= int(ends[k]) - tokens
    if lengths[-1] == 0:
        lengths = lengths[:-1]
    return lengths.astype(np.int32)


def write_lengths_index(prefix: str, lengths: np.ndarray) -> None:
    """``PREFIX.idx`` for one-sequence uint16 documents of ``lengths`` (data_prep's writer streams lengths from a
    file: a temporary ``PREFIX.lens`` in this benchmark's own directory, removed after)."""
    from data_prep.mmidx import write_index

    lens = prefix + ".lens"
    lengths.tofile(lens)
    write_index(prefix + ".idx", np.uint16, [(lens, 0, len(lengths))], len(lengths))
    os.unlink(lens)


def write_shard(prefix: str, tokens: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    lengths = doc_lengths(tokens, rng)
    last = np.cumsum(lengths, dtype=np.int64) - 1  # position of each document's EOD
    with open(prefix + ".bin", "wb") as f:
        for a in range(0, tokens, CHUNK):
            b = min(tokens, a + CHUNK)
            chunk = rng.integers(0, EOD, b - a, dtype=np.uint16)
            chunk[last[np.searchsorted(last, a) : np.searchsorted(last, b)] - a] = EOD
            chunk.tofile(f)
    write_lengths_index(prefix, lengths)
    return {
        "documents": len(lengths),
        "tokens": tokens,
        "mean_doc": tokens / len(lengths),
        "write_s": time.perf_counter() - t0,
        "bytes": os.path.getsize(prefix + ".bin") + os.path.getsize(prefix + ".idx"),
    }


def write_index_only(prefix: str, tokens: int, mean_doc: float, seed: int = 1) -> dict:
    """A shard whose ``.idx`` is real (Pile-like document lengths) and whose ``.bin`` is a sparse file of the right
    size (no disk used; the index build never reads tokens), plus a ``counts.npy`` so nothing scans it."""
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    lengths = doc_lengths(tokens, rng, mean_doc)
    write_lengths_index(prefix, lengths)
    with open(prefix + ".bin", "wb") as f:
        f.truncate(2 * tokens)
    counts = np.zeros(VOCAB, np.int64)
    counts[EOD], counts[1] = len(lengths), tokens - len(lengths)
    np.save(prefix + ".counts.npy", counts)
    return {
        "documents": len(lengths),
        "tokens": tokens,
        "mean_doc": tokens / len(lengths),
        "write_s": time.perf_counter() - t0,
        "bytes": os.path.getsize(prefix + ".idx"),
    }


def check_with_megatron(prefix: str, info: dict) -> None:
    """megatron-core's own reader agrees with what was written."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    assert len(ds) == info["documents"], (len(ds), info["documents"])
    assert int(ds.sequence_lengths.sum(dtype=np.int64)) == info["tokens"]
    for i in (0, len(ds) // 2, len(ds) - 1):
        doc = ds[i]
        assert len(doc) == ds.sequence_lengths[i] and doc[-1] == EOD and doc.max() <= EOD


def build_args(prefix: str, seq: int, steps: int, global_batch: int, out_dir: Path) -> list[str]:
    """``build_data_cache`` arguments: the tiny-cpu LEV config (GPT-2 vocabulary) over ``prefix``, split
    969/30/1, ``steps`` steps of ``global_batch`` sequences of ``seq`` tokens."""
    return [
        "--config",
        str(REPO / "configs/tiny-cpu-lev.yaml"),
        f"model.vocab_size={MODEL_VOCAB}",
        f"model.seq_length={seq}",
        f"data.prefixes=[{prefix}]",
        "data.split=969,30,1",
        f"train.global_batch_size={global_batch}",
        "train.micro_batch_size=8",
        f"train.steps={steps}",
        "train.eval_iters=10",
        f"train.out_dir={out_dir}",
    ]


def run_build(args: list[str], report: Path) -> dict:
    """One build_data_cache process: wall time, its report (per-step seconds and peak RSS: the process resets
    the kernel's peak counter per step, so os.wait4's ru_maxrss would only show the last step's)."""
    cmd = [sys.executable, "-m", "leviathan_pretrain.build_data_cache", *args, "--report", str(report)]
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"build_data_cache failed ({p.returncode}):\n{out[-4000:]}")
    rep = json.loads(report.read_text())
    return {"wall_s": wall, "rss_mib": max(rep["peak_rss_mib"], usage.ru_maxrss / 1024), "report": rep, "output": out}


def evict(path: str) -> None:
    """Drop this file's pages from the page cache (ours only), so a scan reads from disk as at a job start."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def split_tokens(lengths: np.ndarray, frac: float) -> int:
    return int(lengths[: int(round(frac * len(lengths)))].sum(dtype=np.int64))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=float, default=1e9)
    ap.add_argument("--seq-lengths", default="2048,512")
    ap.add_argument("--global-batch", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2, help="cold runs per sequence length (the fastest is shown)")
    ap.add_argument("--tmp", default=None, help="where the temporary directory goes (default: the system's)")
    ap.add_argument("--pile-tokens", type=float, default=300e9)
    ap.add_argument("--pile-docs", type=float, default=211e6)
    ap.add_argument(
        "--index-only-tokens",
        type=float,
        default=0,
        help="then also build the seq-length-2048 indices of an index-only shard this large (real .idx "
        "with Pile-like ~1,420-token documents, sparse .bin): checks the extrapolation directly "
        "(memory: ~1 GiB per 30e9 tokens)",
    )
    args = ap.parse_args(argv)
    tokens = int(args.tokens)
    seqs = [int(s) for s in args.seq_lengths.split(",")]
    need = 3 * (2 * tokens + 16 * tokens // 1000)  # 3x (.bin + .idx)
    base = Path(args.tmp or tempfile.gettempdir())
    free = shutil.disk_usage(base).free
    if free < need:
        print(
            f"refusing: {base} has {free / 2**30:.1f} GiB free, this benchmark needs 3x its "
            f"{need / 3 / 2**30:.1f} GiB shard = {need / 2**30:.1f} GiB (use --tmp DIR or fewer --tokens)"
        )
        return 1
    tmp = Path(tempfile.mkdtemp(prefix="bench-data-cache-", dir=base))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup below on a kill too
    try:
        prefix = str(tmp / "synth")
        print(f"writing a {tokens:,}-token uint16 shard to {prefix} ...", flush=True)
        info = write_shard(prefix, tokens)
        print(
            f"  {info['documents']:,} documents (mean {info['mean_doc']:.0f} tokens), "
            f"{info['bytes'] / 2**30:.2f} GiB in {info['write_s']:.1f} s",
            flush=True,
        )
        check_with_megatron(prefix, info)
        lengths = np.fromfile(prefix + ".idx", dtype=np.int32, count=info["documents"], offset=34)
        train_tokens = split_tokens(lengths, 969 / 1000)
        rows = []
        for seq in seqs:
            steps = max(1, (train_tokens - 1) // seq // args.global_batch)
            cfg = build_args(prefix, seq, steps, args.global_batch, tmp / "out")
            runs = []
            for i in range(args.repeats + 1):  # cold runs into fresh cache dirs (scan too), then one warm
                kind = "cold" if i < args.repeats else "warm"
                cache = tmp / f"cache-{seq}-{min(i, args.repeats - 1)}"
                if kind == "cold":
                    evict(prefix + ".bin")
                    evict(prefix + ".idx")
                print(f"build_data_cache seq_length={seq} train.steps={steps} ({kind}) ...", flush=True)
                r = run_build(cfg + [f"data.cache_dir={cache}"], tmp / f"report-{seq}-{i}.json")
                r["kind"] = kind
                runs.append(r)
                print("  " + "\n  ".join(r["output"].strip().splitlines()[-9:]), flush=True)
            colds = [r for r in runs if r["kind"] == "cold"]
            fastest = min(colds, key=lambda r: r["report"]["steps_s"]["index build or load (megatron-core)"])
            for r in (fastest, runs[-1]):
                rep, kind = r["report"], r["kind"]
                rows.append(
                    {
                        "seq": seq,
                        "kind": kind,
                        "samples": rep["datasets"][0]["samples"],
                        "scan": rep["shards"][prefix]["max_id_source"],
                        "checks_s": rep["steps_s"]["shard checks (data_summary)"],
                        "index_s": rep["steps_s"]["index build or load (megatron-core)"],
                        "wall_s": r["wall_s"],
                        "rss_mib": r["rss_mib"],
                        "index_mem": rep["steps_memory"]["index build or load (megatron-core)"],
                        "checks_mem": rep["steps_memory"]["shard checks (data_summary)"],
                        "built": sum(f["built"] for f in rep["files"].values()),
                        "index_mib": sum(f["bytes"] for f in rep["files"].values()) / 2**20,
                        "scan_s": min(c["report"]["steps_s"]["shard checks (data_summary)"] for c in colds),
                    }
                )
        report(rows, info, args)
        if args.index_only_tokens:
            index_only(tmp, rows, info, args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"removed {tmp}", flush=True)
    return 0


def report(rows: list[dict], info: dict, args) -> None:
    ratio = args.pile_tokens / info["tokens"]
    print(
        f"\nsynthetic shard: {info['tokens'] / 1e9:.2f} B tokens, {info['documents'] / 1e6:.2f} M documents "
        f"(mean {info['mean_doc']:.0f} tokens), split 969,30,1, global batch {args.global_batch}, one epoch of "
        "train samples; 'checks' includes the max-id scan where 'max id' says scan"
    )
    head = (
        f"{'seq':>5} {'run':>4} {'train samples':>13} {'max id':>10} {'checks s':>8} {'index s':>8} "
        f"{'wall s':>7} {'peak RSS MiB':>12} {'files built':>11} {'index MiB':>9}"
    )
    print(head + "\n" + "-" * len(head))
    for r in rows:
        print(
            f"{r['seq']:>5} {r['kind']:>4} {r['samples']:>13,} {r['scan']:>10} {r['checks_s']:>8.1f} "
            f"{r['index_s']:>8.1f} {r['wall_s']:>7.1f} {r['rss_mib']:>12,.0f} {r['built']:>11} "
            f"{r['index_mib']:>9,.1f}"
        )
    # fixed cost of a process (interpreter, imports): what a warm run spends outside checks and index loading
    warm = [r for r in rows if r["kind"] == "warm"]
    fixed = min(r["wall_s"] - r["checks_s"] - r["index_s"] for r in warm)
    scans = [r for r in rows if r["scan"] == "scan"]
    scan = min(r["scan_s"] for r in scans) * ratio if scans else float("nan")
    scan_mem = scans[0]["checks_mem"]["peak_mib"] if scans else float("nan")
    print(
        f"\nlinear extrapolation to the Pile: {args.pile_tokens / 1e9:.0f} B tokens ({ratio:.0f}x the shard), "
        f"{args.pile_docs / 1e6:.0f} M documents; one process on these CPUs. Fixed per-process cost "
        f"{fixed:.1f} s (interpreter, imports); the max-id scan of shards without counts.npy adds ~{scan:,.0f} s "
        f"once (cached afterwards; its memory does not grow: peak {scan_mem:,.0f} MiB here)"
    )
    head = (
        f"{'seq':>5} {'train samples':>13} {'index build s':>13} {'build_data_cache s':>18} "
        f"{'peak RSS GiB':>12} {'index files GiB':>15} {'cached start s':>14}"
    )
    print(head + "\n" + "-" * len(head))
    for seq in sorted({r["seq"] for r in rows}, reverse=True):
        c = next(r for r in rows if r["seq"] == seq and r["kind"] == "cold")
        w = next(r for r in rows if r["seq"] == seq and r["kind"] == "warm")
        rest = c["checks_s"] if c["scan"] != "scan" else w["checks_s"]  # checks without the scan
        mem = c["index_mem"]  # the build's own growth scales
        rss = mem["rss_before_mib"] + (mem["peak_mib"] - mem["rss_before_mib"]) * ratio
        print(
            f"{seq:>5} {c['samples'] * ratio:>13,.0f} {c['index_s'] * ratio:>13,.0f} "
            f"{fixed + (rest + c['index_s']) * ratio:>18,.0f} {rss / 1024:>12,.1f} "
            f"{c['index_mib'] * ratio / 1024:>15,.1f} {fixed + (w['checks_s'] + w['index_s']) * ratio:>14,.0f}"
        )
    print(
        "(build_data_cache s: without the one-off scan; cached start s: the trainer's checks + index loading "
        "with a complete cache)"
    )


def index_only(tmp: Path, rows: list[dict], info: dict, args) -> None:
    tokens = int(args.index_only_tokens)
    mean_doc = args.pile_tokens / args.pile_docs
    need = 3 * 24 * tokens / mean_doc  # .idx + the index files, x3
    if shutil.disk_usage(tmp).free < need:
        print(f"skipping the index-only check: {need / 2**30:.1f} GiB free needed")
        return
    prefix = str(tmp / "index_only")
    print(f"\nwriting an index-only {tokens / 1e9:.0f} B-token shard (sparse .bin) to {prefix} ...", flush=True)
    io = write_index_only(prefix, tokens, mean_doc)
    print(
        f"  {io['documents']:,} documents (mean {io['mean_doc']:.0f}), .idx {io['bytes'] / 2**30:.2f} GiB "
        f"in {io['write_s']:.1f} s",
        flush=True,
    )
    lengths = np.memmap(prefix + ".idx", dtype=np.int32, mode="r", shape=(io["documents"],), offset=34)
    steps = max(1, (split_tokens(lengths, 969 / 1000) - 1) // 2048 // args.global_batch)
    del lengths
    cfg = [
        *build_args(prefix, 2048, steps, args.global_batch, tmp / "out"),
        f"data.cache_dir={tmp / 'cache-index-only'}",
    ]
    res = {}
    for kind in ("cold", "warm"):
        print(f"build_data_cache seq_length=2048 train.steps={steps} on the index-only shard ({kind}) ...", flush=True)
        r = run_build(cfg, tmp / f"report-index-only-{kind}.json")
        print("  " + "\n  ".join(r["output"].strip().splitlines()[-9:]), flush=True)
        res[kind] = r
    c, w = res["cold"]["report"], res["warm"]["report"]
    small = next(r for r in rows if r["seq"] == 2048 and r["kind"] == "cold")
    ratio = tokens / info["tokens"]
    mem = c["steps_memory"]["index build or load (megatron-core)"]
    small_mem = small["index_mem"]
    predicted_rss = small_mem["rss_before_mib"] + (small_mem["peak_mib"] - small_mem["rss_before_mib"]) * ratio
    files = sum(f["bytes"] for f in c["files"].values()) / 2**30
    print(
        f"\nindex-only shard, {tokens / 1e9:.0f} B tokens, {io['documents'] / 1e6:.1f} M documents, "
        f"seq_length 2048, {c['datasets'][0]['samples']:,} train samples: measured vs linear from the "
        f"{info['tokens'] / 1e9:g} B-token shard"
    )
    print(
        f"  index build      {c['steps_s']['index build or load (megatron-core)']:8.1f} s   "
        f"(linear: {small['index_s'] * ratio:.1f} s)"
    )
    print(f"  peak RSS         {mem['peak_mib'] / 1024:8.2f} GiB (linear: {predicted_rss / 1024:.2f} GiB)")
    print(f"  index files      {files:8.2f} GiB (linear: {small['index_mib'] * ratio / 1024:.2f} GiB)")
    print(
        f"  build_data_cache {res['cold']['wall_s']:8.1f} s wall; with the cache complete (warm) "
        f"{res['warm']['wall_s']:.1f} s, of which index loading "
        f"{w['steps_s']['index build or load (megatron-core)']:.1f} s, "
        f"checks {w['steps_s']['shard checks (data_summary)']:.1f} s"
    )


if __name__ == "__main__":
    sys.exit(main())
