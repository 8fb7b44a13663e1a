"""``launchers.slurm`` against a real two-node SLURM cluster (Debian slurm-wlm; the ``slurm_cluster`` fixture: each
node its own network namespace, address and host name, tests/slurm_cluster.py).

The jobs are submitted together at the start (SLURM runs them as the two nodes' 2 CPUs each allow) by the ``jobs``
fixture, which also preempts one of them, a two-node job, the way SLURM does at a time limit (SIGUSR1 to every
process of the job's steps: ``scancel --signal=USR1``, what ``--signal=USR1@LEAD`` sends); the tests then read
what the jobs wrote. Every launch path runs across the two nodes and is compared with the same config on one node:
torchrun (TP 2 across the nodes, preempted and requeued), srun (DP 2), the deepspeed launcher (TP 2), and the
preprocessing job (MPI ranks on both nodes).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.multiproc import REPO, base_env

pytestmark = pytest.mark.multiproc
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")
STEPS = 24  # the loss falls by ~2 (9.1 -> 7.1) over these, the preemption at step 10 leaves 14 to resume


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
NODES2 = ["--nodes", "2", "--gpus-per-node", "0", "--tasks-per-node", "1"]  # one rank on each node
NASTY = "a b'c\"$(touch PWNED);d %j"


@pytest.fixture(scope="module")
def jobs(slurm_cluster, tmp_path_factory, tiny, minipile_dir, tokenizer_model) -> dict:
    root = tmp_path_factory.mktemp("slurm-runs")
    lev = "configs/tiny-cpu-lev.yaml"
    out = {"root": root}
    out["srun"] = submitted(
        slurm("submit", "--config", lev, *CPU2, "--launch", "srun", "--run-dir", root / "srun", *tiny)
    )
    out["torchrun"] = submitted(  # TP 2 across the nodes; preempted below, then compared with srun's
        slurm("submit", "--config", lev, *NODES2, "--launch", "torchrun", "--run-dir", root / "torchrun", *tiny)
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
    out["deepspeed"] = submitted(  # TP 2 across the nodes: compared with the sweep's tiny-cpu-lev (one node)
        slurm("submit", "--config", lev, *NODES2, "--launch", "deepspeed", "--run-dir", root / "deepspeed", *short)
    )
    dp = [t for t in short if not t.startswith(("parallel.tensor_parallel", "train.micro_batch_size"))]
    dp += ["parallel.tensor_parallel=1", "train.micro_batch_size=2"]  # DP 2 x micro-batch 2 = global batch 4
    out["srun_dp_2n"] = submitted(
        slurm("submit", "--config", lev, *NODES2, "--launch", "srun", "--run-dir", root / "srun_dp_2n", *dp)
    )
    # its one-node twin also carries the shell syntax: a run directory, a job name and an --env value full of it
    nasty_dir = root / "nasty" / NASTY
    out["nasty_dir"] = out["srun_dp_1n_dir"] = nasty_dir
    out["srun_dp_1n"] = out["nasty"] = submitted(
        slurm(
            "submit",
            "--config",
            lev,
            *CPU2,
            "--launch",
            "srun",
            "--run-dir",
            nasty_dir,
            "--job-name",
            "x;$(touch PWNED)'",
            "--env",
            "LEV_NASTY=$(touch PWNED);'\"",
            *dp,
        )
    )
    prefix = root / "chain" / "data" / "val"
    p = slurm(
        "pipeline",
        "--prep",
        f"--input {minipile_dir / 'val.jsonl.zst'} --tokenizer {tokenizer_model} --output-prefix {prefix}",
        "--prep-nodes",
        "2",
        "--prep-tasks-per-node",
        "1",
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
    # preempt the torchrun job once it has logged step 10: what SLURM does at --signal=USR1@LEAD
    deadline = time.monotonic() + 600
    while max(losses(root / "torchrun"), default=0) < 10:
        assert time.monotonic() < deadline, "the torchrun job did not reach step 10"
        time.sleep(0.5)
    subprocess.run(["scancel", "--signal=USR1", out["torchrun"]], check=True, timeout=30)
    names = ("srun", "torchrun", "deepspeed", "srun_dp_2n", "srun_dp_1n", "sweep", "prep", "chain", "eval")
    out["info"] = wait_jobs([out[k] for k in names])
    out["sweep_info"] = wait_jobs([f"{out['sweep']}_0", f"{out['sweep']}_1"])
    return out


def two_nodes(slurm_cluster) -> str:
    """The cluster's two node names in SLURM's compressed form, e.g. ``lev1a2bn[1-2]``."""
    first, second = slurm_cluster["LEV_TEST_NODES"].split(",")
    return f"{first[:-1]}[1-2]"


def test_submit_trains_with_srun_and_torchrun(jobs, slurm_cluster):
    for launch, nodes in (("srun", "1"), ("torchrun", "2")):
        info, run = jobs["info"][jobs[launch]], jobs["root"] / launch
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (launch, info, log_text(run)[-3000:])
        assert info["NumNodes"] == nodes, info
        if nodes == "2":  # one rank on each node: the tensor-parallel pair spans the nodes
            assert info["NodeList"] == two_nodes(slurm_cluster) and f"2 node(s) {info['NodeList']}" in log_text(run)
        ls = losses(run)
        assert sorted(ls) == list(range(1, STEPS + 1))
        assert ls[STEPS][0] < ls[1][0] - 1.0, f"{launch}: the loss did not go down: {ls[1]} -> {ls[STEPS]}"
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(run / "tensorboard"))
        acc.Reload()
        assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, STEPS + 1))
        assert "TP=2 PP=1 DP=1" in log_text(run)


def test_submit_trains_with_the_deepspeed_launcher(jobs, slurm_cluster):
    info, run = jobs["info"][jobs["deepspeed"]], jobs["root"] / "deepspeed"
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log_text(run)[-3000:]
    assert info["NumNodes"] == "2" and info["NodeList"] == two_nodes(slurm_cluster), info
    assert sorted(losses(run)) == list(range(1, 7)) and "TP=2 PP=1 DP=1" in log_text(run)
    hostfile = next((run / "slurm").glob("hostfile-*")).read_text()  # DeepSpeed's, written from the node list
    assert [line.split()[0] for line in hostfile.splitlines()] == slurm_cluster["LEV_TEST_NODES"].split(",")
    # TP 2 across two nodes trains what TP 2 on one node trains (the sweep's tiny-cpu-lev, srun): bit for bit
    assert losses(run) == losses(jobs["root"] / "sweep" / "tiny-cpu-lev")


def test_srun_data_parallel_across_two_nodes_equals_one_node(jobs, slurm_cluster):
    runs = {"srun_dp_2n": jobs["root"] / "srun_dp_2n", "srun_dp_1n": jobs["srun_dp_1n_dir"]}
    for name, run in runs.items():
        info = jobs["info"][jobs[name]]
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (name, info, log_text(run)[-3000:])
        assert info["NumNodes"] == ("2" if name.endswith("2n") else "1") and "TP=1 PP=1 DP=2" in log_text(run)
    assert sorted(losses(runs["srun_dp_2n"])) == list(range(1, 7))
    assert losses(runs["srun_dp_2n"]) == losses(runs["srun_dp_1n"])  # the gradients' all-reduce: bit for bit


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


def test_sweep_array_and_prep_train_chain(jobs, minipile_shards):
    root = jobs["root"]
    for i, name in enumerate(("tiny-cpu-lev", "tiny-cpu-tied")):
        assert jobs["sweep_info"][f"{jobs['sweep']}_{i}"]["JobState"] == "COMPLETED"
        assert sorted(losses(root / "sweep" / name)) == list(range(1, 7))
        cfg = (root / "sweep" / name / "slurm").glob("*/config.yaml")
        assert f"variant: {name.split('-')[-1]}" in next(cfg).read_text()
    prep, chain = jobs["info"][jobs["prep"]], jobs["info"][jobs["chain"]]
    assert prep["JobState"] == "COMPLETED" and chain["JobState"] == "COMPLETED", (prep, chain)
    assert chain["StartTime"] >= prep["EndTime"], (prep["EndTime"], chain["StartTime"])
    assert prep["NumNodes"] == "2", prep  # one MPI rank on each node (srun --mpi=pmix)
    for ext in (".bin", ".idx"):  # byte-identical to the single-process shards of the same file and tokenizer
        got = (root / "chain" / "data" / f"val{ext}").read_bytes()
        assert got == Path(minipile_shards["val"] + ext).read_bytes(), ext
    assert sorted(losses(root / "chain")) == list(range(1, 7))
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
    assert (run / "checkpoints" / "latest").is_file() and sorted(losses(run)) == list(range(1, 7))
    assert f"run {run}" in log_text(run)
    assert not list(REPO.glob("PWNED")) and not list(jobs["root"].rglob("PWNED")) and not Path("PWNED").exists()


def test_status_reports_a_finished_run(jobs, slurm_cluster):
    p = slurm("status", jobs["root"] / "torchrun", "--json")
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    text = json.dumps(rep)
    assert jobs["torchrun"] in text and f"global_step{STEPS}" in text
    assert rep["job"]["slurm"]["nodes"] == two_nodes(slurm_cluster), rep["job"]["slurm"]
    p = slurm("status", jobs["root"] / "torchrun")
    assert p.returncode == 0 and f", on {two_nodes(slurm_cluster)}, requeued 1x" in p.stdout, p.stdout


def test_unknown_partition_is_sbatchs_error(slurm_cluster, tmp_path, tiny):
    p = slurm(
        "submit", "--config", "configs/tiny-cpu-lev.yaml", *CPU2, "--partition", "nosuch", "--run-dir", tmp_path, *tiny
    )
    assert p.returncode == 1 and "error: sbatch refused the job: sbatch: error: invalid partition" in p.stderr.lower()
    assert not (tmp_path / "slurm" / "jobs.jsonl").exists()
