"""The status report of a SLURM run, from its run directory alone (what ``python -m launchers.status`` and
``python -m launchers.slurm status`` print).

For one run directory (a ``slurm/jobs.jsonl`` of :mod:`launchers.records`): the newest job's SLURM state
(:mod:`launchers.slurm_query`), the earlier jobs, the latest complete checkpoint (``<checkpoint.dir>/latest``), the
last ``train/loss``, ``perf/tokens_per_s`` and ``valid/loss`` from the TensorBoard events, and the tail of the job's
log: :func:`collect` gathers them as a JSON-ready dict, :func:`format_run` writes the text. For a sweep directory
(no records of its own, runs in its subdirectories): one line per run (:func:`format_sweep`).

Torch-free; the config loader and TensorBoard's reader are imported when used.
"""

from __future__ import annotations

import os
from pathlib import Path

from launchers.records import JOBS, jobs_file, read_records
from launchers.slurm_query import slurm_state
from leviathan_pretrain.rundir.layout import SLURM as SLURM_DIR
from leviathan_pretrain.rundir.layout import RunLayout
from leviathan_pretrain.rundir.tb_events import EventsError, read_scalars
from leviathan_pretrain.trainer.checkpoint.names import CheckpointError, read_latest, step_of

METRIC_TAGS = ("train/loss", "perf/tokens_per_s", "valid/loss")


class StatusError(Exception):
    """A path that is no run (or sweep) directory: main prints ``error: ...`` and exits 2."""


def _resolve(path: str, run_dir: Path, out_dir: str) -> Path:
    """A config path as the job saw it: relative paths are relative to the job's working directory, which is
    where ``train.out_dir`` (if relative) leads to ``run_dir``; else the current directory."""
    p = Path(path).expanduser()
    if p.is_absolute():
        return p
    parts, rd = Path(os.path.normpath(out_dir)).parts, run_dir.resolve().parts
    if not Path(out_dir).is_absolute() and 0 < len(parts) < len(rd) and rd[-len(parts) :] == parts:
        return Path(*rd[: -len(parts)]) / p
    return Path.cwd() / p


def run_paths(run_dir: Path, record: dict) -> dict:
    """``checkpoint_dir``, ``tensorboard_dir`` (None: TensorBoard off) and ``config_note`` for a run: from the
    resolved config the record names when it exists, else the defaults below ``run_dir``."""
    default = RunLayout(run_dir)
    out = {"checkpoint_dir": default.checkpoints, "tensorboard_dir": default.events, "config_note": None}
    cfg_path = record.get("config")
    if not cfg_path or not Path(cfg_path).is_file():
        out["config_note"] = f"config {cfg_path or '(none recorded)'} not found: assuming the default directories"
        return out
    try:
        from leviathan_pretrain.config import load_config

        cfg = load_config(cfg_path)
    except Exception as e:  # a config this version cannot read: the defaults are still a good guess
        out["config_note"] = f"could not read config {cfg_path} ({e}): assuming the default directories"
        return out
    if cfg.checkpoint.dir:
        out["checkpoint_dir"] = _resolve(cfg.checkpoint.dir, run_dir, cfg.train.out_dir)
    if not cfg.logging.tensorboard:
        out["tensorboard_dir"] = None
    elif cfg.logging.tensorboard_dir:
        out["tensorboard_dir"] = _resolve(cfg.logging.tensorboard_dir, run_dir, cfg.train.out_dir)
    return out


def read_progress(ckpt_dir: Path) -> dict:
    """``tag`` and ``step`` of the checkpoint ``latest`` names (None: none yet), ``error`` when it is broken."""
    try:
        tag = read_latest(ckpt_dir)
    except (CheckpointError, OSError) as e:
        return {"checkpoint_dir": str(ckpt_dir), "tag": None, "step": None, "error": str(e)}
    return {"checkpoint_dir": str(ckpt_dir), "tag": tag, "step": step_of(tag) if tag else None, "error": None}


def read_metrics(tb_dir: Path | None) -> dict:
    """The last value of each of :data:`METRIC_TAGS` in ``tb_dir``'s event files: ``{tag: {"step", "value"} or
    None, "error": str or None}`` (TensorBoard's own reader; a directory with no events gives all None)."""
    out = {tag: None for tag in METRIC_TAGS}
    out["error"] = None
    if tb_dir is None or not Path(tb_dir).is_dir() or not any(Path(tb_dir).glob("*tfevents*")):
        return out
    try:
        found = read_scalars(tb_dir, METRIC_TAGS, keep=1000)
    except EventsError as e:  # a truncated or foreign event file: report it, show the rest
        out["error"] = str(e)
        return out
    for tag, points in found.items():
        if points:
            out[tag] = {"step": points[-1][0], "value": points[-1][1]}
    return out


def tail(path: Path, n: int) -> list[str]:
    """The last ``n`` lines of ``path`` (reads only the end of a large file)."""
    if n <= 0:
        return []
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        end = pos = f.tell()
        data = b""
        while pos > 0 and data.count(b"\n") <= n:
            pos = max(0, pos - 65536)
            f.seek(pos)
            data = f.read(end - pos)
    return data.decode(errors="replace").splitlines()[-n:]


def collect(run_dir: str | os.PathLike, lines: int = 20) -> dict:
    """Everything :func:`report` shows for one run directory, as a JSON-ready dict."""
    run_dir = Path(run_dir)
    records = read_records(run_dir)
    if not records:
        raise StatusError(f"{run_dir} holds no {SLURM_DIR}/{JOBS}: give a run directory that launchers.slurm submitted")
    rec, paths = records[-1], run_paths(run_dir, records[-1])
    job = {k: rec.get(k) for k in ("job_id", "kind", "submitted", "log", "config")}
    log = {"path": rec.get("log"), "lines": [], "error": None}
    try:
        log["lines"] = tail(Path(rec["log"]), lines) if rec.get("log") else []
    except FileNotFoundError:
        log["error"] = "not there (yet: the job may not have started)"
    except OSError as e:
        log["error"] = f"cannot read it: {e}"
    return {
        "run_dir": str(run_dir.resolve()),
        "job": {**job, "slurm": slurm_state(str(rec["job_id"]))},
        "earlier_jobs": [{k: r.get(k) for k in ("job_id", "kind", "submitted")} for r in records[:-1]],
        "config_note": paths["config_note"],
        "progress": read_progress(paths["checkpoint_dir"]),
        "metrics": {"tensorboard_dir": str(paths["tensorboard_dir"] or ""), **read_metrics(paths["tensorboard_dir"])},
        "log": log,
    }


def sweep_runs(path: Path) -> list[Path]:
    """The immediate subdirectories of ``path`` that are run directories."""
    return sorted(d for d in path.iterdir() if d.is_dir() and jobs_file(d).is_file())


def collect_any(path: str | os.PathLike, lines: int = 20) -> dict:
    """:func:`collect` for a run directory; for a sweep directory ``{"sweep": path, "runs": [collect(...)]}``."""
    path = Path(path)
    if not path.is_dir():
        raise StatusError(f"{path} does not exist (or is no directory): give a run directory (train.out_dir)")
    if not jobs_file(path).is_file():
        runs = sweep_runs(path)
        if runs:
            return {"sweep": str(path.resolve()), "runs": [{"name": d.name, **collect(d, 0)} for d in runs]}
    return collect(path, lines)


def _state_line(s: dict) -> str:
    if s["known"] is False:
        return s["note"]
    if s["known"] is None:
        return f"unknown: {s['note']}"
    text = s["state"] + (f" ({s['reason']})" if s["reason"] else "")
    if s["source"] == "squeue":
        text += f", elapsed {s['elapsed']} of {s['time_limit']}"
    else:
        text += f", exit code {s['exit_code']}, ran {s['elapsed']}"
    text += f", on {s['nodes']}" if s.get("nodes") else ""
    return text + (f", requeued {s['restarts']}x" if s["restarts"] else "")


def _num(v: float) -> str:
    return f"{v:.4f}" if abs(v) < 1000 else f"{v:,.0f}"


def _job_line(j: dict) -> str:
    return f"{j['job_id']} ({j['kind']}), submitted {j['submitted']}"


def format_run(info: dict) -> str:
    job, prog, met, log = info["job"], info["progress"], info["metrics"], info["log"]
    out = [f"run       {info['run_dir']}"]
    out += [f"job       {_job_line(job)}", f"state     {_state_line(job['slurm'])}"]
    out += [f"earlier   {_job_line(j)}" for j in reversed(info["earlier_jobs"])]
    if info["config_note"]:
        out.append(f"note      {info['config_note']}")
    if prog["error"]:
        out.append(f"progress  checkpoint unreadable: {prog['error']}")
    elif prog["tag"]:
        out.append(f"progress  step {prog['step']} (checkpoint {prog['tag']} in {prog['checkpoint_dir']})")
    else:
        out.append(f"progress  none yet (no checkpoint in {prog['checkpoint_dir']})")
    found = [f"{t} {_num(met[t]['value'])} @ step {met[t]['step']}" for t in METRIC_TAGS if met[t]]
    if met["error"]:
        out.append(f"metrics   {met['error']}")
    elif not met["tensorboard_dir"]:
        out.append("metrics   none: TensorBoard logging is off (logging.tensorboard=false)")
    else:
        out.append(f"metrics   {'; '.join(found) if found else 'nothing logged yet in ' + met['tensorboard_dir']}")
    if log["error"] or not log["lines"]:
        out.append(f"log       {log['path']}: {log['error'] or 'empty'}")
    else:
        out.append(f"log       {log['path']} (last {len(log['lines'])} lines):")
        out += ["  " + ln for ln in log["lines"]]
    return "\n".join(out)


def format_sweep(info: dict) -> str:
    rows = [("run", "job", "state", "step", "train/loss")]
    for r in info["runs"]:
        s, loss = r["job"]["slurm"], r["metrics"]["train/loss"]
        state = s["state"] if s["known"] else ("forgotten" if s["known"] is False else "unknown")
        step = r["progress"]["step"] if r["progress"]["step"] is not None else "-"
        rows.append((r["name"], str(r["job"]["job_id"]), state, str(step), _num(loss["value"]) if loss else "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[4] for row in rows]
    if rows[1:] and all(r["job"]["slurm"]["known"] is None for r in info["runs"]):
        lines.append(f"(state unknown: {info['runs'][0]['job']['slurm']['note']})")
    return "\n".join([f"sweep {info['sweep']}", *lines, f"status {info['sweep']}/<run> for details"])


def report(run_dir: str | os.PathLike, lines: int = 20) -> str:
    """The text report of a run (or sweep) directory; raises :class:`StatusError` for a path that is neither."""
    info = collect_any(run_dir, lines)
    return format_sweep(info) if "sweep" in info else format_run(info)
