"""The evaluation report: its JSON (schema 1), the console table, TensorBoard scalars, and a progress meter.

Report keys (``python -m leviathan_pretrain.compare`` reads them; docs/evaluation.md describes each)::

    schema, run, checkpoint, tag, step, variant, params {total, input_layer, non_input}, tokens_seen, created,
    heldout [{name, prefix, documents, documents_left_out, tokens, loss, ppl}],
    frequency {counts, training_tokens, mode, buckets [{name, lo, hi, tokens, types, loss, ppl}]} | null,
    wikitext {path, articles, skipped, tokens, words, context, stride, nats, token_loss, token_ppl, word_ppl} | null,
    lambada {path, examples, skipped, accuracy, ppl} | null,
    settings {context, stride, batch_size, device, dtype, max_tokens, world}, seconds
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from data_prep.fileio import write_bytes_atomic

SCHEMA = 1


def write_report(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(path, (json.dumps(report, indent=1) + "\n").encode())


def _num(x, fmt: str = ".2f") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return format(x, fmt)


def console_table(report: dict) -> str:
    """A human summary of ``report``."""
    p = report["params"]
    lines = [
        f"run {report['run']}  {report['tag']}  variant={report['variant']}  params {p['total'] / 1e6:.2f}M "
        f"(input layer {p['input_layer'] / 1e6:.3f}M)  tokens seen {report['tokens_seen']:,}",
        "",
        f"{'held-out set':<28} {'tokens':>12} {'docs':>8} {'loss':>8} {'ppl':>10}",
    ]
    for h in report["heldout"]:
        lines.append(
            f"{h['name']:<28} {h['tokens']:>12,} {h['documents']:>8,} {_num(h['loss'], '.4f'):>8} {_num(h['ppl']):>10}"
        )
    fr = report.get("frequency")
    if fr:
        lines += [
            "",
            f"by training frequency of the target ({fr['mode']}; {fr['training_tokens']:,} training tokens)",
            f"{'bucket':<18} {'tokens':>10} {'types':>7} {'loss':>8} {'ppl':>12}",
        ]
        for b in fr["buckets"]:
            lines.append(
                f"{b['name']:<18} {b['tokens']:>10,} {b['types']:>7,} {_num(b['loss'], '.4f'):>8} {_num(b['ppl']):>12}"
            )
    w = report.get("wikitext")
    if w:
        lines += [
            "",
            f"WikiText ({w['articles']} articles, {w['tokens']:,} tokens, {w['words']:,} words, context "
            f"{w['context']}, stride {w['stride']}): token ppl {w['token_ppl']:.2f}, word ppl {w['word_ppl']:.2f}",
        ]
    la = report.get("lambada")
    if la:
        lines += [
            "",
            f"LAMBADA ({la['examples']} examples): last-word accuracy {la['accuracy']:.4f}, ppl {la['ppl']:.2f}",
        ]
    left = [
        f"{k}: {reason} x{n}"
        for k in ("wikitext", "lambada")
        for reason, n in ((report.get(k) or {}).get("skipped") or {}).items()
        if n
    ]
    if left:
        lines.append("left out: " + ", ".join(left))
    return "\n".join(lines)


def tensorboard_scalars(report: dict) -> dict[str, float]:
    """``eval/...`` scalars of a report (logged at the checkpoint's step)."""
    out = {}
    for h in report["heldout"]:
        out[f"eval/{h['name']}/loss"] = h["loss"]
        out[f"eval/{h['name']}/ppl"] = h["ppl"]
    for b in (report.get("frequency") or {}).get("buckets", []):
        if b["ppl"] is not None:
            out[f"eval/freq/{b['name']}/ppl"] = b["ppl"]
    if report.get("wikitext"):
        out["eval/wikitext/word_ppl"] = report["wikitext"]["word_ppl"]
        out["eval/wikitext/token_ppl"] = report["wikitext"]["token_ppl"]
    if report.get("lambada"):
        out["eval/lambada/accuracy"] = report["lambada"]["accuracy"]
        out["eval/lambada/ppl"] = report["lambada"]["ppl"]
    return {k: float(v) for k, v in out.items() if v is not None and math.isfinite(v)}


def write_tensorboard(log_dir: Path, step: int, scalars: dict[str, float]) -> None:
    """Append the scalars to the run's TensorBoard directory (a new events file beside the training ones)."""
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(str(log_dir), filename_suffix=".eval")
    try:
        for tag, value in scalars.items():
            w.add_scalar(tag, value, step)
    finally:
        w.close()


class Meter:
    """Targets scored: a tqdm bar on a terminal, a line every ``interval`` s otherwise (``enabled=False``: silent)."""

    def __init__(self, label: str, total: int, enabled: bool = True, interval: float = 30.0):
        self.label, self.total, self.done, self.enabled = label, total, 0, enabled
        self.t0 = self.last = time.monotonic()
        self.interval = interval
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=label, unit="tok", unit_scale=True, file=sys.stderr)

    def __call__(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.monotonic()
        if self.enabled and now - self.last >= self.interval:
            self.last = now
            rate = self.done / max(now - self.t0, 1e-9)
            print(f"[evaluate] {self.label}: {self.done:,}/{self.total:,} tokens ({rate:,.0f} tok/s)", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
