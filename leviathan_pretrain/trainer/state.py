"""What a run needs to continue exactly, besides the weights and optimizer: :class:`TrainState`.

- the global part (step, samples consumed, skipped steps) is one small dict, identical on every rank, written
  into the checkpoint's ``leviathan.json`` and read back from it (``state_dict`` / ``load_state_dict``,
  the torchtitan ``Trainer.state_dict`` convention);
- the per-rank part is the RNG state (python, numpy, torch CPU and CUDA, megatron-core's CUDA tracker), in
  ``rng_rank<R>.pt`` next to DeepSpeed's files (:meth:`TrainState.rng_state_dict`), weights-only loadable:
  tensors and plain numbers only.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import numpy as np
import torch


@dataclass
class TrainState:
    step: int = 0  # optimizer steps (iterations) done, skipped ones included
    consumed_samples: int = 0  # position in the training sample order (sample i is always train[i])
    skipped_steps: int = 0  # non-finite steps skipped so far (they consume no LR step)

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, d: dict) -> None:
        self.step = int(d["step"])
        self.consumed_samples = int(d["consumed_samples"])
        self.skipped_steps = int(d.get("skipped_steps", 0))

    @property
    def lr_step(self) -> int:
        """The learning-rate schedule index of the next step: the updates applied so far."""
        return self.step - self.skipped_steps

    @staticmethod
    def rng_state_dict() -> dict:
        return rng_state()

    @staticmethod
    def load_rng_state_dict(s: dict) -> None:
        set_rng_state(s)


def rng_state() -> dict:
    py = random.getstate()
    np_state = np.random.get_state()
    out = {
        "python_version": py[0],
        "python_state": torch.tensor(py[1], dtype=torch.int64),
        "python_gauss": py[2] if py[2] is not None else float("nan"),
        "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_pos": int(np_state[2]),
        "numpy_has_gauss": int(np_state[3]),
        "numpy_gauss": float(np_state[4]),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
        try:
            from megatron.core import tensor_parallel

            tracker = tensor_parallel.get_cuda_rng_tracker().get_states()
            out["cuda_tracker"] = {k: v for k, v in tracker.items()}
        except Exception:  # no tracker states (CPU-initialised run)
            pass
    return out


def set_rng_state(s: dict) -> None:
    gauss = s["python_gauss"]
    random.setstate(
        (int(s["python_version"]), tuple(int(x) for x in s["python_state"].tolist()), None if gauss != gauss else gauss)
    )
    np.random.set_state(
        (
            "MT19937",
            s["numpy_keys"].numpy().astype(np.uint32),
            int(s["numpy_pos"]),
            int(s["numpy_has_gauss"]),
            float(s["numpy_gauss"]),
        )
    )
    torch.set_rng_state(s["torch"])
    if torch.cuda.is_available() and "cuda" in s:
        torch.cuda.set_rng_state(s["cuda"])
        if s.get("cuda_tracker"):
            from megatron.core import tensor_parallel

            tensor_parallel.get_cuda_rng_tracker().set_states(s["cuda_tracker"])
