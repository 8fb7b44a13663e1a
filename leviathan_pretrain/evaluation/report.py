"""The evaluation report: its JSON (schema 1), the console table, TensorBoard scalars, and a progress meter.

Report keys (``python -m leviathan_pretrain.compare`` reads them; docs/evaluation.md describes each)::

    schema, run, checkpoint, tag, step, variant,
    params {total, input_layer, non_input, body, head, padding, vocab_size, padded_vocab_size, tensor_parallel},
    tokens_seen, created,
    heldout [{name, prefix, documents, documents_left_out, document_range, split, tokens, loss, ppl}],
    frequency {counts, training_tokens, mode, buckets [{name, lo, hi, tokens, types, loss, ppl}]} | null,
    wikitext {path, articles, skipped, tokens, words, context, stride, nats, token_loss, token_ppl, word_ppl} | null,
    lambada {path, examples, skipped, accuracy, ppl} | null,
    geometry {sample, seed, input {rows, width, rms, cosine, mean_share, eff_rank, buckets [{name, types, ...}]},
              head {...}} | null,
    settings {context, stride, batch_size, device, dtype, max_tokens, world}, seconds
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from common.fileio import write_bytes_atomic

SCHEMA = 1


class ReportError(ValueError):
    """A report file that is unreadable or not in this schema; names the file and the key."""


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# what a value must be: "number" | "int" | "str" | "list" | "dict"; a None in a spec tuple: it may be null
_TYPES = {"number": _is_num, "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
          "str": lambda v: isinstance(v, str), "list": lambda v: isinstance(v, list),
          "dict": lambda v: isinstance(v, dict)}  # fmt: skip
# the keys readers rely on, inside the sections and the entries of their lists (the top level: EvalReport's fields)
_SECTIONS = {"params": {"total": ("int",), "input_layer": ("int",)}, "lambada": {"accuracy": ("number", None)},
             "wikitext": {"token_ppl": ("number", None), "word_ppl": ("number", None)}}  # fmt: skip
_ENTRIES = {"heldout": {"name": ("str",), "loss": ("number", None), "ppl": ("number", None)},
            "frequency.buckets": {"name": ("str",), "ppl": ("number", None)}}  # fmt: skip


def _check(d: dict, key: str, spec: tuple, where: Path, at: str = "", required: bool = True):
    name, v = f"{at}{key}", d.get(key)
    if key not in d:
        if required:
            raise ReportError(f"{where}: malformed report: missing key {name!r}")
        return None
    if not ((v is None and None in spec) or any(_TYPES[t](v) for t in spec if t)):
        raise ReportError(f"{where}: malformed report: key {name!r} is {v!r}, expected {spec[0]}")
    return v


def _check_entries(items: list, key: str, where: Path) -> None:
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ReportError(f"{where}: malformed report: key '{key}[{i}]' is not an object")
        for k, spec in _ENTRIES[key].items():
            _check(item, k, spec, where, f"{key}[{i}].")


@dataclass
class EvalReport:
    """One checkpoint's evaluation (the module docstring lists the keys; docs/evaluation.md explains them).
    The sections are plain JSON objects; :meth:`from_json` checks every key a reader of reports relies on."""

    step: int
    variant: str
    params: dict  # {total, input_layer, non_input, body, head, padding, ...}: model/counts.py param_summary
    tokens_seen: int
    heldout: list = field(default_factory=list)
    frequency: dict | None = None
    wikitext: dict | None = None
    lambada: dict | None = None
    geometry: dict | None = None  # model/geometry.py: the input rows' and the head's, overall and per bucket
    run: str | None = None
    checkpoint: str | None = None
    tag: str | None = None
    created: str | None = None
    settings: dict | None = None
    seconds: float | None = None
    schema: int = SCHEMA

    # the top-level keys: required ones first; a None in the spec: may be null
    _KEYS = {"step": ("int",), "variant": ("str",), "params": ("dict",), "tokens_seen": ("number",),
             "heldout": ("list",), "frequency": ("dict", None), "wikitext": ("dict", None), "lambada": ("dict", None),
             "geometry": ("dict", None), "run": ("str", None), "checkpoint": ("str", None), "tag": ("str", None),
             "created": ("str", None), "settings": ("dict", None), "seconds": ("number", None)}  # fmt: skip
    _REQUIRED = ("step", "variant", "params", "tokens_seen", "heldout")

    def to_json(self) -> dict:
        """The JSON object in the order evaluate has always written it."""
        order = ("schema", "run", "checkpoint", "tag", "step", "variant", "params", "tokens_seen", "created")
        out = {k: getattr(self, k) for k in order}
        out.update(heldout=self.heldout, frequency=self.frequency, wikitext=self.wikitext, lambada=self.lambada)
        out.update(geometry=self.geometry)
        out.update(settings=self.settings, seconds=self.seconds)
        return out

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(path, (json.dumps(self.to_json(), indent=1) + "\n").encode())

    @classmethod
    def from_json(cls, data: object, where: Path) -> EvalReport:
        if not isinstance(data, dict):
            raise ReportError(f"{where}: malformed report: not a JSON object")
        if _check(data, "schema", ("int",), where) != SCHEMA:
            raise ReportError(
                f"{where}: malformed report: key 'schema' is {data['schema']!r}, this tool reads {SCHEMA}"
            )
        got = {k: _check(data, k, spec, where, required=k in cls._REQUIRED) for k, spec in cls._KEYS.items()}
        for key, inner in _SECTIONS.items():
            if isinstance(got[key], dict):
                for k, spec in inner.items():
                    _check(got[key], k, spec, where, f"{key}.")
        _check_entries(got["heldout"], "heldout", where)
        if got["frequency"] is not None:
            buckets = _check(got["frequency"], "buckets", ("list",), where, "frequency.")
            _check_entries(buckets, "frequency.buckets", where)
        return cls(**{k: v for k, v in got.items() if k in data})

    @classmethod
    def read(cls, path: Path) -> EvalReport:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise ReportError(f"{path}: not a readable evaluation report ({e})") from None
        return cls.from_json(data, path)


def _num(x, fmt: str = ".2f") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return format(x, fmt)


def params_line(p: dict) -> str:
    """The report's ``params`` in model/counts.py's words (a report written before ``body`` / ``head`` were
    recorded: its total and input layer)."""
    from leviathan_pretrain.model import counts

    if "body" in p and "head" in p:
        return counts.trained_text({**p, "input": p["input_layer"]})
    return f"{p['total']:,} {counts.TRAINED} ({counts.millions(p['total'])}), input layer {p['input_layer']:,}"


def heldout_source(h: dict) -> str:
    """Where a held-out set's targets came from: ``"PREFIX: documents 0..6 (all of the file)"``, or of its
    validation split, and the documents ``--max-tokens`` left out."""
    if "document_range" not in h:  # an older report
        return f"{h['prefix']}: {h['documents']:,} documents"
    a, b = h["document_range"]
    left = h.get("documents_left_out") or 0
    where = "its validation split" if h.get("split") == "validation" else "the file"
    whole = f"all of {where}" if not left else f"the first of {where}; {left:,} more left out by --max-tokens"
    return f"{h['prefix']}: documents {a:,}..{b:,} ({whole})"


def console_table(rep: EvalReport) -> str:
    """A human summary of a report."""
    report = rep.to_json()
    st = report.get("settings") or {}
    lines = [
        f"run {report['run']}  {report['tag']}  variant={report['variant']}  tokens seen {report['tokens_seen']:,}",
        params_line(report["params"]),
        "",
        f"{'held-out set':<28} {'target tokens':>13} {'docs':>8} {'loss':>8} {'ppl':>10}",
    ]
    for h in report["heldout"]:
        lines.append(
            f"{h['name']:<28} {h['tokens']:>13,} {h['documents']:>8,} {_num(h['loss'], '.4f'):>8} {_num(h['ppl']):>10}"
        )
        lines.append(f"  {heldout_source(h)}")
        if "seconds" in h:
            lines.append(f"  scored in {h['seconds']:.1f} s: {h['tokens_per_s']:,.0f} target tokens/s")
    if report["heldout"]:
        windows = f" (windows of {st['context']}, stride {st['stride']})" if "context" in st else ""
        lines.append(
            f"every target token of each set scored once{windows}; the trainer's validation loss scores a fixed "
            "sample of a few batches instead (docs/evaluation.md)"
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
        if "seconds" in w:
            lines.append(
                f"  scored in {w['seconds']:.1f} s: {w['tokens_per_s']:,.0f} target tokens/s, "
                f"{w['model_tokens_per_s']:,.0f} tokens/s through the model (overlapping windows)"
            )
    la = report.get("lambada")
    if la:
        lines += [
            "",
            f"LAMBADA ({la['examples']} examples): last-word accuracy {la['accuracy']:.4f}, ppl {la['ppl']:.2f}",
        ]
    g = report.get("geometry")
    if g:
        lines += ["", f"token vectors ({g['input']['rows']:,} ids sampled, seed {g['seed']}; docs/evaluation.md)"]
        lines += [
            f"{key:<6} rms {_num(g[key]['rms'], '.4f')}  cosine {_num(g[key]['cosine'], '+.3f')}  mean share "
            f"{_num(g[key]['mean_share'], '.3f')}  effective rank {_num(g[key]['eff_rank'], '.1f')}"
            for key in ("input", "head")
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


def tensorboard_scalars(rep: EvalReport) -> dict[str, float]:
    """``eval/...`` scalars of a report (logged at the checkpoint's step)."""
    report = rep.to_json()
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
    for key, part in ((k, (report.get("geometry") or {}).get(k)) for k in ("input", "head")):
        for b in [{"name": None, **part}, *part["buckets"]] if part else []:
            at = f"eval/geometry/{key}" + (f"/{b['name']}" if b["name"] else "")
            out.update({f"{at}/{m}": b[m] for m in ("rms", "cosine", "mean_share", "eff_rank")})
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
        self.seconds = time.monotonic() - self.t0
        if self.bar is not None:
            self.bar.close()

    def rates(self, targets: int, model_tokens: int | None = None) -> dict:
        """The report's timing keys after :meth:`close`: ``seconds`` of scoring, ``targets`` scored per second (all
        ranks together), and, when windows overlap, ``model_tokens`` (the windows' inputs) per second."""
        sec = max(self.seconds, 1e-9)
        out = {"seconds": round(self.seconds, 2), "tokens_per_s": round(targets / sec, 1)}
        if model_tokens is not None:
            out["model_tokens_per_s"] = round(model_tokens / sec, 1)
        return out
