"""Submit training to SLURM in one command: ``python -m launchers.slurm {submit,sweep,pipeline,status} ...``.

- ``submit``: validate the config and the geometry (plan + memory estimate), render an sbatch script, save it and
  the resolved config in the run directory, ``sbatch --parsable`` it; print the job id, log and TensorBoard paths.
- ``sweep``: one job array, one config (variant) per element, each with its own run directory.
- ``pipeline``: preprocessing (an MPI job running ``data_prep.tokenize --mpi``) then training, linked with
  ``--dependency=afterok``.
- ``status RUN_DIR``: job state, requeues, latest checkpoint, last loss and tokens/s, the log tail.

Preemption and time limits: the job asks for SIGUSR1 ``--signal-lead`` seconds before its limit; every rank
checkpoints and exits 75; the job script requeues itself (``scontrol requeue``) up to ``--max-requeues`` times and
the requeued job resumes from the latest checkpoint. Full reference: docs/launchers.md.
Exit codes: 0 submitted (or printed, with --dry-run); 2 refused (config, geometry, memory, paths); 1 sbatch failed.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python launchers/slurm.py` works too
from data_prep.fileio import write_bytes_atomic  # noqa: E402
from launchers import records, sbatch  # noqa: E402
from launchers.sbatch import LAUNCHES, Launch, Resources, ScriptError  # noqa: E402
from leviathan_pretrain.config import ConfigError, load_config, to_dict  # noqa: E402

EXAMPLES = """examples:
  python -m launchers.slurm submit --config configs/1.2b-lev.yaml --nodes 16 --gpus-per-node 8 \\
      --partition gpu --time 24:00:00 parallel.tensor_parallel=2 'data.prefixes=[/data/pile_train]' --dry-run
  python -m launchers.slurm sweep --configs configs/200m-{tied,untied,albert,lev}.yaml --nodes 2 --time 12:00:00
  python -m launchers.slurm pipeline --prep "--input 'pile/train/*.jsonl.zst' --tokenizer tok/tokenizer.model \\
      --output-prefix data/pile_train" --config configs/400m-lev.yaml --nodes 4 'data.prefixes=[data/pile_train]'
  python -m launchers.slurm status runs/1.2b-lev"""


class Refused(Exception):
    """A submission refused before ``sbatch``: the message names the key or option and what to change."""


# ---------------------------------------------------------------- arguments


def add_job_options(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("resources (sbatch)")
    g.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    g.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node; 0 for a CPU cluster (default 8)")
    g.add_argument(
        "--tasks-per-node", type=int, help="training ranks per node (default: --gpus-per-node, or 1 without GPUs)"
    )
    g.add_argument("--cpus-per-rank", type=int, help="CPU cores per rank (default 8 per GPU rank, 1 per CPU rank)")
    for opt in ("partition", "account", "time", "qos", "constraint", "mem", "mail-user"):
        g.add_argument(f"--{opt}", help=f"sbatch --{opt}")
    g.add_argument("--mail-type", default="END,FAIL,REQUEUE", help="sbatch --mail-type with --mail-user")
    g.add_argument("--exclusive", action="store_true", help="sbatch --exclusive (whole nodes)")
    g.add_argument("--job-name", help="sbatch --job-name (default: lev-<config name>)")
    g.add_argument(
        "--sbatch-arg", action="append", default=[], metavar="OPT", help="extra #SBATCH option, e.g. --reservation=r"
    )
    g = ap.add_argument_group("launch")
    g.add_argument(
        "--launch", choices=LAUNCHES, default="torchrun", help="per-node torchrun (default), srun, deepspeed"
    )
    g.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="export in the job (repeatable)")
    g.add_argument("--prologue", help="shell lines run before training, as given (e.g. 'module load cuda/12.4')")
    g.add_argument("--python", default=sys.executable, help="the job's interpreter (default: this one)")
    g.add_argument("--signal-lead", type=int, default=300, help="SIGUSR1 this many s before the time limit (300)")
    g.add_argument("--max-requeues", type=int, default=20, help="requeues after exit 75 before giving up (20)")
    g.add_argument("--gpu-mem-gb", type=float, default=80.0, help="GPU memory for the estimate check (80)")
    g.add_argument("--skip-memory-check", action="store_true", help="submit even if the estimate exceeds it")
    g.add_argument("--dry-run", action="store_true", help="print the plan and the script; submit nothing")


def add_config(ap: argparse.ArgumentParser, many: bool = False) -> None:
    if many:
        ap.add_argument("--configs", nargs="+", required=True, help="one config per array element")
    else:
        ap.add_argument("--config", required=True, help="YAML config (may name a base: file)")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides, for every job")


def resources(ns, job_name: str) -> Resources:
    for opt in ("nodes", "gpus_per_node", "tasks_per_node", "cpus_per_rank"):
        v = getattr(ns, opt)
        if v is not None and v < (0 if opt == "gpus_per_node" else 1):
            raise Refused(f"--{opt.replace('_', '-')}: must be >= {0 if opt == 'gpus_per_node' else 1}, got {v}")
    return Resources(
        nodes=ns.nodes,
        gpus_per_node=ns.gpus_per_node,
        tasks_per_node=ns.tasks_per_node,
        cpus_per_rank=ns.cpus_per_rank,
        partition=ns.partition,
        account=ns.account,
        time=ns.time,
        qos=ns.qos,
        constraint=ns.constraint,
        exclusive=ns.exclusive,
        mem=ns.mem,
        mail_user=ns.mail_user,
        mail_type=ns.mail_type,
        job_name=ns.job_name or job_name,
        sbatch_args=ns.sbatch_arg,
    )


def launch_of(ns) -> Launch:
    env = {}
    for item in ns.env:
        key, eq, value = item.partition("=")
        if not eq or not key.isidentifier():
            raise Refused(f"--env {item!r}: expected KEY=VALUE with KEY a shell variable name")
        env[key] = value
    if ns.signal_lead < 1:
        raise Refused("--signal-lead: must be >= 1 second")
    if ns.max_requeues < 0:
        raise Refused("--max-requeues: must be >= 0")
    return Launch(
        launch=ns.launch,
        python=ns.python,
        workdir=os.getcwd(),
        env=env,
        signal_lead=ns.signal_lead,
        max_requeues=ns.max_requeues,
        prologue=ns.prologue,
    )


# ---------------------------------------------------------------- checks


def load(config: str, overrides: list[str], run_dir: Path):
    """The validated config with ``train.out_dir`` = the run directory."""
    try:
        cfg = load_config(config, overrides)
    except ConfigError as e:
        raise Refused(str(e)) from None
    cfg.train.out_dir = str(run_dir)
    return cfg


def check_data(cfg, config: str) -> None:
    if not cfg.data.prefixes:
        raise Refused(f"{config}: data.prefixes: empty; set data.prefixes=[PREFIX,...] (megatron-core shards)")
    for prefix in [*cfg.data.prefixes, *(cfg.data.valid_prefixes or [])]:
        for ext in (".bin", ".idx"):
            if not Path(prefix + ext).is_file():
                raise Refused(
                    f"{config}: data.prefixes: {prefix}{ext} does not exist (paths are relative to {os.getcwd()})"
                )


def check_device(cfg, res: Resources) -> None:
    dev = cfg.parallel.device
    if res.gpus_per_node and dev == "cpu":
        raise Refused(
            f"parallel.device: cpu, but --gpus-per-node {res.gpus_per_node} asks for GPUs; "
            "set parallel.device=auto or --gpus-per-node 0"
        )
    if not res.gpus_per_node and dev == "cuda":
        raise Refused("parallel.device: cuda, but --gpus-per-node 0; give --gpus-per-node or parallel.device=cpu")


def make_plan(cfg, res: Resources, ns):
    from leviathan_pretrain.plan import format_plan, make_plan

    gpu = res.gpus_per_node > 0
    plan = make_plan(cfg, res.nodes, res.ranks_per_node, "gpu" if gpu else "cpu", ns.gpu_mem_gb if gpu else None)
    problems = [p for p in plan.problems if not (ns.skip_memory_check and p.startswith("--gpu-mem-gb"))]
    return plan, format_plan(plan), problems


def prepared(ns, config: str, run_dir: Path, res: Resources, need_data: bool = True):
    cfg = load(config, ns.overrides, run_dir)
    check_device(cfg, res)
    if need_data:
        check_data(cfg, config)
    plan, text, problems = make_plan(cfg, res, ns)
    if problems:
        raise Refused(f"{config}: the plan cannot work (see problem: below):\n{text}")
    return cfg, text


def active_jobs(run_dir: Path) -> list[str]:
    """Job ids recorded for ``run_dir`` that SLURM still has queued or running."""
    ids = [r["job_id"] for r in records.read_records(run_dir) if r.get("kind") == "train"]
    if not ids:
        return []
    p = subprocess.run(["squeue", "-h", "-o", "%i %T", "-j", ",".join(ids)], capture_output=True, text=True, timeout=30)
    live = []
    for line in p.stdout.splitlines():
        job, _, state = line.partition(" ")
        if state in ("PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUE_HOLD"):
            live.append(job)
    return live


def need_sbatch() -> None:
    if shutil.which("sbatch") is None:
        raise Refused("sbatch: not found on PATH; run this on a SLURM login node (or use --dry-run)")


# ---------------------------------------------------------------- submission


def stamp() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%f")


def job_dir(run_dir: Path, cfg=None) -> tuple[Path, Path | None]:
    """A new ``RUN/slurm/<stamp>/`` (+ the resolved ``config.yaml``, atomically): ours to remove if sbatch fails."""
    import yaml

    d = run_dir / records.SLURM_DIR / stamp()
    d.mkdir(parents=True)
    config = None
    if cfg is not None:
        config = d / "config.yaml"
        write_bytes_atomic(config, yaml.safe_dump(to_dict(cfg), sort_keys=False).encode())
    return d, config


def write_script(d: Path, script: str) -> Path:
    path = d / "job.sbatch"
    write_bytes_atomic(path, script.encode())
    return path


def run_sbatch(script: Path, dependency: str | None = None) -> str:
    cmd = ["sbatch", "--parsable"] + ([f"--dependency=afterok:{dependency}"] if dependency else []) + [str(script)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        shutil.rmtree(script.parent, ignore_errors=True)  # the stamp folder we just created; nothing was queued
        raise SbatchFailed(p.stderr.strip() or f"sbatch exited with {p.returncode}")
    return p.stdout.strip().split(";")[0]


class SbatchFailed(Exception):
    pass


def record(run_dir: Path, job_id: str, kind: str, script: Path, config: Path | None, log: str, launch: Launch):
    records.append_record(
        run_dir,
        {
            "job_id": job_id,
            "kind": kind,
            "submitted": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "script": str(script),
            "config": str(config) if config else None,
            "log": log,
            "argv": sys.argv,
            "launch": launch.launch,
            "max_requeues": launch.max_requeues,
        },
    )


def submit_train(ns, config: str, run_dir: Path, dependency: str | None = None, need_data: bool = True) -> str | None:
    res = resources(ns, f"lev-{Path(config).stem}")
    launch = launch_of(ns)
    cfg, plan_text = prepared(ns, config, run_dir, res, need_data)
    log = sbatch.log_pattern(run_dir, res.job_name)
    placeholder = str(run_dir / records.SLURM_DIR / "<stamp>" / "config.yaml")
    if ns.dry_run:
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
    (run_dir / records.LOGS_DIR).mkdir(parents=True, exist_ok=True)
    d, config_path = job_dir(run_dir, cfg)
    script_path = write_script(d, sbatch.train_script(res, launch, str(run_dir), str(config_path), log))
    print(plan_text)
    job = run_sbatch(script_path, dependency)
    real_log = sbatch.log_file(log, job)
    record(run_dir, job, "train", script_path, config_path, real_log, launch)
    print(
        f"submitted job {job}\n  log:         {real_log}\n  script:      {script_path}\n"
        f"  tensorboard: tensorboard --logdir {shlex.quote(str(run_dir / 'tensorboard'))}\n"
        f"  status:      python -m launchers.slurm status {shlex.quote(str(run_dir))}"
    )
    return job


def run_dir_of(ns) -> Path:
    """``--run-dir``, else the config's ``train.out_dir`` (where the trainer would write without the launcher)."""
    if ns.run_dir:
        return Path(ns.run_dir).absolute()
    try:
        return Path(load_config(ns.config, ns.overrides).train.out_dir).absolute()
    except ConfigError as e:
        raise Refused(str(e)) from None


def cmd_submit(ns) -> int:
    submit_train(ns, ns.config, run_dir_of(ns))
    return 0


def cmd_sweep(ns) -> int:
    stems = [Path(c).stem for c in ns.configs]
    if len(set(stems)) != len(stems):
        raise Refused(f"--configs: two configs share a name ({', '.join(stems)}); each element needs its own run dir")
    sweep_dir = Path(ns.run_dir or f"runs/{os.path.commonprefix(stems).rstrip('-_') or 'sweep'}-sweep").absolute()
    res = resources(ns, f"lev-sweep-{sweep_dir.name}")
    launch = launch_of(ns)
    elems, texts = [], []
    for config, stem in zip(ns.configs, stems, strict=True):
        cfg, text = prepared(ns, config, sweep_dir / stem, res)
        elems.append((config, stem, cfg))
        texts.append(f"[{len(texts)}] {config} -> {sweep_dir / stem}\n{text}")
    log = sbatch.log_pattern(sweep_dir, res.job_name, "-%A_%a.out")
    print("\n".join(texts))
    if ns.dry_run:
        arrays = [(str(sweep_dir / s), str(sweep_dir / s / "slurm/<stamp>/config.yaml")) for _, s, _ in elems]
        print(sbatch.train_script(res, launch, "", "", log, arrays))
        return 0
    need_sbatch()
    live = [j for _, s, _ in elems for j in active_jobs(sweep_dir / s)]
    if live:
        raise Refused(f"{sweep_dir}: job {', '.join(live)} of this sweep is still queued or running")
    (sweep_dir / records.LOGS_DIR).mkdir(parents=True, exist_ok=True)
    arrays, configs = [], []
    for _, stem, cfg in elems:
        _, config_path = job_dir(sweep_dir / stem, cfg)
        configs.append(config_path)
        arrays.append((str(sweep_dir / stem), str(config_path)))
    script_path = write_script(job_dir(sweep_dir)[0], sbatch.train_script(res, launch, "", "", log, arrays))
    job = run_sbatch(script_path)
    for i, (_, stem, _) in enumerate(elems):
        record(
            sweep_dir / stem,
            f"{job}_{i}",
            "train",
            script_path,
            configs[i],
            sbatch.log_file(log, job, i),
            launch,
        )
    print(
        f"submitted job array {job} ({len(elems)} elements)\n  logs:   {sweep_dir / records.LOGS_DIR}\n"
        f"  tensorboard: tensorboard --logdir {shlex.quote(str(sweep_dir))}\n"
        f"  status: python -m launchers.slurm status {shlex.quote(str(sweep_dir))}"
    )
    return 0


def _split(opt: str, text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as e:
        raise Refused(f"{opt}: cannot split {text!r} into arguments ({e})") from None


def _stage(ns, run_dir: Path, kind: str, launch: Launch) -> tuple[Resources, str, str]:
    """``(resources, log pattern, script)`` of the pipeline's preprocessing or evaluation job."""
    stem = Path(ns.config).stem
    if kind == "prep":
        args = _split("--prep", ns.prep)
        if "--output-prefix" not in args:
            raise Refused("--prep: give data_prep.tokenize's arguments, including --output-prefix")
        res = Resources(
            nodes=ns.prep_nodes,
            gpus_per_node=0,
            tasks_per_node=ns.prep_tasks_per_node,
            cpus_per_rank=ns.prep_cpus,
            partition=ns.prep_partition or ns.partition,
            account=ns.account,
            time=ns.prep_time,
            qos=ns.qos,
            job_name=f"lev-prep-{stem}",
            sbatch_args=ns.sbatch_arg,
        )
        log = sbatch.log_pattern(run_dir, res.job_name)
        return res, log, sbatch.prep_script(res, launch, args, log)
    args = _split("--eval", ns.eval)
    if any(a == "--run" or a.startswith("--run=") for a in args):
        raise Refused("--eval: the run directory is the pipeline's own; leave out --run")
    gpus = 1 if ns.gpus_per_node else 0
    res = Resources(
        nodes=1,
        gpus_per_node=gpus,
        tasks_per_node=1,
        cpus_per_rank=ns.eval_cpus or (8 if gpus else 2),
        partition=ns.partition,
        account=ns.account,
        time=ns.eval_time,
        qos=ns.qos,
        constraint=ns.constraint,
        job_name=f"lev-eval-{stem}",
        sbatch_args=ns.sbatch_arg,
    )
    log = sbatch.log_pattern(run_dir, res.job_name)
    return res, log, sbatch.eval_script(res, launch, str(run_dir), args, log)


def cmd_pipeline(ns) -> int:
    """[preprocessing ->] training [-> evaluation], each stage ``--dependency=afterok`` on the one before."""
    if ns.prep is None and ns.eval is None:
        raise Refused("pipeline: give --prep and/or --eval (training alone is `submit`)")
    run_dir = run_dir_of(ns)
    launch = launch_of(ns)
    step_launch = Launch(launch="srun", python=launch.python, workdir=launch.workdir, prologue=launch.prologue)
    prep = _stage(ns, run_dir, "prep", step_launch) if ns.prep else None
    evaluation = _stage(ns, run_dir, "eval", step_launch) if ns.eval is not None else None
    if ns.dry_run:
        if prep:
            print(prep[2])
        submit_train(ns, ns.config, run_dir, need_data=not prep)
        if evaluation:
            print(evaluation[2])
        return 0
    need_sbatch()
    prepared(ns, ns.config, run_dir, resources(ns, "x"), need_data=not prep)  # refuse before anything is queued
    (run_dir / records.LOGS_DIR).mkdir(parents=True, exist_ok=True)
    dependency = None
    if prep:
        path = write_script(job_dir(run_dir)[0], prep[2])
        dependency = run_sbatch(path)
        record(run_dir, dependency, "prep", path, None, sbatch.log_file(prep[1], dependency), step_launch)
        print(f"submitted preprocessing job {dependency}\n  log: {sbatch.log_file(prep[1], dependency)}")
    train_job = submit_train(ns, ns.config, run_dir, dependency=dependency, need_data=not prep)
    if evaluation:
        path = write_script(job_dir(run_dir)[0], evaluation[2])
        job = run_sbatch(path, train_job)
        config = records.read_records(run_dir)[-1].get("config")  # the training job's resolved config
        record(run_dir, job, "eval", path, Path(config) if config else None, sbatch.log_file(evaluation[1], job),
               step_launch)  # fmt: skip
        print(
            f"submitted evaluation job {job} (after training job {train_job} succeeds)\n"
            f"  log: {sbatch.log_file(evaluation[1], job)}\n  report: {run_dir / 'eval'}/<tag>.json"
        )
    return 0


def cmd_status(ns) -> int:
    from launchers import status

    return status.main([ns.run_dir, "--lines", str(ns.lines)] + (["--json"] if ns.json else []))


# ---------------------------------------------------------------- main


def parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    ap = argparse.ArgumentParser(
        prog="python -m launchers.slurm", description=__doc__, epilog=EXAMPLES, formatter_class=fmt
    )
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "submit", help="one training job", description="Submit one training job.", epilog=EXAMPLES, formatter_class=fmt
    )
    add_config(p)
    p.add_argument("--run-dir", help="run directory (default: the config's train.out_dir)")
    add_job_options(p)
    p = sub.add_parser(
        "sweep",
        help="one job array, one config per element",
        formatter_class=fmt,
        description="Submit a job array: element i trains --configs[i] in RUN_DIR/<config name>.",
    )
    add_config(p, many=True)
    p.add_argument("--run-dir", help="sweep directory (default: runs/<common config name prefix>-sweep)")
    add_job_options(p)
    p = sub.add_parser(
        "pipeline",
        help="preprocessing then training (afterok)",
        formatter_class=fmt,
        description="Submit [data_prep.tokenize --mpi as an MPI job ->] training [-> leviathan_pretrain.evaluate], "
        "each job starting only after the one before it succeeded (--dependency=afterok).",
    )
    p.add_argument("--prep", help="data_prep.tokenize arguments, one string (shell quoting); --mpi is added")
    p.add_argument("--prep-nodes", type=int, default=1, help="nodes of the preprocessing job (1)")
    p.add_argument("--prep-tasks-per-node", type=int, default=1, help="MPI ranks per node (1)")
    p.add_argument("--prep-cpus", type=int, default=8, help="CPU cores per MPI rank (8; use --workers to match)")
    p.add_argument("--prep-time", help="time limit of the preprocessing job")
    p.add_argument("--prep-partition", help="partition of the preprocessing job (default: --partition)")
    p.add_argument(
        "--eval",
        help="leviathan_pretrain.evaluate arguments, one string, for an evaluation job after training succeeds "
        "(e.g. \"--wikitext data/wiki.test.raw\"; '' for the defaults)",
    )
    p.add_argument("--eval-time", help="time limit of the evaluation job")
    p.add_argument("--eval-cpus", type=int, help="CPU cores of the evaluation job (8 with a GPU, else 2)")
    add_config(p)
    p.add_argument("--run-dir", help="run directory (default: the config's train.out_dir)")
    add_job_options(p)
    p = sub.add_parser("status", help="state of a run (or a sweep) directory")
    p.add_argument("run_dir", help="a run directory (or a sweep directory)")
    p.add_argument("--lines", type=int, default=20, help="log lines to show (20)")
    p.add_argument("--json", action="store_true", help="one JSON object")
    return ap


def parse(argv=None) -> argparse.Namespace:
    """Parse the command line; ``key=value`` overrides may stand anywhere among the options (as with torchrun's
    script arguments), not only after the last option, which plain ``parse_args`` would require."""
    ap = parser()
    ns, extra = ap.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or "=" not in a or not hasattr(ns, "overrides")]
    if stray:
        ap.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        ns.overrides = [*ns.overrides, *extra]
    if getattr(ns, "configs", None):  # `--configs a.yaml b.yaml key=value`: nargs="+" took the override too
        ns.overrides = [c for c in ns.configs if "=" in c and not os.path.exists(c)] + ns.overrides
        ns.configs = [c for c in ns.configs if not ("=" in c and not os.path.exists(c))]
        if not ns.configs:
            ap.error("--configs: give at least one config file")
    return ns


def main(argv=None) -> int:
    ns = parse(argv)
    handler = {"submit": cmd_submit, "sweep": cmd_sweep, "pipeline": cmd_pipeline, "status": cmd_status}
    try:
        return handler[ns.command](ns)
    except (Refused, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ScriptError as e:  # a path an sbatch script cannot carry
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SbatchFailed as e:
        print(f"error: sbatch refused the job: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
