"""Where a run's files live, in one place: ``RUN/checkpoints``, ``RUN/eval/<tag>.json``, ``RUN/tensorboard``,
``RUN/train_log.jsonl``, ``RUN/config.json`` and the launchers' ``RUN/logs``; ``checkpoint.dir`` and
``logging.tensorboard_dir`` move the first and the third (:meth:`RunLayout.from_config`). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CHECKPOINTS = "checkpoints"
EVAL = "eval"
TENSORBOARD = "tensorboard"
TRAIN_LOG = "train_log.jsonl"
CONFIG = "config.json"  # the resolved config, written by rank 0 at every start
LOGS = "logs"  # the launchers' per-job stdout/stderr
SLURM = "slurm"  # the launchers' job records (launchers/records.py)
RUN_MARKS = (TRAIN_LOG, TENSORBOARD, CHECKPOINTS, EVAL)  # a directory holding one of these is a run


@dataclass(frozen=True)
class RunLayout:
    """The paths of one run. ``checkpoint_dir`` / ``tensorboard_dir``: the config's overrides (None: below
    ``root``); ``tensorboard=False``: the run writes no events."""

    root: Path
    checkpoint_dir: Path | None = None
    tensorboard_dir: Path | None = None
    tensorboard: bool = True

    @classmethod
    def from_config(cls, cfg) -> RunLayout:
        """The layout a :class:`~leviathan_pretrain.config.Config` trains into."""
        return cls(
            root=Path(cfg.train.out_dir),
            checkpoint_dir=Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else None,
            tensorboard_dir=Path(cfg.logging.tensorboard_dir) if cfg.logging.tensorboard_dir else None,
            tensorboard=bool(cfg.logging.tensorboard),
        )

    @property
    def checkpoints(self) -> Path:
        return self.checkpoint_dir or self.root / CHECKPOINTS

    @property
    def events(self) -> Path | None:
        """The TensorBoard event directory (None: TensorBoard off)."""
        return (self.tensorboard_dir or self.root / TENSORBOARD) if self.tensorboard else None

    @property
    def eval_dir(self) -> Path:
        return self.root / EVAL

    def report(self, tag: str) -> Path:
        """The evaluation report of checkpoint ``tag``."""
        return self.eval_dir / f"{tag}.json"

    @property
    def train_log(self) -> Path:
        return self.root / TRAIN_LOG

    @property
    def config(self) -> Path:
        return self.root / CONFIG

    @property
    def logs(self) -> Path:
        return self.root / LOGS


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` holds one of a run's files (:data:`RUN_MARKS`)."""
    return any((Path(path) / m).exists() for m in RUN_MARKS)
