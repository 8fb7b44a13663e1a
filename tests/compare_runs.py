"""Run directories for ``python -m leviathan_pretrain.compare``'s tests (tests/test_compare.py,
tests/test_compare_geometry.py): real train_log.jsonl files, TensorBoard events written by torch's SummaryWriter,
checkpoint records and evaluation reports in the fixed schema, and the command run in a subprocess."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUCKETS = ["unseen", "<1e-07", "1e-07..1e-06", "1e-06..1e-05", "1e-05..1e-04", "1e-04..1e-03", ">=1e-03"]
EDGES = [(0.0, 0.0), (0.0, 1e-7), (1e-7, 1e-6), (1e-6, 1e-5), (1e-5, 1e-4), (1e-4, 1e-3), (1e-3, 1.0)]
PNG = b"\x89PNG\r\n\x1a\n"


def compare(*args, cwd=None, timeout=180) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), MPLBACKEND="Agg")
    cmd = [sys.executable, "-m", "leviathan_pretrain.compare", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd or REPO)


def ok(*args, **kw) -> subprocess.CompletedProcess:
    p = compare(*args, **kw)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    return p


def config(variant: str, gbs: int, seq: int, out_dir: Path) -> dict:
    return {
        "model": {"variant": variant, "vocab_size": 8000, "hidden_size": 128, "num_layers": 2, "seq_length": seq},
        "train": {"global_batch_size": gbs, "micro_batch_size": 4, "steps": 300, "out_dir": str(out_dir)},
        "parallel": {"tensor_parallel": 1},
    }


def geometry_record(step: int, cosine: float, eff_rank: float) -> dict:
    """A trainer's geometry step record (flat keys, no "loss"): the input rows' ``cosine`` and ``eff_rank`` as
    given, the other numbers and a bucket's (which compare ignores) made up."""
    rec = {"step": step}
    for part, c, r in (("input", cosine, eff_rank), ("head", cosine / 2, eff_rank * 2)):
        rec.update({f"geometry/{part}/rms": 0.02, f"geometry/{part}/cosine": c, f"geometry/{part}/mean_share": c})
        rec.update({f"geometry/{part}/eff_rank": r, f"geometry/{part}/rare/cosine": 0.999})
    return rec


def make_run(root: Path, name: str, variant: str, valid: dict, *, gbs=8, seq=128, log="jsonl", step=300,
             geometry=None) -> Path:  # fmt: skip
    """A run directory: training loss every 10 steps + ``valid`` ({step: loss}) in train_log.jsonl (log="jsonl")
    or in TensorBoard events only (log="tensorboard"), and ``checkpoints/global_step<step>`` with its record;
    ``geometry`` ({step: (input cosine, input eff_rank)}): geometry records in train_log.jsonl."""
    run = root / name
    train = {s: 7.0 - 2.0 * s / step for s in range(10, step + 1, 10)}
    geometry = geometry or {}
    if log == "jsonl":
        recs = [{"step": 0, "event": "layout", "world": 1}]
        recs += [geometry_record(0, *geometry[0])] if 0 in geometry else []
        for s in range(10, step + 1, 10):
            recs.append({"step": s, "loss": train[s], "lr": 1e-3, "grad_norm": 1.0, "consumed_samples": s * gbs})
            if s in valid:
                recs.append({"step": s, "valid_loss": valid[s], "valid_perplexity": math.exp(valid[s])})
            if s in geometry:
                recs.append(geometry_record(s, *geometry[s]))
        recs.append({"step": step, "event": "finished", "steps": step})
        run.mkdir(parents=True)
        (run / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    else:
        from torch.utils.tensorboard import SummaryWriter

        w = SummaryWriter(str(run / "tensorboard"))
        for s, v in train.items():
            w.add_scalar("train/loss", v, s)
        for s, v in valid.items():
            w.add_scalar("valid/loss", v, s)
            w.add_scalar("valid/perplexity", math.exp(v), s)
        w.close()
    ckpt = run / "checkpoints" / f"global_step{step}"
    ckpt.mkdir(parents=True)
    meta = {"config": config(variant, gbs, seq, run), "step": step, "consumed_samples": step * gbs}
    (ckpt / "leviathan.json").write_text(json.dumps(meta))
    (run / "checkpoints" / "latest").write_text(f"global_step{step}")
    return run


def make_report(run: Path, variant: str, *, step=300, total=1_000_000, inp=100_000, val=(4.1, 60.3), test_ppl=None,
                bucket_ppl=None, wiki=None, lambada=None, geometry="absent") -> Path:  # fmt: skip
    """An evaluation report in run/eval/; ``geometry``: "absent" (no key: an older report), None (null: evaluate
    --no-geometry) or (input cosine, input eff_rank, head cosine)."""
    heldout = [{"name": "val", "prefix": "/d/val", "tokens": 100000, "documents": 120, "loss": val[0], "ppl": val[1]}]
    if test_ppl is not None:
        heldout.append(
            {"name": "test", "prefix": "/d/test", "tokens": 9000, "documents": 9, "loss": 4.2, "ppl": test_ppl}
        )
    rep = {
        "schema": 1,
        "run": str(run.resolve()),
        "checkpoint": str((run / "checkpoints" / f"global_step{step}").resolve()),
        "tag": f"global_step{step}",
        "step": step,
        "variant": variant,
        "params": {"total": total, "input_layer": inp, "non_input": total - inp},
        "tokens_seen": step * 1024,
        "created": "2026-12-01T18:00:00Z",
        "heldout": heldout,
        "frequency": None,
        "wikitext": None,
        "lambada": None,
    }
    if bucket_ppl is not None:
        buckets = [
            {
                "name": n,
                "lo": lo,
                "hi": hi,
                "tokens": 100 * (i + 1),
                "types": 3 + i,
                "loss": p and math.log(p),
                "ppl": p,
            }
            for i, (n, (lo, hi), p) in enumerate(zip(BUCKETS, EDGES, bucket_ppl))
        ]
        rep["frequency"] = {"counts": ["/d/train.counts.npy"], "training_tokens": 123456789, "mode": "decades",
                            "buckets": buckets}  # fmt: skip
    if wiki is not None:
        rep["wikitext"] = {"path": "/d/wiki", "articles": 60, "skipped": {"empty": 0}, "tokens": 280000,
                           "words": 245000, "context": 256, "stride": 128, "token_loss": math.log(wiki[0]),
                           "token_ppl": wiki[0], "word_ppl": wiki[1]}  # fmt: skip
    if lambada is not None:
        rep["lambada"] = {"path": "/d/lambada", "examples": 100, "skipped": {}, "accuracy": lambada, "ppl": 850.0}
    if geometry is None:
        rep["geometry"] = None
    elif geometry != "absent":

        def part(cosine, eff_rank):
            numbers = {"rows": 2048, "width": 128, "rms": 0.05, "cosine": cosine, "mean_share": 0.5}
            return {**numbers, "eff_rank": eff_rank, "buckets": [{"name": "unseen", "types": 9, **numbers,
                                                                  "cosine": 0.999, "eff_rank": 1.5}]}  # fmt: skip

        rep["geometry"] = {"sample": 2048, "seed": 0, "input": part(*geometry[:2]), "head": part(geometry[2], 99.0)}
    path = run / "eval" / f"global_step{step}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rep, indent=1))
    return path


# Designed validation curves (tokens per step = 8 x 128 = 1024 for tied/lev; 2 x 256 = 512 for untied):
# the baseline (tied) ends at 4.2 after 300 steps = 307200 tokens; lev crosses 4.2 between steps 100 (4.6) and
# 200 (4.0): step 100 + 100 x 0.4 / 0.6 -> 170666.67 tokens, ratio 1.8; untied never goes below 4.4.
TIED_VALID = {100: 5.0, 200: 4.5, 300: 4.2}
LEV_VALID = {100: 4.6, 200: 4.0, 300: 3.8}
UNTIED_VALID = {100: 5.1, 200: 4.8, 300: 4.4}
LEV_REACH = 100 * 1024 + (4.6 - 4.2) / (4.6 - 4.0) * 100 * 1024
TIED_B = [900.0, 500.0, 300.0, 150.0, 80.0, 40.0, 12.0]
LEV_B = [700.0, 420.0, 280.0, 140.0, 78.0, 41.0, 12.5]


def read_csv(out: Path) -> dict:
    with open(out / "comparison.csv", newline="") as f:
        return {row["run"]: row for row in csv.DictReader(f)}


def md_section(md: str, title: str) -> str:
    """The text of ``## title`` up to the next section."""
    return md.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
