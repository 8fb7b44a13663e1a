"""Train a Leviathan (or baseline) GPT: ``python -m leviathan_pretrain.train --config FILE [key=value ...]``.

Run it under any launcher that sets the usual rank variables (``torchrun``, ``deepspeed``, ``srun``,
``mpirun``, ``launchers/local.py``) or as one plain process. Re-running the same command continues from
``<checkpoint.dir>/latest`` (docs/training.md, "What protects a run's checkpoints"). Exit codes: 0 done, 2 bad
config/data or a run directory held by another trainer, 3 diverged (non-finite steps or a loss spike), 75 stopped
early with a checkpoint (signal, ``train.exit_at_step``, ``train.exit_after_minutes``): re-run to continue; 76 lost
a peer rank (re-run to resume from the latest checkpoint). See the README section "Training".
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from common.exit_codes import EXIT_BAD_INPUT, EXIT_DIVERGED, record_step_code
from leviathan_pretrain.config import ConfigError, config_arguments, load_config_or_report  # light: no torch

EPILOG = """examples:
  python -m leviathan_pretrain.train --config configs/tiny-cpu-lev.yaml
  python launchers/local.py -n 2 -- -m leviathan_pretrain.train --config configs/tiny-cpu-lev.yaml \\
      parallel.tensor_parallel=2 train.steps=200
  torchrun --nproc_per_node 8 -m leviathan_pretrain.train --config configs/400m-lev.yaml \\
      parallel.zero_stage=2 data.prefixes=[/data/pile_train_text_document]

exit codes: 0 finished; 2 bad config or data (a token id outside the vocabulary too), the run directory in use
            by another trainer (the line names it), an unusable checkpoint (the line names the file); 3 diverged
            (train.max_bad_steps consecutive NaN/Inf steps, a loss spike: train.spike_*; latest names the last good
            checkpoint); 75 stopped early with a checkpoint (SIGTERM/SIGUSR1,
            train.exit_at_step, train.exit_after_minutes): run the same command again to continue (also on
            another number of nodes: the data-parallel size may change); 76 lost a peer (a rank's connection
            closed, or a collective timed out after parallel.timeout_minutes: a dead node, a cut network, a
            stalled rank; the line names the rank and host): run again to resume from the latest checkpoint;
            1 any other error (one rank's error ends every rank at once, no hang until the collective timeout)"""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m leviathan_pretrain.train",
        description=__doc__.split("\n")[0],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    config_arguments(ap)
    # The `deepspeed` launcher appends --local_rank=N (LOCAL_RANK is in the environment as well).
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    cfg = load_config_or_report(args.config, args.overrides)
    if cfg is None:
        return EXIT_BAD_INPUT
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed.*")
    cuda = _has_cuda() and cfg.parallel.device != "cpu"
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if cuda else "cpu")
    if cuda and cfg.parallel.tensor_parallel > 1:
        # megatron-core's tensor-parallel layers overlap their all-reduce with compute only in this mode
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    else:
        warnings.filterwarnings("ignore", message=r".*CUDA_DEVICE_MAX_CONNECTIONS.*")
    # Imported only now (measured ~6 s: torch, megatron-core, DeepSpeed): --help and config errors answer at
    # once, and DS_ACCELERATOR / CUDA_DEVICE_MAX_CONNECTIONS must be set before DeepSpeed and megatron load.
    from leviathan_pretrain.data.datasets import ShardError
    from leviathan_pretrain.parallel.groups import destroy_distributed
    from leviathan_pretrain.trainer.checkpoint.names import CheckpointError
    from leviathan_pretrain.trainer.faults import Diverged, abort_rank
    from leviathan_pretrain.trainer.loop import run

    code = None
    try:
        code = run(cfg)  # SIGTERM and SIGUSR1 are ignored from its end on (StopSignals.settle)
    except (ConfigError, ShardError, CheckpointError) as e:  # the start-up checks raise these on every rank
        _error(e)
        code = EXIT_BAD_INPUT
    except Diverged as e:  # the loss is global: every rank stops together
        _error(e)
        code = EXIT_DIVERGED
    except BaseException as e:  # noqa: BLE001 - one rank alone (bad token id, a bug, a lost peer): never wait
        abort_rank(e)  # in a collective for ranks that are gone; exits this process at once
    finally:
        if code is not None:
            destroy_distributed(barrier=False)  # no barrier: a rank that did not raise must not hold us
    record_step_code(code)  # 75: for the SLURM job script (common/exit_codes.py)
    return code


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def _error(e: Exception) -> None:
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if rank == 0 or world <= 8:
        prefix = f"[rank {rank}] " if world > 1 else ""
        print(f"{prefix}error: {e}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
