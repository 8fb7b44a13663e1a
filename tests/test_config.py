"""The config schema: YAML + base chains + dotted overrides, errors that name the key."""

import pytest

from leviathan_pretrain.config import ConfigError, load_config


def test_defaults_and_overrides():
    over = ["model.lev.heads=16", "optim.lr=1e-3", "data.prefixes=[a,b]", "model.num_query_groups=4"]
    cfg = load_config(None, [*over, "model.vocab_size=32000"])
    assert cfg.model.lev.heads == 16
    assert cfg.optim.lr == pytest.approx(1e-3)
    assert cfg.data.prefixes == ["a", "b"]
    assert cfg.model.num_query_groups == 4


def test_base_chain_merges_and_overrides(tmp_path):
    (tmp_path / "base.yaml").write_text(
        "model:\n  vocab_size: 32000\n  hidden_size: 256\n  num_attention_heads: 4\n  lev:\n    rank: 8\n"
    )
    (tmp_path / "child.yaml").write_text("base: base.yaml\nmodel:\n  lev:\n    heads: 4\n")
    cfg = load_config(tmp_path / "child.yaml", ["model.lev.rank=16"])
    assert (cfg.model.hidden_size, cfg.model.lev.heads, cfg.model.lev.rank) == (256, 4, 16)


def test_lev_base_resolution():
    from leviathan_pretrain.config import LEVConfig

    lev = LEVConfig()
    for v in (2, 50257, 100000, 200000, 200019, 27000, 27001):
        b = lev.resolved_base(v)
        assert b**3 >= v and (b - 1) ** 3 < v


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.varint=lev", "model.varint"),
        ("model.variant=foo", "model.variant"),
        ("model.lev.knots=2", "model.lev.knots"),
        ("parallel.tensor_parallel=3", "parallel.tensor_parallel"),
        ("optim.lr=abc", "optim.lr"),
        ("model.lev.base=10", "model.lev.base"),
        ("parallel.zero_stage=5", "parallel.zero_stage"),
    ],
)
def test_errors_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override, "model.vocab_size=32000"])


def test_pipeline_limits_zero_stage():
    with pytest.raises(ConfigError, match="ZeRO stage <= 1"):
        load_config(None, ["parallel.pipeline_parallel=2", "parallel.zero_stage=2"])


def test_tp_must_divide_lev_heads():
    with pytest.raises(ConfigError, match="model.lev.heads"):
        load_config(
            None,
            ["parallel.tensor_parallel=4", "model.lev.heads=6", "model.num_attention_heads=8", "model.hidden_size=256"],
        )


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_config(bad)


def test_two_timeouts_and_optional_peak_flops():
    cfg = load_config(None, ["model.vocab_size=32000"])
    assert (cfg.parallel.timeout_minutes, cfg.parallel.init_timeout_minutes, cfg.logging.peak_flops) == (
        10.0,
        60.0,
        None,
    )
    for key in ("parallel.init_timeout_minutes=0", "logging.peak_flops=0"):
        with pytest.raises(ConfigError, match=key.split("=")[0].replace(".", r"\.")):
            load_config(None, [key])
