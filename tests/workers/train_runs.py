"""Worker: several training runs in one launch (each process pays its ~5-8 s of imports once).

``python tests/workers/train_runs.py SPEC.json`` where SPEC is ``[{"name": ..., "config": path|null,
"overrides": [...], "nan_steps": [...], "nan_rank": int|null, "spike_steps": [...], "spike_factor": x}, ...]``
(``nan_*``: test-only NaN losses; ``spike_*``: losses times ``spike_factor`` instead, :mod:`tests.workers.inject`).
Runs them in order through ``leviathan_pretrain.trainer.loop.run`` (the code behind
``python -m leviathan_pretrain.train``), printing ``RESULT {"name", "rank", "code"}`` per run;
a run that raises records the error type and message instead; the launch goes on after the errors every
rank raises alike (config, shard, checkpoint errors, a divergence) and stops after any other (ranks may be out of
step).
"""

import json
import os
import sys
import traceback
import warnings

warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed.*")

from leviathan_pretrain.config import load_config  # noqa: E402
from leviathan_pretrain.parallel.groups import destroy_distributed  # noqa: E402
from leviathan_pretrain.trainer.loop import run  # noqa: E402
from tests.workers.inject import nan_loss  # noqa: E402


def run_spec(spec: dict) -> dict:
    """One spec's training through ``trainer.loop.run``: ``{"name", "code", "rank"}``, or ``code`` None with the
    error's type and message (the traceback on stderr). Also serves tests/workers/compile_runs.py."""
    import torch.distributed as dist

    cfg = load_config(spec.get("config"), spec.get("overrides", []))
    out = {"name": spec["name"]}
    try:
        out["code"] = run(cfg)
    except Exception as e:  # noqa: BLE001 -- reported to the test, which decides
        out.update(code=None, error=type(e).__name__, message=str(e))
        traceback.print_exc()
    out["rank"] = dist.get_rank() if dist.is_initialized() else 0
    return out


def main(spec_path: str) -> None:
    specs = json.loads(open(spec_path).read())
    for spec in specs:
        if spec.get("spike_steps"):
            nan_loss(spec["spike_steps"], spec.get("nan_rank"), factor=float(spec.get("spike_factor", 10)))
        else:
            nan_loss(spec.get("nan_steps", ()), spec.get("nan_rank"))
        out = run_spec(spec)
        print("RESULT " + json.dumps(out), flush=True)
        if out["code"] is None and out["error"] not in ("ConfigError", "ShardError", "CheckpointError", "Diverged"):
            # the other ranks may be waiting in a collective: stop this launch instead of hanging it
            sys.stdout.flush()
            os._exit(1)
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
