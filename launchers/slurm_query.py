"""What SLURM says about a job now: ``squeue``, else ``scontrol show job`` (SLURM forgets finished jobs after
MinJobAge), each asked once with a timeout; a client that is missing, fails or times out gives an ``unknown`` state
with the reason, never an exception (the status report shows the rest of a run without SLURM).
"""

from __future__ import annotations

import shutil
import subprocess

FORGOTTEN = "SLURM no longer knows this job (it forgets finished jobs after MinJobAge); see the log"


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
