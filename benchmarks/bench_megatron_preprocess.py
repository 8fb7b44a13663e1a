#!/usr/bin/env python
"""data_prep.tokenize vs Megatron-LM's tools/preprocess_data.py with a Hugging Face tokenizer, side by side: the same
jsonl, the same tokenizer directory, the same number of workers; both token streams read back with megatron-core's
IndexedDataset must be equal document by document (a script, not a test).

  python benchmarks/bench_megatron_preprocess.py --megatron-lm /tmp/megatron-lm [--input FILE] [--tokenizer DIR]
         [--workers 2] [--reps 2]

--megatron-lm: a copy of NVIDIA/Megatron-LM at tag core_v0.16.1 outside this repository (its tools/ and megatron/;
none of its code is in this project), e.g. ``git clone --branch core_v0.16.1 https://github.com/NVIDIA/Megatron-LM``.
Megatron runs ``tools/preprocess_data.py --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR --append-eod``:
transformers' AutoTokenizer with its defaults (add_special_tokens=True), EOD = eos_token_id. data_prep runs
``python -m data_prep.tokenize --tokenizer DIR``: the tokenizers library, no special tokens added, EOD = the
tokenizer_config.json eos_token. The two are the same ids for a tokenizer without a BOS template (GPT-2 / GPT-NeoX
style, the default here); for one whose post-processor adds a BOS (Llama), Megatron writes it first in every
document and data_prep does not, and this script says so instead of failing.

Defaults: the minipile train split decompressed to plain jsonl (both read the same file) and the 32k byte-level BPE
of benchmarks/bench_tokenize.py (trained if missing); a tokenizer_config.json naming data_prep's EOD as the
eos_token is added where the directory has none (Megatron's EOD is ``eos_token_id``).
Whole processes, wall clock, alternating M D M D ...; printed: both times and ``ratio = megatron / data_prep``.
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
sys.path.insert(0, str(REPO / "benchmarks"))


def timed(cmd, env) -> float:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"failed ({p.returncode}): {' '.join(map(str, cmd))}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--megatron-lm", required=True, metavar="DIR", help="Megatron-LM at core_v0.16.1 (outside)")
    ap.add_argument("--input", default="/tmp/minipile/train/00.jsonl.zst")
    ap.add_argument("--tokenizer", metavar="DIR", help="a directory with tokenizer.json (+ tokenizer_config.json)")
    ap.add_argument(
        "--megatron-pythonpath",
        default="",
        metavar="DIR",
        help="prepended to PYTHONPATH for Megatron's run only (a CPU machine: where `pip install --target DIR triton` "
        "put triton, which megatron.training imports)",
    )
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--cache", default=str(REPO / ".cache" / "bench"))
    args = ap.parse_args()
    mlm = Path(args.megatron_lm).resolve()
    if not (mlm / "tools" / "preprocess_data.py").is_file():
        sys.exit(f"{mlm}/tools/preprocess_data.py not found: --megatron-lm must be a Megatron-LM checkout")
    import bench_tokenize as bt

    work = Path(tempfile.mkdtemp(prefix="bench_megatron_"))
    try:
        inp = bt.ensure_corpus(argparse.Namespace(input=args.input, cache=args.cache))
        plain = work / "input.jsonl"
        if inp.endswith(".zst"):
            import zstandard

            with open(inp, "rb") as f, open(plain, "wb") as g:
                zstandard.ZstdDecompressor().copy_stream(f, g)
        else:
            shutil.copy(inp, plain)
        if args.tokenizer:
            src = Path(args.tokenizer) / "tokenizer.json" if Path(args.tokenizer).is_dir() else Path(args.tokenizer)
        else:
            src = bt.ensure_tokenizer(argparse.Namespace(tokenizer=None, cache=args.cache), "huggingface", inp)
        tok = work / "tok"  # both read this directory; Megatron's EOD is tokenizer_config.json's eos_token
        tok.mkdir()
        shutil.copy(src, tok / "tokenizer.json")
        conf = Path(src).parent / "tokenizer_config.json"
        if conf.is_file():
            shutil.copy(conf, tok / "tokenizer_config.json")
        else:
            from data_prep.tokenizer import open_tokenizer

            eod = open_tokenizer(str(tok)).eod_token
            cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eod}
            (tok / "tokenizer_config.json").write_text(json.dumps(cfg))
        env = dict(os.environ, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false")
        extra = f"{args.megatron_pythonpath}:" if args.megatron_pythonpath else ""
        m_env = dict(env, PYTHONPATH=f"{extra}{mlm}")
        m_cmd = [sys.executable, str(mlm / "tools" / "preprocess_data.py"), "--input", str(plain)]
        m_cmd += ["--output-prefix", str(work / "mlm"), "--tokenizer-type", "HuggingFaceTokenizer"]
        m_cmd += ["--tokenizer-model", str(tok), "--append-eod", "--workers", str(args.workers)]
        d_cmd = [sys.executable, "-m", "data_prep.tokenize", "--input", str(plain), "--tokenizer", str(tok)]
        d_cmd += ["--out", str(work / "ours"), "--workers", str(args.workers), "--overwrite", "--quiet"]
        print(f"input {plain} ({plain.stat().st_size / 1e6:.1f} MB), tokenizer {tok}, workers {args.workers}")
        times = {"M": [], "D": []}
        for i in range(args.reps):
            for k, cmd, e in (("M", m_cmd, m_env), ("D", d_cmd, env)):
                times[k].append(timed(cmd, e))
                print(f"  rep {i + 1} {'megatron' if k == 'M' else 'data_prep'}: {times[k][-1]:.2f} s", flush=True)

        from megatron.core.datasets.indexed_dataset import IndexedDataset

        a, b = IndexedDataset(str(work / "mlm_text_document")), IndexedDataset(str(work / "ours"))
        from data_prep.tokenizer import open_tokenizer

        adds = open_tokenizer(str(tok)).default_special_ids()  # what the template adds (Megatron writes it)
        same = len(a) == len(b)
        diff = 0
        for i in range(min(len(a), len(b))):
            x, y = a[i].tolist(), b[i].tolist()
            if adds and x[: len(adds)] == adds:
                x = x[len(adds) :]
            diff += x != y
        print(f"documents: megatron {len(a):,}, data_prep {len(b):,}; differing documents: {diff}")
        if adds:
            print(
                f"note: this tokenizer's template adds {adds}: Megatron writes it at the start of every document, "
                "data_prep does not (compared without it)"
            )
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"megatron preprocess_data.py median {med['M']:.2f} s, data_prep.tokenize median {med['D']:.2f} s")
        print(
            f"ratio (megatron / data_prep) {med['M'] / med['D']:.3f}; token streams "
            + ("EQUAL" if same and not diff else "DIFFER")
        )
        return 0 if same and not diff else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
