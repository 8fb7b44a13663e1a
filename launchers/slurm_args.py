"""The command line of ``launchers.slurm``: its subcommands and options, and parsing with ``key=value``
overrides anywhere among the options."""

from __future__ import annotations

import argparse
import os
import sys

from common import cli
from launchers.sbatch import LAUNCHES

EXAMPLES = """examples:
  python -m launchers.slurm submit --config configs/1.2b-lev.yaml --nodes 16 --gpus-per-node 8 \\
      --partition gpu --time 24:00:00 parallel.tensor_parallel=2 'data.prefixes=[/data/pile_train]' --dry-run
  python -m launchers.slurm sweep --configs configs/200m-{tied,untied,albert,lev}.yaml --nodes 2 --time 12:00:00
  python -m launchers.slurm pipeline --prep "--input 'pile/train/*.jsonl.zst' --tokenizer tok/tokenizer.model \\
      --out data/pile_train" --config configs/400m-lev.yaml --nodes 4 'data.prefixes=[data/pile_train]'
  python -m launchers.slurm status runs/1.2b-lev"""


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


def add_training(ap: argparse.ArgumentParser, run_dir_help: str, many: bool = False) -> None:
    """What a training command takes: the config(s) and overrides, ``--run`` (hidden ``--run-dir``), the job
    options."""
    add_config(ap, many)
    cli.add_run(ap, run_dir_help, dest="run_dir")
    add_job_options(ap)


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    """The parser of ``python -m launchers.slurm``; ``description`` heads its ``--help``."""
    fmt = argparse.RawDescriptionHelpFormatter
    ap = argparse.ArgumentParser(
        prog="python -m launchers.slurm", description=description, epilog=EXAMPLES, formatter_class=fmt
    )
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "submit", help="one training job", description="Submit one training job.", epilog=EXAMPLES, formatter_class=fmt
    )
    add_training(p, "run directory (default: the config's train.out_dir)")
    p = sub.add_parser(
        "sweep",
        help="one job array, one config per element",
        formatter_class=fmt,
        description="Submit a job array: element i trains --configs[i] in RUN_DIR/<config name>.",
    )
    add_training(p, "sweep directory (default: runs/<common config name prefix>-sweep)", many=True)
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
    add_training(p, "run directory (default: the config's train.out_dir)")
    p = sub.add_parser("status", help="state of a run (or a sweep) directory")
    cli.add_run(
        p,
        "the same as RUN_DIR",
        dest="run_dir",
        required=True,
        positional_help="a run directory (or a sweep directory)",
    )
    p.add_argument("--lines", type=int, default=20, help="log lines to show (20)")
    p.add_argument("--json", action="store_true", help="one JSON object")
    return ap


def parse(argv=None, description: str | None = None) -> argparse.Namespace:
    """Parse the command line; ``key=value`` overrides may stand anywhere among the options (as with torchrun's
    script arguments), not only after the last option, which plain ``parse_args`` would require."""
    ap = build_parser(description)
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
