"""``launchers.slurm`` without a cluster: rendered scripts for 16 x 8 GPUs, quoting, refusals before ``sbatch``."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

from launchers import sbatch
from launchers.sbatch import Launch, Resources
from tests.multiproc import REPO, base_env

BIG = ["--nodes", "16", "--gpus-per-node", "8", "--partition", "gpu", "--time", "24:00:00"]


def slurm(*args, env=None, path=None) -> subprocess.CompletedProcess:
    e = base_env(env)
    if path is not None:
        e["PATH"] = path
    return subprocess.run(
        [sys.executable, "-m", "launchers.slurm", *map(str, args)],
        cwd=REPO,
        env=e,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def data(tmp_path):
    prefix = tmp_path / "pile_train"
    for ext in (".bin", ".idx"):
        prefix.with_suffix(ext).write_bytes(b"")
    return f"data.prefixes=[{prefix}]"


def sbatch_lines(script: str) -> list[str]:
    return [line[len("#SBATCH ") :] for line in script.splitlines() if line.startswith("#SBATCH ")]


def bash_syntax_ok(script: str) -> None:
    p = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr


@pytest.mark.parametrize("launch", ["torchrun", "srun", "deepspeed"])
def test_16_nodes_x_8_gpus(launch, data):
    p = slurm(
        "submit",
        "--config",
        "configs/1.2b-lev.yaml",
        *BIG,
        "--launch",
        launch,
        "--dry-run",
        "parallel.tensor_parallel=2",
        data,
    )
    assert p.returncode == 0, p.stderr
    script = p.stdout[p.stdout.index("#!/bin/bash") :]
    bash_syntax_ok(script)
    head = sbatch_lines(script)
    assert "--nodes=16" in head and "--gpus-per-node=8" in head and "--partition=gpu" in head
    assert "--time=24:00:00" in head and "--signal=USR1@300" in head and "--requeue" in head
    assert "--open-mode=append" in head
    assert re.search(r"^--output=.*/logs/lev-1\.2b-lev-%j\.out$", "\n".join(head), re.M)
    assert 'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"' in script
    assert "export MASTER_PORT=$((29500 + (SLURM_JOB_ID + 7919 * ${SLURM_RESTART_COUNT:-0}) % 20000))" in script
    assert "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in script
    node_cmd = next(line for line in script.splitlines() if line.startswith("NODE_CMD=("))
    if launch == "srun":
        assert "--ntasks-per-node=8" in head and "--cpus-per-task=8" in head
        assert 'srun --kill-on-bad-exit=1 --nodes=16 --ntasks-per-node=8 "${NODE_CMD[@]}"' in script
        assert "-m leviathan_pretrain.train --config" in node_cmd
    elif launch == "torchrun":
        assert "--ntasks-per-node=1" in head and "--cpus-per-task=64" in head
        assert 'srun --kill-on-bad-exit=1 --nodes=16 --ntasks-per-node=1 "${NODE_CMD[@]}"' in script
        for part in (
            '--nnodes="$SLURM_JOB_NUM_NODES"',
            "--nproc-per-node=8",
            "--rdzv-backend=c10d",
            '--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"',
            '--rdzv-id="$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}"',
            "-m launchers.torchrun_node",
            "-m leviathan_pretrain.train",
        ):
            assert part in node_cmd
    else:
        assert "--ntasks-per-node=1" in head
        assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | sed "s/$/ slots=$RANKS_PER_NODE/"' in script
        for part in (
            "deepspeed.launcher.runner",
            "--launcher=slurm",
            "--num_nodes=16",
            "--num_gpus=8",
            "--force_multi",
            "'--kill-on-bad-exit=1 --ntasks-per-node=8 --cpus-per-task=8'",
            "leviathan_pretrain/train.py",
        ):
            assert part in node_cmd
    # the plan is printed before the script
    assert "DP" in p.stdout[: p.stdout.index("#!/bin/bash")]


def test_every_user_value_is_quoted(tmp_path):
    nasty = str(tmp_path / "a b'c\"$(touch PWNED);d %x")
    res = Resources(
        nodes=2, gpus_per_node=8, job_name="j;$(touch PWNED)", account="acct $(x)", sbatch_args=["--comment=a b;c"]
    )
    launch = Launch(env={"NCCL_SOCKET_IFNAME": "$(touch PWNED);ib0"}, workdir=nasty)
    script = sbatch.train_script(res, launch, nasty, nasty + "/config.yaml", sbatch.log_pattern(nasty, res.job_name))
    bash_syntax_ok(script)
    # sbatch parses #SBATCH lines like a shell without expansions: shlex gives back the literal values
    head = dict(shlex.split(x)[0].split("=", 1) for x in sbatch_lines(script) if "=" in shlex.split(x)[0])
    assert head["--job-name"] == "j;$(touch PWNED)" and head["--account"] == "acct $(x)"
    assert head["--comment"] == "a b;c"
    assert head["--output"] == nasty.replace("%", "%%") + "/logs/j;$(touch PWNED)-%j.out"
    # the shell part: run the assignments and print what the trainer would get
    lines = script.splitlines()
    assigns = [x for x in lines if x.startswith(("RUN_DIR=", "CONFIG=", "export NCCL_SOCKET_IFNAME="))]
    p = subprocess.run(
        ["bash", "-c", "\n".join(assigns) + '\nprintf "%s\\n" "$RUN_DIR" "$CONFIG" "$NCCL_SOCKET_IFNAME"'],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=30,
    )
    assert p.stdout.splitlines() == [nasty, nasty + "/config.yaml", "$(touch PWNED);ib0"]
    assert not list(tmp_path.rglob("PWNED"))


def test_paths_sbatch_cannot_carry_are_refused(tmp_path, data):
    p = slurm(
        "submit",
        "--config",
        "configs/tiny-cpu-lev.yaml",
        "--gpus-per-node",
        "0",
        "--dry-run",
        "--run-dir",
        str(tmp_path / "a\\b"),
        data,
    )
    assert p.returncode == 2 and "cannot carry" in p.stderr


@pytest.mark.parametrize(
    "args,expect",
    [
        (["--nodes", "3", "parallel.tensor_parallel=4", "parallel.pipeline_parallel=4"], "not divisible by"),
        (["parallel.tensor_parallel=3"], "parallel.tensor_parallel"),
        (["--nodes", "2", "train.global_batch_size=24", "train.micro_batch_size=8"], "train.global_batch_size"),
        (["parallel.pipeline_parallel=32", "--nodes", "4"], "parallel.pipeline_parallel"),
        (
            ["--nodes", "1", "train.micro_batch_size=64", "train.global_batch_size=512", "parallel.zero_stage=0"],
            "--gpu-mem-gb",
        ),
        (["model.lev.heads=6", "parallel.tensor_parallel=4"], "model.lev.heads"),
        (["train.nosuchkey=1"], "train.nosuchkey"),
        (["--env", "1BAD=x"], "--env"),
    ],
)
def test_refused_before_sbatch_naming_the_key(args, expect, data):
    p = slurm("submit", "--config", "configs/1.2b-lev.yaml", "--gpus-per-node", "8", "--dry-run", *args, data)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.startswith("error: ") and expect in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


def test_memory_check_can_be_skipped(data):
    args = ["train.micro_batch_size=64", "train.global_batch_size=512", "parallel.zero_stage=0"]
    p = slurm("submit", "--config", "configs/1.2b-lev.yaml", "--dry-run", "--skip-memory-check", *args, data)
    assert p.returncode == 0, p.stderr


def test_missing_data_and_device_mismatch_are_refused(tmp_path, data):
    p = slurm(
        "submit",
        "--config",
        "configs/tiny-cpu-lev.yaml",
        "--gpus-per-node",
        "0",
        "--dry-run",
        f"data.prefixes=[{tmp_path / 'nope'}]",
    )
    assert p.returncode == 2 and "nope.bin does not exist" in p.stderr
    p = slurm("submit", "--config", "configs/tiny-cpu-lev.yaml", "--gpus-per-node", "8", "--dry-run", data)
    assert p.returncode == 2 and "parallel.device" in p.stderr


def test_no_sbatch_on_path_is_one_clear_line(tmp_path, data):
    p = slurm(
        "submit",
        "--config",
        "configs/tiny-cpu-lev.yaml",
        "--gpus-per-node",
        "0",
        "--run-dir",
        tmp_path / "r",
        data,
        path=os.path.dirname(sys.executable),
    )
    assert p.returncode == 2 and p.stderr.strip() == (
        "error: sbatch: not found on PATH; run this on a SLURM login node (or use --dry-run)"
    )
    assert not (tmp_path / "r").exists()


def test_help_of_every_command():
    for cmd in ([], ["submit"], ["sweep"], ["pipeline"], ["status"]):
        p = slurm(*cmd, "--help")
        assert p.returncode == 0 and "usage: python -m launchers.slurm" in p.stdout
    p = subprocess.run(
        [sys.executable, "-m", "launchers.torchrun_node", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0 and "--nproc-per-node" in p.stdout


def test_overrides_may_follow_the_sweeps_configs_or_stand_between_options(data):
    p = slurm("sweep", "--configs", "configs/tiny-cpu-lev.yaml", "configs/tiny-cpu-tied.yaml", data, "--gpus-per-node",
              "0", "train.global_batch_size=24", "--dry-run")  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "[0] configs/tiny-cpu-lev.yaml" in p.stdout and "[1] configs/tiny-cpu-tied.yaml" in p.stdout
    assert p.stdout.count("= global 24 sequences") == 2  # both overrides reached both elements
    p = slurm("submit", "--config", "configs/tiny-cpu-lev.yaml", "train.steps=7", "--gpus-per-node", "0", data,
              "--dry-run", "--bogus")  # fmt: skip
    assert p.returncode == 2 and "unrecognized arguments: --bogus" in p.stderr


def test_a_refused_sbatch_removes_only_the_folder_it_just_made(tmp_path, monkeypatch):
    """sbatch fails: the new ``RUN/slurm/<stamp>/`` (script, config) goes, nothing queued; the user's files beside
    it, an earlier submission's folder and the run directory stay."""
    from launchers.job_files import SbatchFailed, job_dir, run_sbatch, write_script
    from leviathan_pretrain.config import load_config

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\necho 'sbatch: error: Invalid account' >&2\nexit 1\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    run = tmp_path / "run"
    (run / "slurm" / "20260101T000000.000000").mkdir(parents=True)
    earlier = run / "slurm" / "20260101T000000.000000" / "job.sbatch"
    earlier.write_text("#!/bin/sh\n")
    mine = [run / "notes.txt", run / "slurm" / "my-notes.txt"]
    for f in mine:
        f.write_text("the user's")
    d, config = job_dir(run, load_config(REPO / "configs/tiny-cpu-lev.yaml"))
    script = write_script(d, "#!/bin/sh\n")
    assert config.is_file() and script.is_file()
    with pytest.raises(SbatchFailed, match="Invalid account"):
        run_sbatch(script)
    assert not d.exists()
    assert earlier.read_text() == "#!/bin/sh\n" and all(f.read_text() == "the user's" for f in mine)


@pytest.mark.integration
@pytest.mark.parametrize(
    "rc, term, requeued, says",
    [
        (0, False, False, "training exited with code 0"),
        (2, False, False, "training exited with code 2 (not requeued)"),
        (75, False, True, "stopped with a checkpoint (exit 75): requeueing job 42 (requeue 1 of at most 3)"),
        (76, False, True, "lost a peer (exit 76: a node died, the network was cut or a rank stalled"),
        (1, True, False, "training exited with code 1 after SLURM ended the job (a node failure"),
    ],
)
def test_the_requeue_rule_after_srun(tmp_path, rc, term, requeued, says):
    """The script's last lines, run by bash with the step's exit code and a stub ``scontrol``: 75 and 76 requeue,
    other codes end the job, a SIGTERM from SLURM (a node failure) is said as such; no command substitution runs
    after the step (a SIGTERM inside one breaks bash's trap)."""
    block = sbatch.REQUEUE
    assert not re.search(r"\$\((?!\()", block), "a command substitution after the step"  # $(( )) is arithmetic
    stub = tmp_path / "scontrol"
    stub.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/calls\n')
    stub.chmod(0o755)
    script = f"term={int(term)}\nMAX_REQUEUES=3\nSLURM_JOB_ID=42\n(exit {rc})\n{block}"
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_RESTART_COUNT": "0"}
    p = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30, env=env)
    assert says in p.stdout, p.stdout + p.stderr
    calls = (tmp_path / "calls").read_text() if (tmp_path / "calls").exists() else ""
    assert calls == ("requeue 42\n" if requeued else ""), calls
    assert p.returncode == (0 if requeued else rc), p.stdout


@pytest.mark.integration
@pytest.mark.parametrize(
    "rc, files, requeued, says",
    [
        (137, {"rank-0": "76", "rank-1": "75"}, True, "srun reported code 137, but a rank exited 76 before it"),
        (143, {"rank-3": "75"}, True, "srun reported code 143, but a rank exited 75 before it"),
        (137, {}, False, "training exited with code 137 (not requeued)"),
        (1, {"rank-0": "2"}, False, "training exited with code 1 (not requeued)"),
    ],
)
def test_a_ranks_own_code_stands_when_srun_reports_a_peers_kill(tmp_path, rc, files, requeued, says):
    """A rank that lost its peer exits 76 while the stalled peer, deaf to SIGTERM, is SIGKILLed by srun after it:
    srun reports the highest code, 137. The rank wrote its 76 into $LEV_STEP_CODES first (the trainer:
    data_prep/exit_codes.record_step_code), and the requeue rule takes it (75 likewise); other codes change nothing."""
    codes = tmp_path / "codes"
    codes.mkdir()
    for name, text in files.items():
        (codes / name).write_text(text + "\n")
    stub = tmp_path / "scontrol"
    stub.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/calls\n')
    stub.chmod(0o755)
    script = f"term=0\nMAX_REQUEUES=3\nSLURM_JOB_ID=42\n(exit {rc})\n{sbatch.REQUEUE}"
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_RESTART_COUNT": "0", "LEV_STEP_CODES": str(codes)}
    p = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30, env=env)
    assert says in p.stdout, p.stdout + p.stderr
    calls = (tmp_path / "calls").read_text() if (tmp_path / "calls").exists() else ""
    assert calls == ("requeue 42\n" if requeued else ""), calls
    assert p.returncode == (0 if requeued else rc), p.stdout


def test_the_trainer_records_only_the_codes_the_job_script_reads(tmp_path, monkeypatch):
    from common.exit_codes import record_step_code

    monkeypatch.delenv("LEV_STEP_CODES", raising=False)
    record_step_code(76)  # outside a SLURM job: nothing, nowhere
    monkeypatch.setenv("LEV_STEP_CODES", str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    for code in (0, 1, 2, 75):
        record_step_code(code)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-3"] and (tmp_path / "rank-3").read_text() == "75\n"
    record_step_code(76)
    assert [p.read_text() for p in tmp_path.iterdir()] == ["76\n"]  # replaced whole, no temporary left
    monkeypatch.setenv("LEV_STEP_CODES", str(tmp_path / "missing"))
    record_step_code(76)  # a folder that is gone: the exit goes on
