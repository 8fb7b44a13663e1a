"""Faults: non-finite steps, preemption signals, and the exit codes a launcher acts on.

Exit codes of ``python -m leviathan_pretrain.train`` (defined in :mod:`common.exit_codes`): ``0``
finished ``train.steps`` (final checkpoint written); ``1`` any other error, raised on one rank, it ends every rank
at once (:func:`abort_rank`); ``2`` bad config or data (one line naming the key or file; a token id outside the
vocabulary); ``3`` diverged (``train.max_bad_steps``); ``75`` stopped early with a checkpoint (re-run to continue);
``76`` lost a peer (a rank's connection closed or a collective timed out; re-run to continue).

Non-finite steps: a step whose loss or gradient norm is NaN/Inf is skipped (no parameter update, LR
schedule not advanced) and counted. DeepSpeed's optimizers detect it themselves (fp16 loss-scale overflow,
ZeRO 1-3 and bf16 gradient checks); ZeRO stage 0 in fp32 uses :class:`AdamWSkipNonFinite` for the same. When a run
of them (or a loss spike) stops the run: :mod:`.guard`.
"""

from __future__ import annotations

import math
import os
import re
import signal
import sys
import time
import traceback

import torch
import torch.distributed as dist

from common.exit_codes import EXIT_BAD_INPUT as EXIT_CONFIG
from common.exit_codes import EXIT_PEER_LOST, record_step_code
from leviathan_pretrain.config import TrainConfig
from leviathan_pretrain.model.inputs import TokenIdError
from leviathan_pretrain.trainer import peers


class Diverged(RuntimeError):
    """The divergence guard stopped the run (trainer/guard.py): non-finite steps, a loss or gradient-norm spike."""


class StopSignals:
    """SIGTERM / SIGUSR1 set a flag; the loop finishes the step, agrees across ranks, checkpoints, exits 75."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.received: int | None = None
        self._old = {}

    def install(self) -> "StopSignals":
        for s in self.SIGNALS:
            self._old[s] = signal.signal(s, self._handler)
        return self

    def _handler(self, signum, frame):
        self.received = signum

    def uninstall(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old.clear()

    def settle(self) -> None:
        """The run is over and its exit code decided: from now on these signals are ignored. A SIGTERM now is
        ``srun --kill-on-bad-exit=1`` ending the step because another rank exited first (a 75 too); with the
        default action back it would turn this exit into "Terminated" (143), which srun reports instead of 75."""
        for s in self.SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        self._old.clear()


def stop_requested(
    t: TrainConfig, signals: StopSignals, step: int, t0: float, device, lock_lost: bool = False
) -> str | None:
    """Collective: why to stop now (the run lock lost on rank 0: ``"lock lost"``; a signal on any rank,
    ``train.exit_at_step``, ``train.exit_after_minutes`` on any rank), or None. Every rank gets the same answer."""
    timed_out = t.exit_after_minutes is not None and time.monotonic() - t0 > 60 * t.exit_after_minutes
    flags = torch.tensor(
        [1.0 if signals.received is not None else 0.0, 1.0 if timed_out else 0.0, 1.0 if lock_lost else 0.0],
        device=device,
    )
    if dist.get_world_size() > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if flags[2] > 0:
        return "lock lost"
    if flags[0] > 0:
        return "signal"
    if t.exit_at_step is not None and step >= t.exit_at_step:
        return "exit_at_step"
    if flags[1] > 0:
        return "exit_after_minutes"
    return None


PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote worker crashed")
TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)
COMMS = ("gloo", "c10d", "NCCL", "nccl", "TCPStore", "store")


def lost_peer(e: BaseException) -> str | None:
    """``"closed"`` (a peer's connection closed: its process or node died), ``"timeout"`` (a collective or the
    store timed out: a stalled rank or a cut network) or None (not a communication failure)."""
    text = str(e)
    comms = isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and any(c in text for c in COMMS))
    if isinstance(e, RuntimeError) and any(p in text for p in PEER_LOST):
        return "closed"
    if comms and TIMED_OUT.search(text):
        return "timeout"
    return None


def abort_rank(e: BaseException) -> None:
    """End this process now after an error raised on this rank alone (not by every rank together).

    The other ranks may be waiting for us in a collective; tearing down politely (a barrier, interpreter
    shutdown joining communication threads) would hang until the process-group timeout. So: print the error
    once and ``os._exit``. gloo peers see the connection drop within a second and end the same way; with NCCL the
    launcher ends them (torchrun, ``srun --kill-on-bad-exit=1``, mpirun all stop the job when one rank exits
    non-zero). A lost peer (:func:`lost_peer`) is said in one line naming the ranks and hosts behind it
    (:mod:`.peers`); a timed-out collective exits 76 (``EXIT_PEER_LOST``: the SLURM launcher requeues), a closed
    connection 1 (the peer's own exit code tells why it left). A bad token id exits 2, Ctrl-C 130, anything else 1
    with its traceback, then one line (a checkpoint file not written: the file, the cause, what to do, whole)."""
    from leviathan_pretrain.trainer.checkpoint.errors import CheckpointSaveError
    from leviathan_pretrain.trainer.checkpoint.run_lock import release_held

    release_held()  # this process writes nothing more: the run directory is free for the next start
    rank = os.environ.get("RANK", "0")
    msg = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
    kind = lost_peer(e)
    if isinstance(e, KeyboardInterrupt):
        code = 130
        print(f"[rank {rank}] interrupted", file=sys.stderr, flush=True)
    elif kind is not None:
        # A closed connection: the peer's process is gone, and its own exit code says why (a bad token id: 2, a
        # crash: 1, the OOM killer: 137); this rank exits 1 so that a launcher reporting the highest code (srun)
        # reports the peer's. A timeout (nothing says why): 76, the launcher requeues.
        code = EXIT_PEER_LOST if kind == "timeout" else 1
        found = peers.CURRENT
        where = f"[rank {rank} on {found.host}]" if found else f"[rank {rank}]"
        what = "a peer's connection closed" if kind == "closed" else "a collective timed out"
        why = found.diagnose(str(e)) if found else "set-up had not finished: no peer table"
        step = f" in step {found.last_step}" if found else ""
        then = (
            "its own error, if it had one, is in its output; re-run: it resumes from the latest complete checkpoint"
            if kind == "closed"
            else "no checkpoint was written after this, the run resumes from the latest complete one"
        )
        said = re.sub(r"^\[[^\]]*:\d+\]\s*", "", msg).split(". ")[0]  # gloo's source location and advice dropped
        line = f"{where} lost a peer{step}: {what}: {why}. Exiting {code}; {then}. ({said})"
        print(line, file=sys.stderr, flush=True)
    elif isinstance(e, TokenIdError):
        code = EXIT_CONFIG
        print(f"[rank {rank}] error: {e}", file=sys.stderr, flush=True)
    elif isinstance(e, CheckpointSaveError):  # the traceback is the log; the line names the file and what to do
        code = 1
        traceback.print_exception(e, file=sys.stderr)
        print(f"[rank {rank}] error: {e}", file=sys.stderr, flush=True)
    else:
        code = 1
        traceback.print_exception(e, file=sys.stderr)
        print(f"[rank {rank}] error: {type(e).__name__}: {msg}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    record_step_code(code)  # 76: the SLURM job script requeues even if srun reports a peer's SIGKILL (137)
    os._exit(code)


class AdamWSkipNonFinite(torch.optim.AdamW):
    """AdamW that measures the global gradient norm itself, skips the update when it is not finite
    (``overflow`` is read by DeepSpeed, which then counts the step as skipped), and clips otherwise.

    For ZeRO stage 0 in fp32, where DeepSpeed hands the gradients straight to the optimizer. The norm is
    summed over megatron-core's model-parallel group (TP x PP), counting tensor-parallel shards once per
    rank and replicated parameters once (``param_is_not_tensor_parallel_duplicate``), and pipeline-tied
    copies (``ds_pipe_replicated``) once."""

    def __init__(self, params, clip_grad: float = 0.0, **kw):
        super().__init__(params, **kw)
        self.clip_grad = clip_grad
        self.overflow = False
        self._global_grad_norm = None

    @torch.no_grad()
    def grad_norm(self) -> float:
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        parallel = ps.model_parallel_is_initialized()
        grads = [
            p.grad
            for g in self.param_groups
            for p in g["params"]
            if p.grad is not None
            and not getattr(p, "ds_pipe_replicated", False)
            and (not parallel or param_is_not_tensor_parallel_duplicate(p))
        ]
        dev = grads[0].device if grads else torch.device("cpu")
        sq = torch.zeros(1, dtype=torch.float64, device=dev)
        for grad in grads:
            sq += grad.detach().double().pow(2).sum()
        if parallel and dist.is_initialized():
            dist.all_reduce(sq, group=ps.get_model_parallel_group())
        return float(sq.sqrt().item())

    def step(self, closure=None):
        norm = self.grad_norm()
        self._global_grad_norm = norm
        self.overflow = not math.isfinite(norm)
        if self.overflow:
            self.zero_grad(set_to_none=True)
            return None
        if self.clip_grad > 0 and norm > self.clip_grad:
            scale = self.clip_grad / (norm + 1e-6)
            for g in self.param_groups:
                for p in g["params"]:
                    if p.grad is not None:
                        p.grad.mul_(scale)
        return super().step(closure)
