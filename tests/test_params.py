"""Configs and parameter counts: the 26 config files, the params CLI, the paper's ratios at V = 200k."""

import json

import pytest

from leviathan_pretrain.config import VARIANTS, load_config
from leviathan_pretrain.model import counts as param_counts
from leviathan_pretrain.model import sizes
from leviathan_pretrain.params import main as params_main
from tests.multiproc import REPO, run_python

SCALES = ("200m", "400m", "1.2b", "tiny-cpu")
V200K = "model.vocab_size=200019"


def counts(path, *over):
    return param_counts.param_breakdown(load_config(REPO / path, list(over)).model)


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_config_exists_loads_and_names_its_variant(scale, variant):
    cfg = load_config(REPO / f"configs/{scale}-{variant}.yaml")
    assert cfg.model.variant == variant
    assert cfg.train.out_dir == f"runs/{scale}-{variant}"


SEVEN_B = ("tied", "lev")  # the 7B scale has these two variants only


def test_the_config_files_are_the_scales_times_the_variants_the_iso_runs_and_the_two_7b():
    """26 ``<scale>-<variant>.yaml``, plus one ``<scale>-lev-iso.yaml`` per paper scale and tiny-cpu (LEV at UNTIED's
    total): 30 files, as configs/README.md says, naming every variant."""
    names = {p.name for p in (REPO / "configs").glob("*.yaml")}
    expected = {f"{s}-{v}.yaml" for s in SCALES for v in VARIANTS} | {f"7b-{v}.yaml" for v in SEVEN_B}
    iso = {f"{s}-lev-iso.yaml" for s in SCALES}
    assert len(expected) == 26 and names == expected | iso and len(names) == 30
    readme = (REPO / "configs/README.md").read_text()
    assert "30 files" in readme and all(f"`{v}`" in readme for v in (*VARIANTS, "lev-iso"))


@pytest.mark.parametrize("variant", SEVEN_B)
def test_7b_configs_have_llama_2_7b_shape_and_a_200k_vocabulary(variant):
    cfg = load_config(REPO / f"configs/7b-{variant}.yaml")
    m, p, t = cfg.model, cfg.parallel, cfg.train
    assert (m.variant, t.out_dir) == (variant, f"runs/7b-{variant}")
    assert (m.hidden_size, m.num_layers, m.num_attention_heads, m.resolved_ffn_hidden_size()) == (4096, 32, 32, 11008)
    assert m.num_query_groups in (None, 32) and m.norm_epsilon == 1e-5 and m.rotary_base == 10000
    assert (m.vocab_size, m.seq_length, t.global_batch_size * m.seq_length) == (200_000, 2048, 4_194_304)
    assert (p.precision, p.zero_stage, p.sequence_parallel, t.micro_batch_size) == ("bf16", 1, True, 2)
    assert m.lev.heads % p.tensor_parallel == 0 and m.lev.heads % 8 == 0  # LEV's heads shard over TP 2, 4, 8


def test_lev_is_within_0_1_percent_of_tied_at_7b():
    tied = counts("configs/7b-tied.yaml", "parallel.tensor_parallel=1", "parallel.sequence_parallel=false")["total"]
    lev = counts("configs/7b-lev.yaml", "parallel.tensor_parallel=1", "parallel.sequence_parallel=false")["total"]
    assert (tied, lev) == (7_295_733_760, 7_299_035_264)  # configs/README.md's table
    assert 0 < (lev - tied) / tied < 0.001


def test_lev_within_0_3_percent_of_tied_at_1_2b():
    tied = counts("configs/1.2b-tied.yaml", V200K)["total"]
    lev = counts("configs/1.2b-lev.yaml", V200K)["total"]
    assert 1.1e9 < tied < 1.3e9
    assert 0 < (lev - tied) / tied < 0.003


def test_untied_is_about_plus_50_percent_at_400m():
    tied = counts("configs/400m-tied.yaml", V200K)["total"]
    untied = counts("configs/400m-untied.yaml", V200K)["total"]
    assert 0.38e9 < tied < 0.42e9
    assert abs(untied - 611e6) / 611e6 < 0.02  # the paper's 611M
    assert 1.45 < untied / tied < 1.55


@pytest.mark.parametrize("scale", ["200m", "400m", "1.2b"])
def test_ablations_are_parameter_matched_to_lev(scale):
    lev = counts(f"configs/{scale}-lev.yaml", V200K)["input"]
    for v in ("flat_mlp", "factored_mlp"):
        other = counts(f"configs/{scale}-{v}.yaml", V200K)["input"]
        assert abs(other - lev) / lev < 0.01, (v, other, lev)
    # ALBERT's e is an integer and one unit of e is V + D = 201k parameters (~10% of LEV's input):
    # it must be the nearest integer to the exact match.
    m = load_config(REPO / f"configs/{scale}-albert.yaml", [V200K]).model
    assert abs(sizes.albert_dim(m) - lev / (m.vocab_size + m.hidden_size)) <= 0.5


def test_params_cli_json_has_exactly_the_six_keys(capsys):
    assert params_main(["--config", str(REPO / "configs/1.2b-lev.yaml"), "--json", V200K]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"input", "body", "head", "total", "padding", "exported"}
    assert out["total"] == out["input"] + out["body"] + out["head"]
    assert out["exported"] == out["body"] + 2 * 200019 * 2048  # embed_tokens (LEV materialised) and lm_head


def test_params_cli_as_a_module_with_overrides():
    proc = run_python(
        "-m", "leviathan_pretrain.params", "--config", "configs/400m-tied.yaml", "model.vocab_size=50257", timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert "head" in proc.stdout and "vocab_size=50257" in proc.stdout


def test_params_cli_does_not_import_torch_or_megatron():
    code = (
        "import sys; from leviathan_pretrain.params import main; main(['--config', 'configs/1.2b-lev.yaml', "
        "'--json']); assert 'torch' not in sys.modules and 'megatron' not in sys.modules"
    )
    proc = run_python("-c", code, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_params_cli_reports_config_errors():
    proc = run_python(
        "-m", "leviathan_pretrain.params", "--config", "configs/1.2b-lev.yaml", "model.lev.knots=2", timeout=60
    )
    assert proc.returncode == 2 and "model.lev.knots" in proc.stderr


def test_readme_table_matches_the_configs():
    text = (REPO / "configs/README.md").read_text()
    for scale in ("200m", "400m", "1.2b", "tiny-cpu", "7b"):
        cfg = load_config(REPO / f"configs/{scale}-tied.yaml")
        m = cfg.model
        assert f"| `{scale}` | {m.hidden_size} | {m.num_layers} | {m.num_attention_heads} |" in text, scale


@pytest.mark.parametrize("scale", ["tiny-cpu", "200m", "400m", "1.2b"])
def test_iso_to_brackets_the_other_total_and_the_iso_configs_take_the_nearest(scale, capsys):
    """``--iso-to``: the depths whose totals bracket the other config's (every other field as in this config), and
    configs/<scale>-lev-iso.yaml holds the nearer of the two against UNTIED (the v1 protocol, configs/README.md)."""
    assert (
        params_main(
            [
                "--config",
                f"{REPO}/configs/{scale}-lev.yaml",
                "--iso-to",
                f"{REPO}/configs/{scale}-untied.yaml",
                "--json",
            ]
        )
        == 0
    )
    iso = json.loads(capsys.readouterr().out)
    target = param_counts.param_breakdown(load_config(REPO / f"configs/{scale}-untied.yaml").model, 1)["total"]
    below, above = iso["below"], iso["above"]
    assert iso["target"] == target and below["total"] <= target < above["total"]
    assert above["num_layers"] == below["num_layers"] + 1
    lev = load_config(REPO / f"configs/{scale}-lev.yaml").model
    for got in (below, above):
        at = param_counts.param_breakdown(type(lev)(**{**lev.__dict__, "num_layers": got["num_layers"]}), 1)["total"]
        assert at == got["total"]
    nearest = min((below, above), key=lambda g: abs(g["total"] - target))
    iso_cfg = load_config(REPO / f"configs/{scale}-lev-iso.yaml").model
    assert iso_cfg.variant == "lev" and iso_cfg.num_layers == nearest["num_layers"]
    assert {k: v for k, v in iso_cfg.__dict__.items() if k != "num_layers"} == {
        k: v for k, v in lev.__dict__.items() if k != "num_layers"
    }


def test_iso_to_applies_the_overrides_to_both_configs(capsys):
    """The small study runs tiny-cpu at a 16k vocabulary: its equal-parameter depth is found at 16k in both models
    (UNTIED's two tables grow with it), not against UNTIED at its config's 8k (which gave 4 layers, 0.65x)."""
    argv = ["--config", f"{REPO}/configs/tiny-cpu-lev.yaml", "--iso-to", f"{REPO}/configs/tiny-cpu-untied.yaml"]
    assert params_main([*argv, "--json", "model.vocab_size=16000"]) == 0
    iso = json.loads(capsys.readouterr().out)
    untied = load_config(REPO / "configs/tiny-cpu-untied.yaml", ["model.vocab_size=16000"]).model
    target = param_counts.param_breakdown(untied, 1)["total"]
    assert iso["target"] == target == 11_602_176 and iso["below"]["total"] <= target < iso["above"]["total"]
    assert (iso["below"]["num_layers"], iso["above"]["num_layers"]) == (8, 9)
    assert params_main([*argv, "model.vocab_size=16000"]) == 0
    assert "vocab_size=16000 hidden=256 tensor_parallel=1 in both)" in capsys.readouterr().out


def test_iso_to_a_smaller_model_has_no_depth_below(capsys):
    assert (
        params_main(["--config", f"{REPO}/configs/1.2b-lev.yaml", "--iso-to", f"{REPO}/configs/tiny-cpu-tied.yaml"])
        == 0
    )
    out = capsys.readouterr().out
    assert "below  none: one layer is already over it" in out and "above  num_layers=1 " in out, out
