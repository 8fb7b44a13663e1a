"""One number per quantity: the trained and exported parameter counts of ``params``, ``evaluate``, the trainer and
``export_hf`` (model/counts.py), and what the trainer's validation and ``evaluate`` say they scored. In-process (the
fast tier); tests/test_export_hf.py checks the same figures on real trained runs, through the commands."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from leviathan_pretrain.config import load_config
from leviathan_pretrain.model import counts
from leviathan_pretrain.params import main as params_main
from tests.multiproc import one_rank_world
from tests.small_model import small_model_overrides

REPO = Path(__file__).resolve().parents[1]
DEMO = [str(REPO / "configs/tiny-cpu-lev.yaml"), "model.vocab_size=8000", "parallel.tensor_parallel=2"]


def demo(variant: str):
    return load_config(DEMO[0], [*DEMO[1:], f"model.variant={variant}"])


KEYS = ("input", "body", "head", "total", "padding", "exported")
# the demo model (make demo: tiny-cpu LEV, the 8k demo tokenizer, TP = 2) and its TIED twin
FIGURES = {
    "lev": (55_424, 3_410_176, 2_097_152, 5_562_752, 49_152, 7_506_176),
    "tied": (2_097_152, 3_410_176, 0, 5_507_328, 49_152, 5_458_176),
}


@pytest.mark.parametrize("variant", list(FIGURES))
def test_params_prints_the_demo_models_figures(variant, capsys):
    want = dict(zip(KEYS, FIGURES[variant]))
    assert params_main(["--config", *DEMO, f"model.variant={variant}", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got == want
    V, D = 8000, 256
    tables = 1 if variant == "tied" else 2
    # the export: the body, embed_tokens V x D (LEV materialised) and, untied, lm_head V x D; no padded rows
    assert got["exported"] == got["total"] - got["input"] - got["head"] + tables * V * D
    assert params_main(["--config", *DEMO, f"model.variant={variant}"]) == 0
    text = capsys.readouterr().out
    assert f"trained parameters   {want['total']:>15,d}  ({want['total'] / 1e6:.2f}M)" in text
    assert f"exported parameters  {want['exported']:>15,d}" in text
    assert "49,152 of them in padded vocabulary rows (8,000 ids padded to 8,192 rows at TP=2)" in text
    cfg = demo(variant)
    assert counts.trained_text(counts.param_summary(cfg.model, 2)).startswith(f"{want['total']:,} trained parameters")


@pytest.fixture(scope="module")
def world():
    with one_rank_world(load_config(None, small_model_overrides("lev", 1000, 32)).parallel) as env:
        yield env


@pytest.mark.parametrize("variant", ["lev", "tied", "untied", "albert", "flat_mlp", "factored_mlp"])
def test_trained_and_exported_counts_are_the_models(world, variant):
    """The model evaluate and export_hf load (load.py: TP = 1 with a TP = 2 run's padded vocabulary) holds the
    trained parameters at TP = 2, the padded rows' share among them; the export's tensors the exported count."""
    from megatron.core import parallel_state as ps

    from leviathan_pretrain.evaluation.load import _eval_model_config
    from leviathan_pretrain.hf.convert import llama_state_dict
    from leviathan_pretrain.model.assembly import build_model
    from leviathan_pretrain.model.settings import BuildSettings

    cfg = load_config(None, [*small_model_overrides(variant, 1000, 32), "parallel.precision=fp32"])
    build = BuildSettings(tp_group=ps.get_tensor_model_parallel_group(), precision="fp32", device="cpu")
    model = build_model(_eval_model_config(cfg, 2), build)
    s = counts.param_summary(cfg.model, 2)
    assert s["padded_vocab_size"] == 1024 and s["vocab_size"] == 1000
    assert sum(p.numel() for p in model.parameters()) == s["total"]
    padded_tables = [p for p in model.parameters() if p.shape[0] == 1024]
    assert s["padding"] == sum((1024 - 1000) * p[0].numel() for p in padded_tables)
    exported = sum(t.numel() for t in llama_state_dict(model, cfg).values())
    assert exported == counts.exported_params(cfg.model)
    assert counts.exported_text(cfg.model, exported).startswith(f"{exported:,} exported parameters")


def test_evaluate_report_and_console_name_the_same_counts(tmp_path):
    """evaluate's ``_header`` counts at the TP the run trained with; its console table prints model/counts.py's line
    and, per held-out set, the prefix, its documents and target tokens."""
    from leviathan_pretrain.evaluation.evaluate_run import _header, _Scoring
    from leviathan_pretrain.evaluation.report import console_table
    from leviathan_pretrain.trainer.checkpoint.record import ParallelLayout

    cfg = demo("lev")
    record = SimpleNamespace(layout=ParallelLayout(tp=2, pp=1, dp=1, zero_stage=0), consumed_samples=2400)
    tr = SimpleNamespace(cfg=cfg, record=record, ckpt_dir=tmp_path, tag="global_step300", step=300, variant="lev")
    opts = SimpleNamespace(run=str(tmp_path), batch_size=8, dtype="fp32", max_tokens=None)
    sc = _Scoring(model=None, vocab_size=8000, context=256, stride=256, kw={}, verbose=False)
    report = _header(opts, tr, sc, (0, 1), "cpu")
    assert report.params["total"] == 5_562_752 and report.params["input_layer"] == 55_424
    assert report.params["padding"] == 49_152 and report.params["tensor_parallel"] == 2
    report.heldout = [
        {"name": "val", "prefix": "/data/val", "documents": 6, "documents_left_out": 0, "document_range": [0, 6],
         "split": None, "tokens": 17_789, "loss": 5.07, "ppl": 159.06},
        {"name": "train:valid", "prefix": "/data/train", "documents": 3, "documents_left_out": 4,
         "document_range": [90, 93], "split": "validation", "tokens": 5_000, "loss": 5.1, "ppl": 164.0},
    ]  # fmt: skip
    text = console_table(report)
    assert counts.trained_text(counts.param_summary(cfg.model, 2)) in text
    assert "5,562,752 trained parameters (5.56M) = input layer 55,424 + transformer body 3,410,176" in text
    assert "target tokens" in text and "17,789" in text
    assert "/data/val: documents 0..6 (all of the file)" in text
    assert "/data/train: documents 90..93 (the first of its validation split; 4 more left out by --max-tokens)" in text
    assert "every target token of each set scored once (windows of 256, stride 256)" in text
    # a report written before body / head were recorded still prints
    report.params = {"total": 10, "input_layer": 2, "non_input": 8}
    assert "10 trained parameters (0.00M), input layer 2" in console_table(report)


def test_validation_line_names_its_tokens_and_data(tmp_path, capsys):
    from leviathan_pretrain.trainer.metrics import Metrics, validation_set

    cfg = demo("lev")  # eval_iters 5, global batch 8, seq 256
    tokens, text = validation_set(cfg)
    assert tokens == 5 * 8 * 256
    assert text == (
        "10,240 tokens: a fixed sample of 5 x 8 sequences of 256 from the validation split of data.prefixes "
        f"(data.split={cfg.data.split})"
    )
    cfg = load_config(DEMO[0], [*DEMO[1:], "data.valid_prefixes=[/d/val,/d/val2]", "data.eod_mask_loss=true"])
    tokens, text = validation_set(cfg)
    assert text.endswith("from data.valid_prefixes (val, val2), EOD targets not scored")
    m = Metrics(tmp_path, None, True, 0, 10, 300)
    m.valid(100, 5.1189, (tokens, text))
    m.close()
    line = capsys.readouterr().out
    assert "validation loss 5.1189 | ppl 167.15 | 10,240 tokens: a fixed sample of 5 x 8 sequences" in line
    (rec,) = [json.loads(x) for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert rec["valid_tokens"] == 10_240 and rec["valid_data"] == text
