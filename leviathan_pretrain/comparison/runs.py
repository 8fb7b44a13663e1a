"""The runs ``lev compare`` compares (``python -m leviathan_pretrain.compare``; docs/compare.md says how each number
is made): a run directory or an evaluation report as a :class:`Run` (its report with the highest step, its config
and consumed samples, its training and validation curves and geometry records from ``train_log.jsonl`` or
TensorBoard events), the baseline among them, and names that tell them apart. Bad input is a
:class:`CompareError` naming the file (and, for a report, the key).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from leviathan_pretrain.comparison import geometry
from leviathan_pretrain.evaluation.report import EvalReport, ReportError
from leviathan_pretrain.rundir.layout import RunLayout, is_run_dir
from leviathan_pretrain.rundir.tb_events import EventsError, read_scalars
from leviathan_pretrain.rundir.train_log import LOG_NAME, TrainLogError, read_log_values
from leviathan_pretrain.trainer.checkpoint.names import META, CheckpointError, complete_tags, read_latest
from leviathan_pretrain.trainer.checkpoint.record import CheckpointRecord


class CompareError(Exception):
    """Unusable input; the message names the file (and, for a report, the key)."""


def _read_json(path: Path, what: str):
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CompareError(f"{path}: not a readable {what} ({e})") from None


def read_report(path: Path) -> EvalReport:
    """An evaluation report (schema 1), checked for every key the comparison reads."""
    try:
        return EvalReport.read(path)
    except ReportError as e:
        raise CompareError(str(e)) from None


def find_report(run_dir: Path) -> Path | None:
    """``RUN/eval/*.json`` with the highest ``step`` (every one is read: a malformed one is an error)."""
    eval_dir = RunLayout(run_dir).eval_dir
    if not eval_dir.is_dir():
        return None
    found = [(read_report(p).step, p) for p in sorted(eval_dir.glob("*.json")) if not p.name.startswith(".")]
    return max(found, key=lambda sp: sp[0])[1] if found else None


@dataclass
class Run:
    name: str
    path: Path | None  # the run directory (None: a report whose run is not here)
    report: EvalReport | None = None
    report_path: Path | None = None
    config: dict | None = None
    consumed_samples: int | None = None
    train: list = field(default_factory=list)  # [(step, loss)]
    valid: list = field(default_factory=list)
    geometry: dict = field(default_factory=dict)  # {"cosine", "eff_rank": [(step, value)]} of the input rows
    curve_source: str = ""
    notes: list = field(default_factory=list)

    @property
    def variant(self) -> str:
        model = (self.config or {}).get("model") or {}
        return self.report.variant if self.report else str(model.get("variant", "?"))

    @property
    def tokens_per_step(self) -> int | None:
        try:
            return int(self.config["train"]["global_batch_size"]) * int(self.config["model"]["seq_length"])
        except (TypeError, KeyError, ValueError):
            return None

    def curve(self, points: list) -> list:
        """[(tokens, loss)]: tokens = step x global_batch_size x seq_length; [] when the config is unknown."""
        tps = self.tokens_per_step
        return [(s * tps, v) for s, v in points] if tps else []


def read_train_log(path: Path) -> tuple[list, list, dict]:
    """Training and validation points of ``train_log.jsonl`` and its input rows' geometry records
    (``{"cosine", "eff_rank": [(step, value)]}``, empty lists without them)."""
    try:
        train, valid, *geo = read_log_values(path, "loss", "valid_loss", *geometry.LOG_KEYS.values())
    except TrainLogError as e:
        raise CompareError(str(e)) from None
    return train, valid, dict(zip(geometry.LOG_KEYS, geo))


def read_events(tb_dir: Path) -> tuple[list, list]:
    """``train/loss`` and ``valid/loss`` from TensorBoard events (the fallback when there is no train_log)."""
    try:
        found = read_scalars(tb_dir, ("train/loss", "valid/loss"))
    except EventsError as e:
        raise CompareError(str(e)) from None

    def series(tag):
        pts = dict(found[tag])  # the last point of a step wins (a resume)
        return sorted((s, v) for s, v in pts.items() if math.isfinite(v))

    return series("train/loss"), series("valid/loss")


def read_config(run: Run) -> None:
    """The run config and consumed samples from the latest complete checkpoint's ``leviathan.json`` (else the
    highest one, else the report's checkpoint), else ``RUN/config.json``."""
    metas = []
    if run.path is not None:
        ckpt = RunLayout(run.path).checkpoints
        try:
            metas = [ckpt / tag / META for tag in [read_latest(ckpt)] if tag]
        except CheckpointError:  # latest names an incomplete checkpoint: the highest complete one is used
            pass
        metas += [ckpt / tag / META for tag in reversed(complete_tags(ckpt))]
    if run.report is not None and run.report.checkpoint:
        metas.append(Path(run.report.checkpoint) / META)
    for meta in metas:
        if meta.is_file():
            try:  # unreadable: an error; readable but not a record of this version: the next one is tried
                record = CheckpointRecord.from_json(_read_json(meta, "checkpoint record"), meta)
            except CheckpointError:
                continue
            run.config, run.consumed_samples = record.config, record.consumed_samples
            return
    if run.path is not None and RunLayout(run.path).config.is_file():
        data = _read_json(RunLayout(run.path).config, "run config")
        run.config = data if isinstance(data, dict) else None


def load_run(arg: str) -> Run:
    p = Path(arg)
    if p.is_file():
        rep = read_report(p)
        # its run: the directory it sits in (RUN/eval/x.json), else the one it names
        where = [p.parent.parent] if p.parent.name == "eval" else []
        where += [Path(rep.run)] if rep.run else []
        run_dir = next((d for d in where if is_run_dir(d)), None)
        name = (run_dir or (where or [p.with_suffix("")])[-1]).resolve().name
        run = Run(name=name, path=run_dir, report=rep, report_path=p)
    elif p.is_dir():
        if not is_run_dir(p):
            raise CompareError(
                f"{p}: neither a run directory (no {LOG_NAME}, tensorboard/, checkpoints/ or eval/) nor a report"
            )
        run = Run(name=p.resolve().name, path=p)
        run.report_path = find_report(p)
        run.report = read_report(run.report_path) if run.report_path else None
    else:
        raise CompareError(f"{arg}: no such run directory or report file")
    if run.path is not None:
        layout = RunLayout(run.path)
        if layout.train_log.is_file():
            run.train, run.valid, run.geometry = read_train_log(layout.train_log)
            run.curve_source = LOG_NAME
        if not (run.train or run.valid) and layout.events.is_dir():
            run.train, run.valid = read_events(layout.events)
            run.curve_source = "TensorBoard events" if run.train or run.valid else ""
            if run.curve_source:
                run.notes.append("curves from TensorBoard events")
    read_config(run)
    if run.report is None:
        run.notes.append("no eval report")
        if not (run.train or run.valid):
            raise CompareError(f"{p}: no {LOG_NAME}, no TensorBoard events and no eval report")
    if run.path is not None and not run.tokens_per_step and (run.train or run.valid):
        run.notes.append("no config: tokens unknown")
    return run


def pick_baseline(runs: list, choice: str | None) -> tuple[int, str]:
    if choice is None:
        for i, r in enumerate(runs):
            if r.variant == "tied":
                return i, "the first run whose variant is tied"
        return 0, "the first run (no run is tied)"
    want = Path(choice).resolve()
    for i, r in enumerate(runs):
        if want in {q.resolve() for q in (r.path, r.report_path) if q is not None} or choice == r.name:
            return i, "--baseline"
    runs.insert(0, load_run(choice))  # a baseline that is not among the runs joins them
    return 0, "--baseline"


def unique_names(runs: list) -> None:
    """Same-named runs (two reports of one run, runs of one name elsewhere) become ``name@tag`` / ``name#k``."""
    seen: set = set()
    for k, r in enumerate(runs):
        if r.name in seen and r.report:
            r.name = f"{r.name}@{r.report.tag or r.report.step}"
        r.name = f"{r.name}#{k + 1}" if r.name in seen else r.name
        seen.add(r.name)
