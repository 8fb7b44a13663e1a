"""Config errors end with the fix: an unknown key gets a "did you mean", the error names where the
key came from (the file, or ``command line (key=value)``), and TP larger than the world names the launcher
command. All in-process (fast tier)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from leviathan_pretrain.config import ConfigError, ParallelConfig, load_config
from leviathan_pretrain.config.loader import suggest

CONFIG = "configs/tiny-cpu-lev.yaml"


def message(path, overrides) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value)


def test_unknown_override_key_is_named_as_command_line_with_a_suggestion():
    msg = message(CONFIG, ["model.vocab_szie=1000"])
    assert msg.startswith(
        "command line (model.vocab_szie=1000): unknown config key model.vocab_szie "
        "(did you mean model.vocab_size?); valid keys in model: "
    )
    assert "vocab_size" in msg.split("valid keys in model: ")[1] and "\n" not in msg


@pytest.mark.parametrize(
    "override, hint",
    [
        ("train.keep_last=3", "checkpoint.keep_last"),  # the same name in another section
        ("modle.hidden_size=64", "model"),  # a misspelt section
        ("model.lev.hedas=4", "model.lev.heads"),  # a nested section
    ],
)
def test_did_you_mean(override, hint):
    key = override.split("=")[0] if "modle" not in override else "modle"
    assert f"unknown config key {key} (did you mean {hint}?)" in message(CONFIG, [override])


def test_no_suggestion_for_a_name_like_none():
    assert suggest("model.zzzzqqq", ["hidden_size", "vocab_size"], ["model.hidden_size"]) == []


def test_bad_value_on_the_command_line_is_named_as_command_line():
    assert message(CONFIG, ["optim.lr=abc"]) == "command line (optim.lr=abc): optim.lr: expected a number, got 'abc'"
    # a section set whole on the command line owns the keys below it
    assert message(CONFIG, ["model={vocab_szie: 3}"]).startswith("command line (model={vocab_szie: 3}): ")
    # the last override of a key is the one named
    assert message(CONFIG, ["optim.lr=1", "optim.lr=abc"]).startswith("command line (optim.lr=abc): ")


def test_errors_from_the_file_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"base: {Path(CONFIG).absolute()}\ntrain:\n  keep_last: 2\noptim:\n  lr: abc\n")
    msg = message(bad, ["optim.lr=0.001"])  # the override fixes lr; keep_last is the file's
    assert msg.startswith(f"{bad}: unknown config key train.keep_last (did you mean checkpoint.keep_last?)")
    assert message(bad, ["model.vocab_size=1000"]).startswith(f"{bad}: ")  # an unrelated override


def test_tp_larger_than_one_process_names_the_launcher_command(monkeypatch):
    from leviathan_pretrain.parallel.groups import init_distributed, launch_hint

    monkeypatch.setattr(sys, "orig_argv", ["python", "-m", "leviathan_pretrain.train", "--config", CONFIG, "x=1"])
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError) as info:
        init_distributed(ParallelConfig(tensor_parallel=2))
    assert str(info.value) == (
        "parallel: world size 1 is not divisible by tensor_parallel x pipeline_parallel = 2 x 1; run 2 ranks: "
        f"python launchers/local.py -n 2 -- -m leviathan_pretrain.train --config {CONFIG} x=1"
    )
    assert launch_hint(2, 4) == "launch a multiple of 4 ranks, e.g. 4"
    assert launch_hint(1, 2, ["-c", "pass"]).endswith("-- -m leviathan_pretrain.train --config FILE key=value...")
