"""Errors that name the file and the cause, end to end on two ranks: a checkpoint directory that fills up during a
save (a real tmpfs, in a mount namespace of the test's own), a read-only one, and a rank killed between its
checkpoint's record and ``latest`` (its peer's one line). The messages themselves: tests/test_safe_io.py."""

from __future__ import annotations

import functools
import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from leviathan_pretrain.trainer.checkpoint import names as ckpt_names
from tests.multiproc import REPO, base_env
from tests.workers.train_common import CONFIG, overrides

UNSHARE = ["unshare", "--user", "--map-root-user", "--mount"]


@functools.cache
def _namespaces() -> str | None:
    """None when this machine lets an unprivileged process mount a tmpfs in its own mount namespace; else why not."""
    try:
        probe = subprocess.run([*UNSHARE, "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True)
    except OSError as e:
        return str(e)
    return None if probe.returncode == 0 else probe.stderr.decode().strip() or f"exit {probe.returncode}"


def _needs_namespaces():
    why = _namespaces()
    if why is not None:
        pytest.skip(f"no unprivileged mount namespace here ({why})")


def _losses(path: Path, after_last_resume: bool = False) -> dict[int, float]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    if after_last_resume:
        records = records[max(i for i, r in enumerate(records) if r.get("event") == "resumed") :]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.mark.multiproc
def test_a_full_disk_during_a_save_is_one_line_naming_the_file_and_the_run_resumes_exactly(tmp_path):
    """A 16 MiB tmpfs as checkpoint.dir (a checkpoint of the tiny model: 2.1 MB), filled just before step 6's save
    (after those of steps 2 and 4): a rank writing says 'No space left on device' and the file in one line after
    one traceback (no 'unexpected pos'), its peer the same or one 'lost a peer' line; `latest` still names step 4;
    with space again the same command resumes from step 4 and logs an uninterrupted run's losses
    (tests/workers/disk_full.py runs it all in the namespace)."""
    _needs_namespaces()
    ck = tmp_path / "ckpt"
    ck.mkdir()
    spec = {
        "config": CONFIG,
        "overrides": overrides(
            "unused", "train.steps=8", "train.eval_interval=0", "logging.log_interval=1", "checkpoint.save_interval=2"
        ),
        "ckpt_dir": str(ck),
        "ref_ckpt_dir": str(tmp_path / "ref" / "checkpoints"),
        "out_dir": str(tmp_path / "run"),  # train_log.jsonl, on the ordinary disk
        "ref_out_dir": str(tmp_path / "ref"),
        "fill_file": str(ck / "filler"),
        "size": "16m",
        "result": str(tmp_path / "result.json"),
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    driver = subprocess.run(
        [*UNSHARE, sys.executable, "tests/workers/disk_full.py", str(tmp_path / "spec.json")],
        cwd=REPO,
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert driver.returncode == 0, driver.stdout[-3000:] + driver.stderr[-3000:]
    res = json.loads((tmp_path / "result.json").read_text())
    full = res["full"]
    out = full["output"]
    assert full["code"] != 0 and f"filled {ck}" in out, out[-3000:]
    # the ranks share one pipe, unbuffered: a line is one write, its newline another (searched, not split on lines)
    said = re.findall(
        rf"\[rank (\d)\] error: checkpoint not saved: No space left on device \(ENOSPC\) writing "
        rf"{re.escape(str(ck))}/global_step6/\S+; free space on its file system \(or raise the quota\), then re-run "
        r"the same command: the previous checkpoint and `latest` are intact",
        out,
    )
    assert said and len(set(said)) == len(said), out[-5000:]  # a rank says it once
    assert out.count("Traceback (most recent call last)") == len(said), out[-5000:]  # one per failing rank
    assert out.count("No space left on device") == 2 * len(said), out[-5000:]  # its last line, then the rank's line
    assert len(said) == 2 or out.count("lost a peer") == 1, out[-5000:]  # the other rank: its own, or its peer lost
    assert "unexpected pos" not in out and "basic_ios" not in out and "frame #" not in out, out[-5000:]
    assert res["after_full"]["latest"] == "global_step4"
    assert "global_step4/leviathan.json" in res["after_full"]["files"]
    assert "global_step6/leviathan.json" not in res["after_full"]["files"]

    resumed = res["resume"]
    assert resumed["code"] == 0, resumed["output"][-3000:]
    assert "removed interrupted checkpoint save(s) global_step6" in resumed["output"]
    assert res["after_resume"]["latest"] == "global_step8"
    assert res["reference"]["code"] == 0, res["reference"]["output"][-3000:]
    events = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert [e["tag"] for e in events if e.get("event") == "resumed"] == ["global_step4"]
    after, ref = _losses(tmp_path / "run" / "train_log.jsonl", True), _losses(tmp_path / "ref" / "train_log.jsonl")
    assert sorted(after) == [5, 6, 7, 8] and sorted(ref) == list(range(1, 9))
    assert [after[s] for s in range(5, 9)] == [ref[s] for s in range(5, 9)]  # exact float equality


READ_ONLY = """
import sys
from pathlib import Path
from leviathan_pretrain.trainer.checkpoint import store as ckpt
from leviathan_pretrain.trainer.checkpoint.safe_io import safe_save
d = Path(sys.argv[1])
rng, latest = d / "global_step6" / "rng_rank00000.pt", d / "latest"
for write in (lambda: safe_save({}, rng), lambda: ckpt._atomic_write(latest, "global_step6")):
    try:
        write()
    except OSError as e:
        print("SAID", type(e).__name__, e)
"""


@pytest.mark.integration
def test_a_read_only_checkpoint_dir_is_said_in_one_line(tmp_path):
    """checkpoint.dir on a file system remounted read-only: the RNG file (torch.save) and `latest` (the atomic
    write) both say EROFS, the file, and what to do."""
    _needs_namespaces()
    d = tmp_path / "ro"
    d.mkdir()
    (tmp_path / "writes.py").write_text(READ_ONLY)
    script = (
        f"mount -t tmpfs -o size=1m tmpfs {d} && mkdir {d}/global_step6 && mount -o remount,ro {d} && "
        f"{sys.executable} {tmp_path / 'writes.py'} {d}"
    )
    run = subprocess.run([*UNSHARE, "sh", "-c", script], cwd=REPO, env=base_env(), capture_output=True, text=True)
    said = [line for line in run.stdout.splitlines() if line.startswith("SAID ")]
    assert run.returncode == 0 and len(said) == 2, run.stdout[-3000:] + run.stderr[-3000:]
    advice = (
        "the file system is mounted read-only: remount it writable or set another checkpoint.dir, then re-run the "
        "same command: the previous checkpoint and `latest` are intact"
    )
    assert said[0] == (
        f"SAID CheckpointSaveError checkpoint not saved: Read-only file system (EROFS) writing "
        f"{d}/global_step6/rng_rank00000.pt; {advice}"
    )
    assert said[1].startswith(
        f"SAID CheckpointSaveError checkpoint not saved: Read-only file system (EROFS) writing {d}/"
    )
    assert said[1].endswith(advice) and "latest" in said[1]


@pytest.mark.multiproc
def test_a_rank_killed_before_latest_leaves_its_peer_one_line(tmp_path):
    """Rank 0 SIGKILLed after writing step 4's leviathan.json, before replacing `latest`; rank 1, in the save's last
    barrier, says in one line that it lost rank 0 and that the run resumes from the latest complete checkpoint: no
    C++ stack (c10d's store client retrying a store that died with rank 0), no 'this rank may be the one cut off'."""
    out = tmp_path / "run"
    args = overrides(
        "unused",
        f"train.out_dir={out}",
        "train.steps=8",
        "train.eval_interval=0",
        "logging.log_interval=1",
        "checkpoint.save_interval=2",
    )
    run = subprocess.run(
        [sys.executable, "launchers/local.py", "-n", "2", "--grace", "30", "--", "tests/workers/train_faults.py"]
        + ["--config", CONFIG, *args],
        cwd=REPO,
        env=base_env({"LEV_TEST_KILL_BEFORE_LATEST_STEP": 4}),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    text = run.stdout
    assert run.returncode == 128 + signal.SIGKILL, text[-3000:]  # the first rank to fail: rank 0
    assert text.count("lost a peer") == 1, text[-5000:]
    line = re.search(r"\[rank 1 on \S+\] lost a peer in step 4: [^\n]*", text).group(0)
    assert re.match(r".*: a peer's connection closed: the connection to \S+ \(rank 0 on \S+\) closed; ", line), line
    assert "re-run: it resumes from the latest complete checkpoint" in line, line
    assert "the job's store is gone too" in line and "cut off" not in line, line
    assert re.search(r"\. \(Connection closed by peer \S+\)", line), line  # gloo's words: the first sentence
    assert "frame #" not in text and "Exception raised from" not in text and "Traceback" not in text, text[-5000:]
    ck = out / "checkpoints"
    assert (ck / "latest").read_text() == "global_step2"
    assert (ck / "global_step4" / ckpt_names.META).is_file()
