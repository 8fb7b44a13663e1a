"""model.recompute with tensor and pipeline parallelism and ZeRO 3: the loss and every gradient of no recompute.

- TP = 2 (tests/workers/recompute_tp.py): LEV and TIED, every mode, this rank's shard of every gradient, bit for bit;
- PP = 2 (DeepSpeed's pipeline engine, the first layer of each stage recomputed) and DP = 2 with ZeRO 3 (selective,
  attention and MLP): 20 training steps whose losses and gradient norms are those of the same runs without
  recompute, bit for bit (tests/workers/train_common.py's bundled launches)."""

import json

import pytest

from tests.multiproc import run_ranks
from tests.workers.train_common import dp_tp_runs, pipe_runs, records, workdir

MODES = [
    "model.recompute=selective",
    "model.recompute=selective+model.recompute_modules=[mlp]",
    "model.recompute=full",
    "model.recompute=full+model.recompute_layers=1",
]


@pytest.mark.multiproc
def test_tp2_every_mode_gives_the_loss_and_gradients_of_no_recompute():
    res = run_ranks(["tests/workers/recompute_tp.py", ",".join(MODES)], nprocs=2, timeout=300)
    out = [json.loads(line[7:]) for r in res for line in r.output.splitlines() if line.startswith("RESULT ")]
    assert sorted(o["rank"] for o in out) == [0, 1]
    for per_rank in out:
        cases = {k: v for k, v in per_rank.items() if k != "rank"}
        assert len(cases) == 2 * len(MODES)
        for name, r in cases.items():
            assert r["loss"] == 0.0 and r["grad"] == 0.0 and r["n_grads"] >= 14, (name, r)


def trajectory(name):
    recs = {r["step"]: (r["loss"], r["grad_norm"]) for r in records(name) if "grad_norm" in r}
    return [recs[s] for s in range(1, 21)]


@pytest.mark.multiproc
@pytest.mark.parametrize("name, ref", [("pp2_recompute", "pp2_full"), ("dp2_z3_recompute", "dp2_z3")])
def test_pipeline_and_zero3_runs_with_recompute_follow_those_without(name, ref):
    dp_tp_runs()
    pipe_runs()
    model = json.loads((workdir() / name / "config.json").read_text())["model"]
    assert model["recompute"] == ("full" if name.startswith("pp2") else "selective"), model  # it did recompute
    assert trajectory(name) == trajectory(ref)
