"""TP = 2 equals TP = 1 for every variant: logits, per-token loss and every gradient (gathered), to 1e-5.

One 2-rank gloo launch (tests/workers/model_tp.py) builds every variant twice from the same seed: first
with the two processes as TP = 1 (DP = 2) replicas, then with the same process group re-split as TP = 2."""

import json

import pytest

from leviathan_pretrain.config import VARIANTS
from tests.multiproc import run_ranks

# + LEV with model.lev.center and out_init_std=match (ours), and LEV by the Triton kernels (model.lev.kernel=triton)
CASES = [*VARIANTS, "lev_center_match", "lev_triton"]


@pytest.fixture(scope="module")
def tp_results():
    env = {"TRITON_INTERPRET": "1"}  # lev_triton's kernels run on the CPU under Triton's interpreter
    res = run_ranks(["tests/workers/model_tp.py", ",".join(CASES)], nprocs=2, timeout=300, env=env)
    out = [
        json.loads(line[len("RESULT ") :]) for r in res for line in r.output.splitlines() if line.startswith("RESULT ")
    ]
    assert sorted(o["rank"] for o in out) == [0, 1]
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("variant", CASES)
def test_tp2_equals_tp1(tp_results, variant):
    for per_rank in tp_results:
        r = per_rank[variant]
        assert r["logits"] < 1e-5, r
        assert r["loss"] < 1e-5, r
        assert r["grad"] < 1e-5, r
        assert r["grad_scale"] > 1e-3  # the gradients compared are not all zero
        assert r["n_params"] >= 14


@pytest.mark.multiproc
def test_tp_attributes_on_self_sharded_parameters(tp_results):
    attrs = tp_results[0]["lev"]["tp_attrs"]
    assert all(attrs[n] for n in ("proj", "ln_weight", "ln_bias", "spline_delta", "out_proj"))
    assert attrs["codebooks.weight"] is False  # replicated: full gradient, counted once
    assert tp_results[0]["lev"]["full_params"] == 0.0  # full_parameters() gathers the shards back exactly
    for v in ("flat_mlp", "factored_mlp"):
        a = tp_results[0][v]["tp_attrs"]
        assert a["fc1"] and a["fc2"]
    assert not tp_results[0]["factored_mlp"]["tp_attrs"]["ln_weight"]  # replicated
    assert "ln_weight" not in tp_results[0]["flat_mlp"]["tp_attrs"]  # no LayerNorm on a 1-5 wide row
    assert tp_results[0]["albert"]["tp_attrs"] == {"proj": False, "table.weight": True}
