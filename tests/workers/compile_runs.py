"""Worker: training runs through the real trainer (``trainer.loop.run``) with ``model.compile`` off and on, and
what torch.compile did in each.

``python tests/workers/compile_runs.py SPEC.json`` (the format of ``tests/workers/train_runs.py``). Prints per
run ``RESULT {"name", "rank", "code", "graphs", "breaks", "compiled_layers"}``: the graphs dynamo compiled and
its graph breaks (reason: count) during that run (``torch._dynamo.utils.counters``, reset before each run) and
how many of the model's transformer layers had a compiled ``__call__`` (``Module.compile``). A run that raises
reports ``code: null`` with the error, and the launch stops there.
"""

import json
import os
import sys
import warnings

warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed.*")

import torch  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from leviathan_pretrain.parallel.groups import destroy_distributed  # noqa: E402
from leviathan_pretrain.trainer import engine  # noqa: E402
from tests.workers.train_runs import run_spec  # noqa: E402

BUILT: list[torch.nn.Module] = []
_build_module = engine.build_module


def build_module(*args, **kwargs):  # records the model each run builds (the PP = 1 GPT or the PipelineModule)
    out = _build_module(*args, **kwargs)
    BUILT.append(out[0] if isinstance(out, tuple) else out)
    return out


engine.build_module = build_module


def compiled_layers(module: torch.nn.Module) -> int:
    return sum(
        type(m).__name__ == "BlockPiece" and getattr(m.layer, "_compiled_call_impl", None) is not None
        for m in module.modules()
    )


def main(spec_path: str) -> None:

    for spec in json.loads(open(spec_path).read()):
        torch._dynamo.reset()  # each run compiles its own layers (no cached code of an earlier run's model)
        counters.clear()
        BUILT.clear()
        out = run_spec(spec)
        out["graphs"] = int(counters["stats"]["unique_graphs"])
        out["breaks"] = {k[:200]: v for k, v in counters["graph_break"].items()}
        out["compiled_layers"] = compiled_layers(BUILT[0]) if BUILT else None
        print("RESULT " + json.dumps(out), flush=True)
        if out["code"] is None:
            sys.stdout.flush()
            os._exit(1)  # the other ranks may be waiting in a collective: stop the launch instead of hanging it
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
