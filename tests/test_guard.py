"""The divergence guard (trainer/guard.py): healthy steps, the non-finite run, the loss- and grad-norm-spike rules,
the unhealthy data window; the guard's config keys and the rule that no float key takes inf or nan."""

from __future__ import annotations

import dataclasses
import math
import typing
from pathlib import Path

import pytest

from leviathan_pretrain.config import Config, ConfigError, load_config
from leviathan_pretrain.trainer.guard import Guard

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu-lev.yaml"
NAN, INF = float("nan"), float("inf")


def guard(*over: str) -> Guard:
    base = ["train.max_bad_steps=3", "train.spike_window=4", "train.spike_patience=3"]
    return Guard(load_config(CONFIG, [*base, *over]).train)


def feed(g: Guard, steps, start: int = 1, batch: int = 8) -> list:
    """``steps``: (applied, loss, gnorm) per step, from step ``start``; returns update()'s answers."""
    return [g.update(start + i, (start + i - 1) * batch, *s) for i, s in enumerate(steps)]


def warm(g: Guard, n: int = 4, loss: float = 1.0, gnorm: float = 1.0) -> None:
    """Fill the window with healthy steps 1..n."""
    assert feed(g, [(True, loss, gnorm)] * n) == [None] * n
    assert g.healthy and len(g.losses) == n


def test_healthy_steps_go_on():
    g = guard()
    assert feed(g, [(True, 3.0 - 0.1 * i, 0.5) for i in range(10)]) == [None] * 10
    assert g.healthy and g.first_unhealthy is None and g.window(80) == ""
    assert list(g.losses) == pytest.approx([2.4, 2.3, 2.2, 2.1])  # the last spike_window healthy losses


@pytest.mark.parametrize(
    "bad", [(False, 2.0, 1.0), (True, NAN, 1.0), (True, INF, 1.0), (True, -INF, 1.0), (True, None, None)]
)
def test_a_non_finite_run_stops_at_max_bad_steps(bad):
    g = guard()
    warm(g)
    assert feed(g, [bad, bad], start=5) == [None, None]
    assert not g.healthy
    why = g.update(7, 48, *bad)
    assert why.startswith("3 consecutive non-finite steps (limit train.max_bad_steps=3); step 7 skipped as non-finite")
    assert f"loss={bad[1]}" in why
    assert g.window(56) == "unhealthy since step 5 (training samples 32..55)"
    assert list(g.losses) == [1.0] * 4  # skipped steps add nothing to the window


def test_a_finite_step_ends_the_non_finite_run():
    g = guard()
    bad = (True, NAN, NAN)
    out = feed(g, [bad, bad, (True, 1.0, 1.0), bad, bad, (True, 1.0, 1.0), bad, bad])
    assert out == [None] * 8
    assert g.bad_run == 2 and g.window(64) == "unhealthy since step 7 (training samples 48..63)"
    assert g.update(9, 64, *bad).startswith("3 consecutive")


def test_max_bad_steps_1_stops_at_the_first():
    g = guard("train.max_bad_steps=1")
    assert g.update(1, 0, False, 1.0, INF).startswith("1 consecutive non-finite steps (limit train.max_bad_steps=1)")


def test_the_loss_spike_rule():
    g = guard()  # spike_factor 2 (the default), window 4, patience 3
    warm(g)
    assert g.update(5, 32, True, 2.5, 1.0) is None
    assert not g.healthy and g.spike_run == 1
    assert "step 5: loss 2.5 above train.spike_factor=2 x its running mean 1 (last 4 healthy steps)" in g.why
    assert g.update(6, 40, True, 3.0, 1.0) is None
    why = g.update(7, 48, True, 9.0, 1.0)
    assert why == (
        "a loss spike for 3 steps (train.spike_patience=3); step 7: loss 9 above train.spike_factor=2 x its running "
        "mean 1 (last 4 healthy steps)"
    )
    assert g.window(56) == "unhealthy since step 5 (training samples 32..55)"
    assert list(g.losses) == [1.0] * 4  # spiking losses are not added to the window


def test_a_healthy_step_ends_the_spike_and_the_window_keeps_its_mean():
    g = guard()
    warm(g)
    out = feed(g, [(True, 5.0, 1.0), (True, 5.0, 1.0), (True, 1.2, 1.0), (True, 5.0, 1.0), (True, 5.0, 1.0)], 5)
    assert out == [None] * 5 and g.spike_run == 2
    assert list(g.losses) == pytest.approx([1.0, 1.0, 1.0, 1.2])
    assert g.update(10, 72, True, 2.0, 1.0) is None and g.healthy  # 2.0 is not above 2 x 1.05
    assert g.window(80) == "" and g.first_unhealthy is None


def test_the_loss_rule_is_strict_and_watches_only_a_full_window():
    g = guard()
    assert feed(g, [(True, 1.0, 1.0), (True, 50.0, 1.0), (True, 1.0, 1.0)]) == [None] * 3  # 3 < spike_window
    assert g.healthy and list(g.losses) == [1.0, 50.0, 1.0]
    g = guard()
    warm(g)
    assert g.update(5, 32, True, 2.0, 1.0) is None and g.healthy  # equal to 2 x mean: not above it


def test_the_grad_norm_rule():
    g = guard("train.grad_spike_factor=10")
    warm(g, gnorm=0.5)
    assert feed(g, [(True, 1.0, 5.1), (True, 1.0, 6.0)], 5) == [None, None]
    assert not g.healthy
    why = g.update(7, 48, True, 1.0, 100.0)
    assert why == (
        "a loss spike for 3 steps (train.spike_patience=3); step 7: gradient norm 100 above "
        "train.grad_spike_factor=10 x its running mean 0.5"
    )
    assert list(g.gnorms) == [0.5] * 4
    g = guard("train.grad_spike_factor=10")
    warm(g, gnorm=0.5)
    assert g.update(5, 32, True, 1.0, 5.0) is None and g.healthy  # 10 x 0.5 exactly: not above it


@pytest.mark.parametrize("off", ["train.spike_factor=0", "train.grad_spike_factor=0"])
def test_factor_0_turns_a_rule_off(off):
    g = guard(off)
    warm(g)
    spike = (True, 100.0, 1.0) if "train.spike_factor" in off else (True, 1.0, 1000.0)
    assert feed(g, [spike] * 10, 5) == [None] * 10
    assert g.healthy and g.spike_run == 0


def test_both_rules_off_still_stop_a_non_finite_run():
    g = guard("train.spike_factor=0", "train.grad_spike_factor=0")
    warm(g)
    assert feed(g, [(True, 1e9, 1e9)] * 5 + [(False, NAN, NAN)] * 2, 5) == [None] * 7
    assert g.update(12, 88, False, NAN, NAN).startswith("3 consecutive")


def test_a_gnorm_missing_or_not_finite_is_no_spike_and_not_in_the_window():
    g = guard()
    warm(g)
    assert feed(g, [(True, 1.0, None), (True, 1.0, NAN)], 5) == [None, None]
    assert g.healthy and list(g.gnorms) == [1.0] * 4 and list(g.losses) == [1.0] * 4


def test_skipped_steps_between_spikes_do_not_hide_a_divergence():
    """A diverging run whose spiking steps alternate with skipped (non-finite) ones is unhealthy throughout: it
    must stop (neither rule's own run ever reaches its limit otherwise, and no save is made while unhealthy)."""
    g = guard()
    warm(g)
    out, healthy = [], []
    for i, step in enumerate([(True, 9.0, 1.0), (True, NAN, NAN)] * 10):
        out.append(g.update(5 + i, (4 + i) * 8, *step))
        healthy.append(g.healthy)
    stops = [i for i, why in enumerate(out) if why]
    assert stops, "the run never stopped"
    assert stops[0] == 4 and out[4].startswith("a loss spike for 3 steps (train.spike_patience=3); step 9: loss 9")
    assert not any(healthy)
    assert g.window(200) == "unhealthy since step 5 (training samples 32..199)"


def test_a_new_guard_starts_with_an_empty_window():
    g = guard()
    assert g.healthy and g.window(0) == "" and len(g.losses) == 0 and g.losses.maxlen == 4


# ---- the config ----


@pytest.mark.parametrize(
    "over, key, says",
    [
        ("train.spike_factor=1", "train.spike_factor", "must be > 1, or 0 to turn this rule off; got 1.0"),
        ("train.spike_factor=0.5", "train.spike_factor", "must be > 1, or 0"),
        ("train.spike_factor=-2", "train.spike_factor", "must be > 1, or 0"),
        ("train.grad_spike_factor=1", "train.grad_spike_factor", "must be > 1, or 0"),
        ("train.spike_patience=0", "train.spike_patience", "must be >= 1, got 0"),
        ("train.spike_window=0", "train.spike_window", "must be >= 1, got 0"),
        ("train.max_bad_steps=0", "train.max_bad_steps", "must be >= 1, got 0"),
        ("train.spike_factor=abc", "train.spike_factor", "expected a number"),
    ],
)
def test_guard_keys_are_checked(over, key, says):
    with pytest.raises(ConfigError) as e:
        load_config(CONFIG, [over])
    assert f"{key}: {says}" in str(e.value)


def test_guard_key_defaults_and_accepted_values():
    t = load_config(CONFIG).train
    assert (t.spike_factor, t.grad_spike_factor, t.spike_patience) == (2.0, 10.0, 4)
    t = load_config(CONFIG, ["train.spike_factor=1.01", "train.grad_spike_factor=0", "train.spike_window=1"]).train
    assert (t.spike_factor, t.grad_spike_factor, t.spike_window) == (1.01, 0.0, 1)


def _float_keys(cls=Config, prefix=""):
    """Every key of the schema whose type holds a float: (dotted key, takes a list)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _float_keys(tp, f"{prefix}{f.name}.")
        elif "float" in str(tp):
            yield f"{prefix}{f.name}", "list" in str(tp)


FLOAT_KEYS = sorted(_float_keys())


def test_the_schema_has_float_keys():
    keys = dict(FLOAT_KEYS)
    for key in ("optim.lr", "train.spike_factor", "checkpoint.lock_timeout_s", "data.weights", "model.lev.chunk_mib"):
        assert key in keys
    assert keys["data.weights"] is True


@pytest.mark.parametrize("value", ["inf", ".inf", "-inf", "-.inf", "nan", ".nan", "Infinity", "1e999"])
def test_optim_lr_rejects_non_finite(value):
    with pytest.raises(ConfigError) as e:
        load_config(CONFIG, [f"optim.lr={value}"])
    msg = str(e.value)
    assert msg.startswith(f"command line (optim.lr={value}): optim.lr: expected a finite number, got ")
    assert "\n" not in msg


@pytest.mark.parametrize("key, is_list", FLOAT_KEYS)
def test_every_float_key_rejects_inf_and_nan(key, is_list):
    for value in ("inf", ".inf", "-inf", "nan", ".nan"):
        over = f"{key}=[1.0, {value}]" if is_list else f"{key}={value}"
        with pytest.raises(ConfigError) as e:
            load_config(CONFIG, [over])
        assert f"{key}[1]:" in str(e.value) if is_list else f"{key}:" in str(e.value), (over, str(e.value))


def test_data_weights_reject_non_finite_and_keep_finite():
    with pytest.raises(ConfigError, match=r"data\.weights\[1\]: expected a finite number, got inf"):
        load_config(CONFIG, ["data.weights=[1, .inf]"])
    with pytest.raises(ConfigError, match=r"data\.weights\[0\]: expected a finite number, got 'nan'"):
        load_config(CONFIG, ["data.weights=[nan]"])
    assert math.isfinite(load_config(CONFIG, ["optim.lr=1e-3"]).optim.lr)
