"""``python -m launchers.slurm status RUN_DIR``: where a SLURM run stands, from its run directory alone.

For one run directory (a ``slurm/jobs.jsonl`` of :mod:`launchers.records`): the newest job's SLURM state
(``squeue``, else ``scontrol show job``; SLURM forgets finished jobs after MinJobAge), the earlier jobs, the latest
complete checkpoint (``<checkpoint.dir>/latest``), the last ``train/loss``, ``perf/tokens_per_s`` and
``valid/loss`` from the TensorBoard events, and the tail of the job's log. For a sweep directory (no records of its
own, runs in its subdirectories): one line per run. ``--json`` prints the same as one JSON object.

Only the standard library is imported here; the config loader and TensorBoard's reader are imported when used.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from common import cli
from launchers.records import JOBS, jobs_file, read_records
from leviathan_pretrain.rundir.layout import SLURM as SLURM_DIR
from leviathan_pretrain.rundir.layout import RunLayout
from leviathan_pretrain.rundir.tb_events import EventsError, read_scalars
from leviathan_pretrain.trainer.checkpoint.names import CheckpointError, read_latest, step_of

METRIC_TAGS = ("train/loss", "perf/tokens_per_s", "valid/loss")
FORGOTTEN = "SLURM no longer knows this job (it forgets finished jobs after MinJobAge); see the log"


class StatusError(Exception):
    """A path that is no run (or sweep) directory: main prints ``error: ...`` and exits 2."""


def _slurm(args: list[str]) -> tuple[subprocess.CompletedProcess | None, str | None]:
    """Run a SLURM client command: (result, None), or (None, why it could not run)."""
    exe = shutil.which(args[0])
    if exe is None:
        return None, f"{args[0]} not found"
    try:
        return subprocess.run([exe, *args[1:]], capture_output=True, text=True, timeout=30), None
    except subprocess.TimeoutExpired:
        return None, f"{args[0]} timed out after 30s"
    except OSError as e:
        return None, f"{args[0]} failed: {e}"


def _failure(cmd: str, res: subprocess.CompletedProcess) -> str:
    msg = (res.stderr or res.stdout).strip().splitlines()
    return f"{cmd} exited {res.returncode}" + (f": {msg[-1]}" if msg else "")


def _invalid_id(res: subprocess.CompletedProcess) -> bool:
    return "invalid job id" in (res.stderr + res.stdout).lower()


def slurm_state(job_id: str) -> dict:
    """The job's state as SLURM reports it now. Keys: ``state`` (e.g. ``RUNNING``; ``unknown`` when SLURM could not
    be asked or has forgotten the job), ``known`` (True / False: forgotten / None: could not ask), ``note`` (why
    unknown), ``reason``, ``elapsed``, ``time_limit``, ``restarts`` (requeues), ``exit_code``, ``nodes`` (the node
    list it runs or ran on, SLURM's compressed form, e.g. ``gpu[001-016]``; None before it starts), ``source``."""
    keys = ("known", "note", "reason", "elapsed", "time_limit", "restarts", "exit_code", "nodes", "source")
    out = {"state": "unknown", **dict.fromkeys(keys)}
    res, why = _slurm(["squeue", "-h", "-j", str(job_id), "-o", "%T|%r|%M|%l|%N"])
    if res is None or (res.returncode != 0 and not _invalid_id(res)):
        return {**out, "note": why or _failure("squeue", res)}
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()] if res.returncode == 0 else []
    if lines:
        state, reason, elapsed, limit, nodes = (lines[0].split("|") + [""] * 5)[:5]
        out.update(state=state, known=True, source="squeue", elapsed=elapsed, time_limit=limit, nodes=nodes or None)
        out["reason"] = None if reason in ("", "None") else reason
    scontrol, why = _slurm(["scontrol", "show", "job", str(job_id)])
    if scontrol is None or scontrol.returncode != 0:
        if lines:  # squeue answered; scontrol only adds the requeue count
            return out
        if scontrol is not None and _invalid_id(scontrol):
            return {**out, "known": False, "note": FORGOTTEN}
        return {**out, "note": why or _failure("scontrol", scontrol)}
    fields = {}
    for tok in scontrol.stdout.split():
        key, eq, val = tok.partition("=")
        if eq and key not in fields:  # an array parent lists every element: keep the first
            fields[key] = val
    restarts, reason = fields.get("Restarts", ""), fields.get("Reason")
    out.update(restarts=int(restarts) if restarts.isdigit() else None, exit_code=fields.get("ExitCode"))
    if fields.get("NodeList") not in (None, "", "(null)"):
        out["nodes"] = fields["NodeList"]
    if not lines:
        out.update(state=fields.get("JobState", "unknown"), known=True, source="scontrol")
        out.update(elapsed=fields.get("RunTime"), time_limit=fields.get("TimeLimit"))
        out["reason"] = None if reason in (None, "None") else reason
    return out


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


def build_parser(prog: str = "python -m launchers.slurm status") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Where a SLURM run stands: job state, latest checkpoint, last metrics, log tail. For a sweep "
        "directory (runs in its subdirectories): one line per run.",
        epilog=f"example: {prog} runs/gpt-125m --lines 50",
    )
    cli.add_run(
        p,
        "the same as RUN_DIR",
        dest="run_dir",
        required=True,
        positional_help="the run's directory (train.out_dir), or a sweep directory",
    )
    p.add_argument("--lines", type=int, default=20, metavar="N", help="log lines to show (default 20)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text report")
    return p


def main(argv: list[str] | None = None) -> int:
    return cli.run_main(_status, build_parser().parse_args(argv), errors=(StatusError,))


def _status(args) -> int:
    info = collect_any(args.run_dir, max(0, args.lines))
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        print(format_sweep(info) if "sweep" in info else format_run(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
