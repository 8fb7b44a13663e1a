"""Render the sbatch scripts of ``launchers.slurm``: resources, rendezvous, the per-node command, requeue.

Every value that comes from the user (paths, overrides, job names, ``--env`` values, ``#SBATCH`` arguments)
goes through :func:`shlex.quote`; sbatch's own ``#SBATCH`` parser strips the same quotes, so a run directory
or an override holding spaces, quotes, ``$(...)`` or ``;`` reaches the trainer as one literal argument and
runs nothing. Only ``--prologue`` (the user's own shell lines, e.g. ``module load cuda``) is inserted as is.

The script of a training job:

1. ``#SBATCH`` header (nodes, tasks, CPUs, GPUs, partition, account, time, ``--signal=USR1@LEAD``,
   ``--requeue``, ``--open-mode=append``, output ``RUN/logs/<name>-%j.out``);
2. the environment (defaults a cluster user expects, then ``--env`` overrides), the rendezvous on the first
   host of ``scontrol show hostnames "$SLURM_JOB_NODELIST"`` at port ``29500 + (job id + 7919 x restarts) % 20000``
   (one per attempt: a requeued job keeps its id);
3. ``NODE_CMD=(...)``, the command each ``srun`` task runs, and the ``srun`` line;
4. the requeue rule: exit 75 (the trainer stopped with a checkpoint) or 76 (it lost a peer: a dead node, a cut
   network, a stalled rank) -> ``scontrol requeue`` while ``$SLURM_RESTART_COUNT < MAX_REQUEUES``; any other exit
   code is the job's. The training step runs with ``srun --kill-on-bad-exit=1``: one failed task ends the others.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from common.exit_codes import EXIT_BAD_INPUT, EXIT_PEER_LOST, EXIT_REQUEUE
from leviathan_pretrain.rundir.layout import LOGS as LOGS_DIR

REPO = Path(__file__).resolve().parents[1]
LAUNCHES = ("torchrun", "srun", "deepspeed")
# The training step ends when one task fails: srun kills the others at once (a rank that lost its peer exits
# within a second; the rest would otherwise keep the job RUNNING until SLURM declares a dead node DOWN).
STEP_OPTS = "--kill-on-bad-exit=1"


@dataclass
class Resources:
    """What a job asks SLURM for (the ``submit`` options)."""

    nodes: int = 1
    gpus_per_node: int = 8
    tasks_per_node: int | None = None  # training ranks per node; None -> gpus_per_node (CPU jobs: 1)
    cpus_per_rank: int | None = None  # None -> 8 per GPU rank, 1 per CPU rank
    partition: str | None = None
    account: str | None = None
    time: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclusive: bool = False
    mem: str | None = None  # --mem per node (e.g. 0 = all of it)
    mail_user: str | None = None
    mail_type: str = "END,FAIL,REQUEUE"
    job_name: str = "leviathan"
    sbatch_args: list[str] = field(default_factory=list)  # raw extra options, one #SBATCH line each

    @property
    def ranks_per_node(self) -> int:
        return self.tasks_per_node or self.gpus_per_node or 1

    @property
    def cpus(self) -> int:
        return self.cpus_per_rank or (8 if self.gpus_per_node else 1)

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node


@dataclass
class Launch:
    """How the job runs the trainer."""

    launch: str = "torchrun"
    python: str = sys.executable
    workdir: str = "."  # the job's working directory (the submit directory: relative config paths hold)
    env: dict[str, str] = field(default_factory=dict)  # --env KEY=VALUE, after the defaults
    signal_lead: int = 300  # seconds before the time limit at which SLURM sends SIGUSR1
    max_requeues: int = 20
    prologue: str | None = None  # the user's shell lines, inserted as is


class ScriptError(ValueError):
    """A value an sbatch script cannot carry (the message names it)."""


def q(value) -> str:
    return shlex.quote(str(value))


def slurm_pattern(path: str) -> str:
    """Escape ``%`` for SLURM's filename patterns (``--output``): a literal ``%`` is ``%%``."""
    return path.replace("%", "%%")


def log_pattern(run_dir, job_name: str, suffix: str = "-%j.out") -> str:
    """``RUN/logs/<job name><suffix>`` as an sbatch ``--output`` pattern (``%j`` job id, ``%A_%a`` array element)."""
    return slurm_pattern(str(Path(run_dir) / LOGS_DIR / job_name)) + suffix


def log_file(pattern: str, job: str, index: int | None = None) -> str:
    """The file name SLURM makes of :func:`log_pattern` for job ``job`` (array element ``index``)."""
    out = pattern.replace("%j", job).replace("%A", job).replace("%a", str(index))
    return out.replace("%%", "%")


def check_path(path: str, what: str) -> None:
    """Paths must survive both bash and sbatch's ``#SBATCH`` parser, which treats ``\\`` as an escape even
    inside quotes; refuse the few characters neither can carry."""
    bad = [c for c in ("\n", "\r", "\\", "\0") if c in path]
    if bad:
        raise ScriptError(f"{what} {path!r} contains {bad[0]!r}, which an sbatch script cannot carry; rename it")


def header(res: Resources, launch: Launch, output: str, extra: list[str] = ()) -> list[str]:
    per_task = launch.launch == "srun"
    lines = [
        f"--job-name={q(res.job_name)}",
        f"--nodes={res.nodes}",
        f"--ntasks-per-node={res.ranks_per_node if per_task else 1}",
        f"--cpus-per-task={res.cpus * (1 if per_task else res.ranks_per_node)}",
    ]
    if res.gpus_per_node:
        lines.append(f"--gpus-per-node={res.gpus_per_node}")
    for opt, value in (
        ("partition", res.partition),
        ("account", res.account),
        ("time", res.time),
        ("qos", res.qos),
        ("constraint", res.constraint),
        ("mem", res.mem),
        ("mail-user", res.mail_user),
    ):
        if value:
            lines.append(f"--{opt}={q(value)}")
    if res.mail_user:
        lines.append(f"--mail-type={q(res.mail_type)}")
    if res.exclusive:
        lines.append("--exclusive")
    lines += [
        f"--output={q(output)}",
        "--open-mode=append",  # a requeued job appends to the same log
        *extra,
        *(q(a) for a in res.sbatch_args),
    ]
    return [f"#SBATCH {line}" for line in lines]


def default_env(res: Resources) -> dict[str, str]:
    env = {"OMP_NUM_THREADS": str(res.cpus), "PYTHONUNBUFFERED": "1"}
    if res.gpus_per_node:
        env.update(
            TORCH_NCCL_ASYNC_ERROR_HANDLING="1",  # an NCCL error or timeout aborts the rank instead of hanging
            NCCL_DEBUG="WARN",
        )
    return env


def environment(res: Resources, launch: Launch) -> list[str]:
    env = {**default_env(res), **launch.env}
    lines = [f"export {k}={q(v)}" for k, v in env.items()]
    lines += [
        f"export PYTHONPATH={q(str(REPO))}${{PYTHONPATH:+:$PYTHONPATH}}",
        'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        # per attempt: a requeued job keeps its id, and a process left from the last attempt on a node that comes
        # back (a healed network partition) must not join this attempt's rendezvous
        "export MASTER_PORT=$((29500 + (SLURM_JOB_ID + 7919 * ${SLURM_RESTART_COUNT:-0}) % 20000))",
    ]
    return lines


def node_command(res: Resources, launch: Launch, config: str) -> tuple[list[str], str]:
    """``(NODE_CMD, srun line)``: the per-task command (bash array items, already quoted; ``$VAR``
    references are expanded by the job's shell) and how ``srun`` runs it."""
    py = q(launch.python)
    train = ["-m", "leviathan_pretrain.train", "--config", q(config)]
    if launch.launch == "srun":  # one task per rank; the trainer reads SLURM_PROCID / SLURM_NTASKS
        cmd = [py, *train]
        srun = f'srun {STEP_OPTS} --nodes={res.nodes} --ntasks-per-node={res.ranks_per_node} "${{NODE_CMD[@]}}"'
    elif launch.launch == "torchrun":  # one task per node running torchrun (see launchers/torchrun_node.py)
        cmd = [
            py,
            "-m",
            "launchers.torchrun_node",
            '--nnodes="$SLURM_JOB_NUM_NODES"',
            f"--nproc-per-node={res.ranks_per_node}",
            "--rdzv-backend=c10d",
            '--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"',
            '--rdzv-id="$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}"',
            "--max-restarts=0",
            *train,
        ]
        srun = f'srun {STEP_OPTS} --nodes={res.nodes} --ntasks-per-node=1 "${{NODE_CMD[@]}}"'
    elif launch.launch == "deepspeed":  # DeepSpeed's runner in the batch shell; it starts `srun -n WORLD`
        srun_args = f"{STEP_OPTS} --ntasks-per-node={res.ranks_per_node} --cpus-per-task={res.cpus}"
        cmd = [
            py,
            "-m",
            "deepspeed.launcher.runner",
            '--hostfile="$HOSTFILE"',
            "--launcher=slurm",
            f"--launcher_args={q(srun_args)}",
            "--force_multi",  # ranks in an srun step even on one node: SLURM's warning signal reaches them
            "--no_ssh_check",
            f"--num_nodes={res.nodes}",
            f"--num_gpus={res.gpus_per_node}",
            '--master_addr="$MASTER_ADDR"',
            '--master_port="$MASTER_PORT"',
            q(str(REPO / "leviathan_pretrain" / "train.py")),  # its slurm runner has no --module
            "--config",
            q(config),
        ]
        srun = '"${NODE_CMD[@]}"'
    else:
        raise ScriptError(f"--launch: unknown {launch.launch!r}; choose one of {', '.join(LAUNCHES)}")
    return cmd, srun


HOSTFILE = [
    'HOSTFILE="$RUN_DIR/slurm/hostfile-$SLURM_JOB_ID"',
    'scontrol show hostnames "$SLURM_JOB_NODELIST" | sed "s/$/ slots=$RANKS_PER_NODE/" > "$HOSTFILE"',
]

REQUEUE = """\
rc=$?
restarts=${SLURM_RESTART_COUNT:-0}
# From here on no command substitution: a SIGTERM arriving inside one (SLURM ends a job whose node failed)
# breaks bash's trap ("unexpected EOF while looking for matching `)'") and the lines after it.
TZ=UTC0 printf -v now '%(%FT%TZ)T' -1
if [ "$rc" != @REQUEUE@ ] && [ "$rc" != @PEER_LOST@ ] && [ -n "${LEV_STEP_CODES:-}" ]; then
  # srun reports its tasks' highest code: a rank that lost its peer (76) is hidden by the stalled peer that srun
  # SIGKILLed after it (137). The ranks that exit 75 or 76 say so in $LEV_STEP_CODES first (common/exit_codes.py).
  said=""
  for f in "$LEV_STEP_CODES"/rank-*; do
    [ -f "$f" ] || continue
    read -r c < "$f" || continue
    if [ "$c" = @PEER_LOST@ ] || { [ "$c" = @REQUEUE@ ] && [ -z "$said" ]; }; then said=$c; fi
  done
  if [ -n "$said" ]; then
    echo "[launch] $now srun reported code $rc, but a rank exited $said before it (its file in" \
         "$LEV_STEP_CODES): the step's code is $said"
    rc=$said
  fi
fi
case "$rc" in
  @REQUEUE@) why="stopped with a checkpoint (exit @REQUEUE@)" ;;
  @PEER_LOST@) why="lost a peer (exit @PEER_LOST@: a node died, the network was cut or a rank stalled; the line \
'[rank N on HOST] lost a peer' above names it)" ;;
  *) why="" ;;
esac
if [ -n "$why" ]; then
  if [ "$restarts" -lt "$MAX_REQUEUES" ]; then
    echo "[launch] $now $why: requeueing job $SLURM_JOB_ID (requeue $((restarts + 1)) of at most $MAX_REQUEUES);" \
         "it resumes from the latest complete checkpoint"
    if scontrol requeue "$SLURM_JOB_ID"; then exit 0; fi  # SLURM ends this run and queues the job again
    if [ "$term" = 1 ]; then
      echo "[launch] SLURM is ending this job itself (a node failure: it requeues the job, --requeue)"
    else
      echo "[launch] scontrol requeue failed: resubmit the same command to resume from the checkpoint"
    fi
  else
    echo "[launch] $now $why, but this job was already requeued $restarts times (--max-requeues" \
         "$MAX_REQUEUES): not requeueing; resubmit the same command to resume"
  fi
  exit "$rc"
fi
if [ "$rc" -eq 0 ]; then
  echo "[launch] $now training exited with code 0"
elif [ "$term" = 1 ]; then
  echo "[launch] $now training exited with code $rc after SLURM ended the job (a node failure: SLURM requeues" \
       "it itself, --requeue; scancel: it stays ended)"
else
  echo "[launch] $now training exited with code $rc (not requeued)"
fi
exit "$rc"
""".replace("@REQUEUE@", str(EXIT_REQUEUE)).replace("@PEER_LOST@", str(EXIT_PEER_LOST))


def train_script(
    res: Resources, launch: Launch, run_dir: str, config: str, output: str, arrays: list[tuple[str, str]] = ()
) -> str:
    """The sbatch script of a training job (``arrays``: ``[(run_dir, config), ...]`` for a job array, one per
    ``$SLURM_ARRAY_TASK_ID``; then ``run_dir``/``config`` are unused)."""
    for path, what in ((run_dir, "the run directory"), (config, "the config path"), (output, "the log path")):
        check_path(path, what)
    extra = [f"--signal=USR1@{launch.signal_lead}", "--requeue"]
    if arrays:
        extra.insert(0, f"--array=0-{len(arrays) - 1}")
    cmd, srun = node_command(res, launch, "$CONFIG")
    cmd = [c if c != q("$CONFIG") else '"$CONFIG"' for c in cmd]
    lines = [
        "#!/bin/bash",
        f"# Written by `python -m launchers.slurm` (Leviathan-pretrain) at {datetime.now(timezone.utc):%FT%TZ}.",
        "# Resubmitting it is safe: the trainer resumes from the run directory's latest checkpoint.",
        *header(res, launch, output, extra),
        "",
        "set -uo pipefail",
    ]
    if arrays:
        lines.append('case "$SLURM_ARRAY_TASK_ID" in')
        for i, (rd, cf) in enumerate(arrays):
            check_path(rd, "the run directory")
            lines.append(f"  {i}) RUN_DIR={q(rd)}; CONFIG={q(cf)} ;;")
        lines += [f'  *) echo "[launch] no array element $SLURM_ARRAY_TASK_ID" >&2; exit {EXIT_BAD_INPUT} ;;', "esac"]
    else:
        lines += [f"RUN_DIR={q(run_dir)}", f"CONFIG={q(config)}"]
    lines += [
        f"MAX_REQUEUES={launch.max_requeues}",
        f"RANKS_PER_NODE={res.ranks_per_node}",
        f"cd {q(launch.workdir)} || exit {EXIT_BAD_INPUT}",
        *environment(res, launch),
    ]
    if launch.prologue:
        lines += ["# --prologue (as given)", launch.prologue.rstrip("\n")]
    if launch.launch == "deepspeed":
        lines += HOSTFILE
    lines += [
        # The batch shell outlives the ranks: SIGTERM (preemption, scancel) and a stray SIGUSR1 wait for srun,
        # whose ranks checkpoint and exit 75; the requeue rule below then runs.
        "term=0",
        "trap 'term=1; echo \"[launch] batch shell got SIGTERM: waiting for the ranks to checkpoint\"' TERM",
        "trap 'echo \"[launch] batch shell got SIGUSR1\"' USR1",
        'echo "[launch] $(date -u +%FT%TZ) job $SLURM_JOB_ID attempt $((${SLURM_RESTART_COUNT:-0} + 1)):'
        ' $SLURM_JOB_NUM_NODES node(s) $SLURM_JOB_NODELIST, rendezvous $MASTER_ADDR:$MASTER_PORT, run $RUN_DIR"',
        f"NODE_CMD=({' '.join(cmd)})",
        # the codes the ranks chose (75, 76), read after the step by the requeue rule (common/exit_codes.py)
        'export LEV_STEP_CODES="$RUN_DIR/slurm/step-codes/$SLURM_JOB_ID.${SLURM_RESTART_COUNT:-0}"',
        'mkdir -p "$LEV_STEP_CODES"',
        srun,
        REQUEUE,
    ]
    return "\n".join(lines)


def step_script(res: Resources, launch: Launch, module_args: list[str], output: str, what: str, mpi: bool) -> str:
    """The sbatch script of a one-command job: ``python -m MODULE ARGS`` on every task (``mpi``: an MPI job
    through ``srun --mpi=pmix``). ``what`` names the job in its log lines."""
    check_path(output, "the log path")
    cmd = [q(launch.python), "-m", *(q(a) for a in module_args)]
    lines = [
        "#!/bin/bash",
        f"# Written by `python -m launchers.slurm pipeline` at {datetime.now(timezone.utc):%FT%TZ}.",
        *header(res, launch, output),
        "",
        "set -uo pipefail",
        f"cd {q(launch.workdir)} || exit {EXIT_BAD_INPUT}",
        *[line for line in environment(res, launch) if "MASTER_" not in line],
    ]
    if launch.prologue:
        lines += ["# --prologue (as given)", launch.prologue.rstrip("\n")]
    mpi_opt = " --mpi=pmix" if mpi else ""
    lines += [
        f'echo "[launch] $(date -u +%FT%TZ) {what} job $SLURM_JOB_ID on $SLURM_JOB_NUM_NODES node(s)"',
        f"NODE_CMD=({' '.join(cmd)})",
        f'srun{mpi_opt} --nodes={res.nodes} --ntasks-per-node={res.ranks_per_node} "${{NODE_CMD[@]}}"',
        "rc=$?",
        f'echo "[launch] $(date -u +%FT%TZ) {what} exited with code $rc"',
        'exit "$rc"',
        "",
    ]
    return "\n".join(lines)


def prep_script(res: Resources, launch: Launch, tokenize_args: list[str], output: str) -> str:
    """The sbatch script of a preprocessing job: ``data_prep.tokenize --mpi`` on every task (one merged output)."""
    return step_script(res, launch, ["data_prep.tokenize", "--mpi", *tokenize_args], output, "preprocessing", True)


def eval_script(res: Resources, launch: Launch, run_dir: str, eval_args: list[str], output: str) -> str:
    """The sbatch script of an evaluation job: ``leviathan_pretrain.evaluate --run RUN_DIR ARGS`` (one task; more
    tasks evaluate data-parallel)."""
    check_path(run_dir, "the run directory")
    args = ["leviathan_pretrain.evaluate", "--run", run_dir, *eval_args]
    return step_script(res, launch, args, output, "evaluation", False)
