"""``optim.lev_lr_mult``: LEV's own parameters train at lr x the multiplier through DeepSpeed's optimizers (ZeRO 0
and 1), everything else at lr; refused for variants without LEV parameters."""

import json

import pytest

from leviathan_pretrain.config import ConfigError, load_config
from tests.multiproc import run_ranks

pytestmark = pytest.mark.multiproc


def test_lev_parameters_take_the_multiplied_step():
    (res,) = run_ranks(["tests/workers/lr_mult.py"], nprocs=1, timeout=300)
    rows = [json.loads(x[len("RESULT ") :]) for x in res.output.splitlines() if x.startswith("RESULT ")]
    assert [r["zero"] for r in rows] == [0, 1]
    for r in rows:  # Adam's first step moves each element by ~lr (x 10 for LEV's parameters)
        assert len(r["lev"]) == 6 and all(abs(x - 10.0) < 0.05 for x in r["lev"]), r
        assert r["other"] and all(abs(x - 1.0) < 0.02 for x in r["other"]), r


def test_a_multiplier_without_lev_parameters_is_refused():
    with pytest.raises(ConfigError, match="optim.lev_lr_mult.*model.variant=tied has none"):
        load_config("configs/tiny-cpu-tied.yaml", ["optim.lev_lr_mult=3"])
    with pytest.raises(ConfigError, match="optim.lev_lr_mult: must be > 0"):
        load_config("configs/tiny-cpu-lev.yaml", ["optim.lev_lr_mult=0"])
    assert load_config("configs/tiny-cpu-lev.yaml", ["optim.lev_lr_mult=3"]).optim.lev_lr_mult == 3.0
