"""``launchers.slurm`` against a real single-node SLURM cluster (Debian slurm-wlm; the ``slurm_cluster`` fixture).

The jobs are submitted together at the start (SLURM runs them one after another on the 2 CPUs) by the ``jobs``
fixture, which also preempts one of them the way SLURM does at a time limit (SIGUSR1 to every process of the job's
steps: ``scancel --signal=USR1``, what ``--signal=USR1@LEAD`` sends); the tests then read what the jobs wrote.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launchers import sbatch
from launchers.sbatch import Launch, Resources
from tests.multiproc import REPO, base_env

pytestmark = pytest.mark.multiproc
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")
STEPS = 40


def slurm(*args, timeout=120, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "launchers.slurm", *args],
        cwd=REPO,
        env=base_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def submitted(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 0, f"submission failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    m = re.search(r"submitted (?:job|job array|preprocessing job) (\d+)", p.stdout)
    assert m, p.stdout
    return m.group(1)


def job_info(job: str) -> dict:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def wait_jobs(jobs: list[str], timeout: float = 900) -> dict:
    deadline, done = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        for j in jobs:
            if j not in done:
                info = job_info(j)
                if info.get("JobState") in TERMINAL:
                    done[j] = info
        if len(done) == len(jobs):
            return done
        time.sleep(1)
    raise AssertionError(f"jobs not finished within {timeout} s: {[(j, job_info(j).get('JobState')) for j in jobs]}")


def train_log(run_dir: Path) -> list[dict]:
    path = run_dir / "train_log.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def losses(run_dir: Path) -> dict[int, tuple]:
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in train_log(run_dir) if "loss" in r}


def log_text(run_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted((run_dir / "logs").glob("*.out")))


@pytest.fixture(scope="module")
def tiny(minipile_shards, tokenizer_model) -> list[str]:
    return [
        f"data.prefixes=[{minipile_shards['train']}]",
        f"data.valid_prefixes=[{minipile_shards['val']}]",
        f"data.tokenizer={tokenizer_model}",
        "parallel.tensor_parallel=2",
        "train.micro_batch_size=4",  # half the config's 8: the jobs check launching, not the model (~0.5 s a step)
        "train.global_batch_size=4",
        f"train.steps={STEPS}",
        "train.eval_interval=20",
        "train.eval_iters=2",
        "checkpoint.save_interval=1000",
        "logging.log_interval=5",
    ]


CPU2 = ["--nodes", "1", "--gpus-per-node", "0", "--tasks-per-node", "2"]
NASTY = "a b'c\"$(touch PWNED);d %j"


@pytest.fixture(scope="module")
def jobs(slurm_cluster, tmp_path_factory, tiny, minipile_dir, tokenizer_model) -> dict:
    root = tmp_path_factory.mktemp("slurm-runs")
    lev = "configs/tiny-cpu-lev.yaml"
    out = {"root": root}
    out["srun"] = submitted(
        slurm("submit", "--config", lev, *CPU2, "--launch", "srun", "--run-dir", root / "srun", *tiny)
    )
    out["torchrun"] = submitted(
        slurm("submit", "--config", lev, *CPU2, "--launch", "torchrun", "--run-dir", root / "torchrun", *tiny)
    )
    short = [t for t in tiny if not t.startswith(("train.steps", "train.eval"))] + [
        "train.steps=6",
        "train.eval_interval=0",
    ]
    out["sweep"] = submitted(
        slurm(
            "sweep",
            "--configs",
            lev,
            "configs/tiny-cpu-tied.yaml",
            *CPU2,
            "--launch",
            "srun",
            "--run-dir",
            root / "sweep",
            *short,
        )
    )
    out["deepspeed"] = submitted(
        slurm("submit", "--config", lev, *CPU2, "--launch", "deepspeed", "--run-dir", root / "deepspeed", *short)
    )
    prefix = root / "chain" / "data" / "val"
    p = slurm(
        "pipeline",
        "--prep",
        f"--input {minipile_dir / 'val.jsonl.zst'} --tokenizer {tokenizer_model} --output-prefix {prefix}",
        "--prep-tasks-per-node",
        "2",
        "--prep-cpus",
        "1",
        "--eval",
        "--max-tokens 3000 --context 64",
        "--config",
        lev,
        *CPU2,
        "--launch",
        "srun",
        "--run-dir",
        root / "chain",
        *[t for t in short if not t.startswith("data.")],
        "data.split=90,10,0",
        f"data.prefixes=[{prefix}]",
        f"data.tokenizer={tokenizer_model}",
    )
    ids = re.findall(r"submitted (?:preprocessing |evaluation )?job (\d+)", p.stdout)
    assert len(ids) == 3, f"{p.stdout}\n{p.stderr}"
    out["prep"], out["chain"], out["eval"] = ids
    nasty_dir = root / "nasty" / NASTY
    out["nasty_dir"] = nasty_dir
    out["nasty"] = submitted(
        slurm(
            "submit",
            "--config",
            lev,
            "--nodes",
            "1",
            "--gpus-per-node",
            "0",
            "--launch",
            "srun",
            "--run-dir",
            nasty_dir,
            "--job-name",
            "x;$(touch PWNED)'",
            "--env",
            "LEV_NASTY=$(touch PWNED);'\"",
            *[t for t in short if "tensor_parallel" not in t],
            "train.steps=2",
        )
    )
    # preempt the torchrun job once it has logged step 10: what SLURM does at --signal=USR1@LEAD
    deadline = time.monotonic() + 600
    while max(losses(root / "torchrun"), default=0) < 10:
        assert time.monotonic() < deadline, "the torchrun job did not reach step 10"
        time.sleep(0.5)
    subprocess.run(["scancel", "--signal=USR1", out["torchrun"]], check=True, timeout=30)
    names = ("srun", "torchrun", "deepspeed", "sweep", "prep", "chain", "eval", "nasty")
    out["info"] = wait_jobs([out[k] for k in names])
    out["sweep_info"] = wait_jobs([f"{out['sweep']}_0", f"{out['sweep']}_1"])
    return out


def test_submit_trains_with_srun_and_torchrun(jobs):
    for launch in ("srun", "torchrun"):
        info, run = jobs["info"][jobs[launch]], jobs["root"] / launch
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (launch, info, log_text(run)[-3000:])
        ls = losses(run)
        assert sorted(ls) == list(range(1, STEPS + 1))
        assert ls[STEPS][0] < ls[1][0] - 1.0, f"{launch}: the loss did not go down: {ls[1]} -> {ls[STEPS]}"
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(run / "tensorboard"))
        acc.Reload()
        assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, STEPS + 1))
        assert "TP=2 PP=1 DP=1" in log_text(run)


def test_submit_trains_with_the_deepspeed_launcher(jobs):
    info, run = jobs["info"][jobs["deepspeed"]], jobs["root"] / "deepspeed"
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log_text(run)[-3000:]
    assert sorted(losses(run)) == list(range(1, 7)) and "TP=2 PP=1 DP=1" in log_text(run)
    assert list((run / "slurm").glob("hostfile-*"))  # DeepSpeed's hostfile, written from the node list


def test_preempted_job_requeues_itself_and_resumes_exactly(jobs):
    run = jobs["root"] / "torchrun"
    info, text = jobs["info"][jobs["torchrun"]], log_text(run)
    assert info["Restarts"] == "1", info
    assert "stopped reason=signal exit_code=75" in text and "requeueing job" in text, text[-3000:]
    resumed = [r for r in train_log(run) if r.get("event") == "resumed"]
    assert len(resumed) == 1 and 10 <= resumed[0]["step"] < STEPS, resumed
    assert text.count("attempt 1:") == 1 and text.count("attempt 2:") == 1
    # the uninterrupted srun job trained the same config on the same 2 ranks: after the resume, every loss and
    # gradient norm equals it bit for bit (and the steps before it were logged once each)
    ref, got = losses(jobs["root"] / "srun"), losses(run)
    assert got == ref


def test_requeue_limit_stops_and_says_so(slurm_cluster, tmp_path, tiny):
    p = slurm(
        "submit",
        "--config",
        "configs/tiny-cpu-lev.yaml",
        *CPU2,
        "--launch",
        "srun",
        "--run-dir",
        tmp_path,
        "--max-requeues",
        "0",
        *tiny,
        "train.exit_at_step=3",
    )
    info = wait_jobs([submitted(p)], timeout=300)
    job = next(iter(info.values()))
    assert job["JobState"] == "FAILED" and job["ExitCode"] == "75:0" and job["Restarts"] == "0", job
    assert "not requeueing; resubmit the same command to resume" in log_text(tmp_path)
    # resubmitting the same command continues from the checkpoint (and finishes, no exit_at_step this time)
    p = slurm(
        "submit",
        "--config",
        "configs/tiny-cpu-lev.yaml",
        *CPU2,
        "--launch",
        "srun",
        "--run-dir",
        tmp_path,
        *tiny,
        "train.steps=5",
    )
    job = next(iter(wait_jobs([submitted(p)], timeout=300).values()))
    assert job["JobState"] == "COMPLETED", job
    assert [r["step"] for r in train_log(tmp_path) if r.get("event") == "resumed"] == [3]


def test_sweep_array_and_prep_train_chain(jobs):
    root = jobs["root"]
    for i, name in enumerate(("tiny-cpu-lev", "tiny-cpu-tied")):
        assert jobs["sweep_info"][f"{jobs['sweep']}_{i}"]["JobState"] == "COMPLETED"
        assert sorted(losses(root / "sweep" / name)) == list(range(1, 7))
        cfg = (root / "sweep" / name / "slurm").glob("*/config.yaml")
        assert f"variant: {name.split('-')[-1]}" in next(cfg).read_text()
    prep, chain = jobs["info"][jobs["prep"]], jobs["info"][jobs["chain"]]
    assert prep["JobState"] == "COMPLETED" and chain["JobState"] == "COMPLETED", (prep, chain)
    assert chain["StartTime"] >= prep["EndTime"], (prep["EndTime"], chain["StartTime"])
    assert (root / "chain" / "data" / "val.idx").is_file() and sorted(losses(root / "chain")) == list(range(1, 7))
    ev = jobs["info"][jobs["eval"]]
    assert ev["JobState"] == "COMPLETED" and ev["StartTime"] >= chain["EndTime"], (ev, log_text(root / "chain")[-3000:])
    report = json.loads((root / "chain" / "eval" / "global_step6.json").read_text())
    assert report["heldout"][0]["name"] == "val:valid" and report["heldout"][0]["tokens"] > 0  # the split's docs
    status = slurm("status", root / "sweep")
    assert status.returncode == 0 and "tiny-cpu-tied" in status.stdout, status.stdout + status.stderr


def test_nothing_injected(jobs):
    """A run directory, a job name and an --env value full of shell syntax reach the job as literal text."""
    run = jobs["nasty_dir"]
    assert jobs["info"][jobs["nasty"]]["JobState"] == "COMPLETED", log_text(run)[-2000:]
    assert (run / "checkpoints" / "latest").is_file() and sorted(losses(run)) == [1, 2]
    assert f"run {run}" in log_text(run)
    assert not list(REPO.glob("PWNED")) and not list(jobs["root"].rglob("PWNED")) and not Path("PWNED").exists()


def test_status_reports_a_finished_run(jobs):
    p = slurm("status", jobs["root"] / "torchrun", "--json")
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    text = json.dumps(rep)
    assert jobs["torchrun"] in text and f"global_step{STEPS}" in text


def test_unknown_partition_is_sbatchs_error(slurm_cluster, tmp_path, tiny):
    p = slurm(
        "submit", "--config", "configs/tiny-cpu-lev.yaml", *CPU2, "--partition", "nosuch", "--run-dir", tmp_path, *tiny
    )
    assert p.returncode == 1 and "error: sbatch refused the job: sbatch: error: invalid partition" in p.stderr.lower()
    assert not (tmp_path / "slurm" / "jobs.jsonl").exists()


def test_two_nodes_per_node_command(slurm_cluster, tmp_path, tiny):
    """The per-node command of a 2-node torchrun job, run twice here as node 0 and node 1, trains at world size 2."""
    import yaml

    from leviathan_pretrain.config import load_config, to_dict

    cfg = load_config("configs/tiny-cpu-lev.yaml", [*tiny, "train.steps=4", "train.eval_interval=0"])
    cfg.train.out_dir = str(tmp_path / "run")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(to_dict(cfg)))
    res = Resources(nodes=2, gpus_per_node=0, tasks_per_node=1)
    script = sbatch.train_script(
        res,
        Launch(launch="torchrun", workdir=str(REPO)),
        str(tmp_path / "run"),
        str(config),
        sbatch.log_pattern(tmp_path, "x"),
    )
    lines = script.splitlines()
    body = lines[lines.index("set -uo pipefail") + 1 : next(i for i, x in enumerate(lines) if x.startswith("trap"))]
    node_cmd = next(x for x in lines if x.startswith("NODE_CMD=("))
    host = socket.gethostname().split(".")[0]
    procs = []
    for node in (0, 1):
        env = base_env(
            {
                "SLURM_JOB_ID": "4242",
                "SLURM_JOB_NUM_NODES": "2",
                "SLURM_NNODES": "2",
                "SLURM_JOB_NODELIST": f"{host},localhost",
                "SLURM_NODEID": str(node),
                "SLURM_PROCID": str(node),
                "SLURM_NTASKS": "2",
                "SLURM_LOCALID": "0",
            }
        )
        cmd = "\n".join([*body, node_cmd, 'exec "${NODE_CMD[@]}"'])
        procs.append(
            subprocess.Popen(
                ["bash", "-c", cmd],
                env=env,
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)[-4000:]
    assert "TP=2 PP=1 DP=1" in "\n".join(outs)
    assert sorted(losses(tmp_path / "run")) == [1, 2, 3, 4]
