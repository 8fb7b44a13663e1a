"""What ``python -m launchers.slurm submit|sweep|pipeline`` do: check every job (config, geometry, plan, data, no
live job of the same run) before anything is queued, write its files in the run directory, ``sbatch`` it, record
it, and print the job ids, logs and where to look next (or, with ``--dry-run``, print the plan and the script).

- :func:`cmd_submit`: one training job in the run directory (``--run``, else the config's ``train.out_dir``).
- :func:`cmd_sweep`: one job array, one config (variant) per element, each with its own run directory.
- :func:`cmd_pipeline`: preprocessing (an MPI job running ``data_prep.tokenize --mpi``) and/or evaluation around the
  training job, each ``--dependency=afterok`` on the one before.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from launchers import records, sbatch
from launchers.job_files import job_dir, record, run_sbatch, write_script
from launchers.job_spec import Job, Refused, Request, job_of, launch_of
from launchers.prep_eval_jobs import eval_stage, prep_stage
from launchers.sbatch import Launch
from launchers.submit_checks import active_jobs, need_sbatch, prepared
from leviathan_pretrain.config import ConfigError, load_config
from leviathan_pretrain.rundir.layout import LOGS as LOGS_DIR
from leviathan_pretrain.rundir.layout import RunLayout


def submit_train(
    job: Job, config: str, run_dir: Path, dependency: str | None = None, need_data: bool = True
) -> str | None:
    """Check one training job and submit it (or, with ``--dry-run``, print it): its job id, None on a dry run."""
    res, launch = job.resources, job.launch
    cfg, plan_text = prepared(job, config, run_dir, need_data)
    log = sbatch.log_pattern(run_dir, res.job_name)
    placeholder = str(run_dir / records.SLURM_DIR / "<stamp>" / "config.yaml")
    if job.dry_run:
        print(plan_text)
        print(sbatch.train_script(res, launch, str(run_dir), placeholder, log))
        return None
    need_sbatch()
    live = active_jobs(run_dir)
    if live:
        raise Refused(
            f"{run_dir}: job {', '.join(live)} of this run is still queued or running; "
            "wait for it or scancel it (two jobs would train into one checkpoint directory)"
        )
    (run_dir / LOGS_DIR).mkdir(parents=True, exist_ok=True)
    d, config_path = job_dir(run_dir, cfg)
    script_path = write_script(d, sbatch.train_script(res, launch, str(run_dir), str(config_path), log))
    print(plan_text)
    job_id = run_sbatch(script_path, dependency)
    real_log = sbatch.log_file(log, job_id)
    record(run_dir, job_id, "train", script_path, config_path, real_log, launch)
    print(
        f"submitted job {job_id}\n  log:         {real_log}\n  script:      {script_path}\n"
        f"  tensorboard: tensorboard --logdir {shlex.quote(str(run_dir / 'tensorboard'))}\n"
        f"  status:      python -m launchers.slurm status {shlex.quote(str(run_dir))}"
    )
    return job_id


def run_dir_of(req: Request) -> Path:
    """``--run``, else the config's ``train.out_dir`` (where the trainer would write without the launcher)."""
    if req.run_dir:
        return Path(req.run_dir).absolute()
    try:
        return Path(load_config(req.config, list(req.overrides)).train.out_dir).absolute()
    except ConfigError as e:
        raise Refused(str(e)) from None


def cmd_submit(req: Request) -> int:
    run_dir = run_dir_of(req)
    submit_train(job_of(req, f"lev-{Path(req.config).stem}"), req.config, run_dir)
    return 0


def cmd_sweep(req: Request) -> int:
    stems = [Path(c).stem for c in req.configs]
    if len(set(stems)) != len(stems):
        raise Refused(f"--configs: two configs share a name ({', '.join(stems)}); each element needs its own run dir")
    sweep_dir = Path(req.run_dir or f"runs/{os.path.commonprefix(stems).rstrip('-_') or 'sweep'}-sweep").absolute()
    job = job_of(req, f"lev-sweep-{sweep_dir.name}")
    res, launch = job.resources, job.launch
    elems, texts = [], []
    for config, stem in zip(req.configs, stems, strict=True):
        cfg, text = prepared(job, config, sweep_dir / stem)
        elems.append((config, stem, cfg))
        texts.append(f"[{len(texts)}] {config} -> {sweep_dir / stem}\n{text}")
    log = sbatch.log_pattern(sweep_dir, res.job_name, "-%A_%a.out")
    print("\n".join(texts))
    if job.dry_run:
        arrays = [(str(sweep_dir / s), str(sweep_dir / s / "slurm/<stamp>/config.yaml")) for _, s, _ in elems]
        print(sbatch.train_script(res, launch, "", "", log, arrays))
        return 0
    need_sbatch()
    live = [j for _, s, _ in elems for j in active_jobs(sweep_dir / s)]
    if live:
        raise Refused(f"{sweep_dir}: job {', '.join(live)} of this sweep is still queued or running")
    (sweep_dir / LOGS_DIR).mkdir(parents=True, exist_ok=True)
    arrays, configs = [], []
    for _, stem, cfg in elems:
        _, config_path = job_dir(sweep_dir / stem, cfg)
        configs.append(config_path)
        arrays.append((str(sweep_dir / stem), str(config_path)))
    script_path = write_script(job_dir(sweep_dir)[0], sbatch.train_script(res, launch, "", "", log, arrays))
    array_id = run_sbatch(script_path)
    for i, (_, stem, _) in enumerate(elems):
        record(
            sweep_dir / stem,
            f"{array_id}_{i}",
            "train",
            script_path,
            configs[i],
            sbatch.log_file(log, array_id, i),
            launch,
        )
    print(
        f"submitted job array {array_id} ({len(elems)} elements)\n  logs:   {sweep_dir / LOGS_DIR}\n"
        f"  tensorboard: tensorboard --logdir {shlex.quote(str(sweep_dir))}\n"
        f"  status: python -m launchers.slurm status {shlex.quote(str(sweep_dir))}"
    )
    return 0


def cmd_pipeline(req: Request) -> int:
    """[preprocessing ->] training [-> evaluation], each stage ``--dependency=afterok`` on the one before."""
    if req.prep is None and req.eval is None:
        raise Refused("pipeline: give --prep and/or --eval (training alone is `submit`)")
    run_dir = run_dir_of(req)
    launch = launch_of(req)
    step_launch = Launch(launch="srun", python=launch.python, workdir=launch.workdir, prologue=launch.prologue)
    prep = prep_stage(req, run_dir, step_launch) if req.prep else None
    evaluation = eval_stage(req, run_dir, step_launch) if req.eval is not None else None
    job_name = f"lev-{Path(req.config).stem}"
    if req.dry_run:
        if prep:
            print(prep.script)
        submit_train(job_of(req, job_name, launch), req.config, run_dir, need_data=not prep)
        if evaluation:
            print(evaluation.script)
        return 0
    need_sbatch()
    job = job_of(req, job_name, launch)
    prepared(job, req.config, run_dir, need_data=not prep)  # refuse before anything is queued
    (run_dir / LOGS_DIR).mkdir(parents=True, exist_ok=True)
    dependency = None
    if prep:
        path = write_script(job_dir(run_dir)[0], prep.script)
        dependency = run_sbatch(path)
        record(run_dir, dependency, "prep", path, None, sbatch.log_file(prep.log, dependency), step_launch)
        print(f"submitted preprocessing job {dependency}\n  log: {sbatch.log_file(prep.log, dependency)}")
    train_job = submit_train(job, req.config, run_dir, dependency=dependency, need_data=not prep)
    if evaluation:
        path = write_script(job_dir(run_dir)[0], evaluation.script)
        eval_job = run_sbatch(path, train_job)
        config = records.read_records(run_dir)[-1].get("config")  # the training job's resolved config
        log = sbatch.log_file(evaluation.log, eval_job)
        record(run_dir, eval_job, "eval", path, Path(config) if config else None, log, step_launch)
        print(
            f"submitted evaluation job {eval_job} (after training job {train_job} succeeds)\n"
            f"  log: {log}\n  report: {RunLayout(run_dir).report('<tag>')}"
        )
    return 0
