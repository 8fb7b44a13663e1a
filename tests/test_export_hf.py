"""``python -m leviathan_pretrain.export_hf``: trained runs exported as Hugging Face Llama directories, loaded back
with transformers (offline) and compared with the repo's own model: logits, greedy generation, tokenizer ids,
config; bad input and the output directory's safety.

Each run is exported once per module (fp32, through the real CLI); the runs are the ``trained_run`` fixture's
(tests/trained.py: 2 layers, width 128, 4 heads in 2 query groups, vocab 8000, 30 steps).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import pytest
import sentencepiece as spm
import torch

from tests.conftest import read_jsonl_zst, run_module
from tests.trained import STEPS

pytestmark = pytest.mark.timeout(300)

CLI = "leviathan_pretrain.export_hf"
RUNS = ["lev-tp2", "tied-tp2", "untied-pp2", "albert-tp2", "flat_mlp-tp2", "factored_mlp-tp2"]  # every variant
EDGE_TEXTS = [
    "Hello world",
    " leading space",
    "two  spaces,   three,\ttab and trailing   ",
    "lines\nand\n\nblank lines\r\nCRLF",
    "unicode: café naïve Ωμέγα 日本語 한국어 😀👍 ∑√∞ «quotes» — dash",
    "digits 0123456789 3.14159 1,000,000",
    "",
    " ",
    "\n",
    "<s> and </s> as text",
]


def export_here(*argv) -> str:
    """The export command's ``main`` in this process (what it printed): the six fixture exports pay no interpreter
    start each. The command as a process is run by the tests below (errors, bf16, --overwrite)."""
    from leviathan_pretrain import export_hf

    saved, out = dict(os.environ), io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            rc = export_hf.main([str(a) for a in argv])
    finally:  # main sets DS_ACCELERATOR and TQDM_DISABLE for its own process: not for the tests after this one
        os.environ.clear()
        os.environ.update(saved)
    assert rc == 0, out.getvalue()
    return out.getvalue()


@pytest.fixture(scope="module")
def exported(trained_run, tmp_path_factory):
    """``exported(name)`` -> (run dir, fp32 export dir), exported once per module by the command's ``main``."""
    root, done = tmp_path_factory.mktemp("hf_exports"), {}

    def get(name):
        if name not in done:
            run = trained_run(name)
            out = root / name
            stdout = export_here("--run", run, "--out", out, "--dtype", "fp32")
            assert f"to {out}" in stdout and "parameters" in stdout and "float32" in stdout, stdout
            done[name] = (run, out)
            get.stdout[name] = stdout
        return done[name]

    get.stdout = {}  # name -> what the export printed
    return get


@pytest.fixture(scope="module")
def val_texts(minipile_dir):
    return [r["text"] for r in read_jsonl_zst(minipile_dir / "val.jsonl.zst")]


def _load_ours(run):
    """The run's own model, its input layer computing rows as in training (not from a materialised table: the
    export's table is what is under test)."""
    from leviathan_pretrain.evaluation.load import load_trained

    trained = load_trained(run)
    if hasattr(trained.model.input_layer, "disable_lookup"):
        trained.model.input_layer.disable_lookup()
        assert trained.model.input_layer.lookup_table is None
    return trained


def _hf_model(out):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32, local_files_only=True).eval()


def _batch(sp, texts, n=4, length=128):
    rows = [ids[:length] for ids in (sp.encode(t) for t in texts) if len(ids) >= length][:n]
    assert len(rows) == n
    return torch.tensor(rows, dtype=torch.long)


@pytest.mark.parametrize("name", RUNS)
def test_logits_match(exported, val_texts, name):
    from leviathan_pretrain.evaluation.load import eval_world
    from leviathan_pretrain.evaluation.scoring import logits_for

    run, out = exported(name)
    with eval_world():
        ours = _load_ours(run)
        sp = spm.SentencePieceProcessor(model_file=str(ours.tokenizer.path))
        ids = _batch(sp, val_texts)
        ref = logits_for(ours.model, ids, ours.vocab_size)
    hf = _hf_model(out)
    with torch.no_grad():
        got = hf(input_ids=ids).logits.float()
    assert got.shape == ref.shape == (4, 128, 8000)
    assert (got - ref).abs().max().item() < 1e-4
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("name", ["lev-tp2", "tied-tp2"])
def test_greedy_generate_matches(exported, val_texts, name):
    from leviathan_pretrain.evaluation.load import eval_world
    from leviathan_pretrain.evaluation.scoring import logits_for
    from leviathan_pretrain.hf.convert import greedy_decode

    run, out = exported(name)
    hf = _hf_model(out)
    eos = hf.generation_config.eos_token_id
    with eval_world():
        ours = _load_ours(run)
        sp = spm.SentencePieceProcessor(model_file=str(ours.tokenizer.path))
        prompts = [sp.encode(val_texts[0])[:5], sp.encode(val_texts[1])[:17], sp.encode(val_texts[2])[:40]]
        for prompt in prompts:
            p = torch.tensor([prompt])
            want = greedy_decode(ours.model, p, 20, ours.vocab_size, eos_id=eos)
            g = hf.generate(
                p,
                attention_mask=torch.ones_like(p),
                do_sample=False,
                max_new_tokens=20,
                output_logits=True,
                return_dict_in_generate=True,
            )
            assert g.sequences.tolist() == want.tolist()
            # HF's incremental (KV cache) logits of each new token against ours on the whole sequence
            step_logits = torch.stack(g.logits, dim=1)[0].float()
            full = logits_for(ours.model, g.sequences, ours.vocab_size)[0, len(prompt) - 1 : -1]
            assert (step_logits - full).abs().max().item() < 1e-4


def test_tokenizer_matches_sentencepiece(exported, val_texts):
    from transformers import AutoTokenizer

    _, out = exported("lev-tp2")
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert type(tok).__name__ == "LlamaTokenizer"
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (sp.bos_id(), sp.eos_id(), sp.unk_id())
    assert len(tok) == sp.vocab_size() == 8000
    texts = val_texts + EDGE_TEXTS
    assert any("\n" in t for t in val_texts) and any(ord(c) > 127 for t in val_texts for c in t)
    for text in texts:
        want = sp.encode(text)
        assert tok.encode(text) == want, text[:200]
        assert tok(text)["input_ids"] == want  # no BOS / EOS added: the training data has none
    for text in EDGE_TEXTS[:6] + val_texts[:5]:
        assert tok.decode(sp.encode(text)) == sp.decode(sp.encode(text))


def test_config_and_marker(exported):
    from safetensors import safe_open

    from common.fileio import sha256_file

    for name, tied in [("lev-tp2", False), ("tied-tp2", True), ("untied-pp2", False)]:
        run, out = exported(name)
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
        assert cfg["tie_word_embeddings"] is tied
        assert (cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"]) == (8000, 128, 2)
        assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 32)
        assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
        assert cfg["rms_norm_eps"] == 1e-5 and cfg["max_position_embeddings"] == 128
        assert cfg["hidden_act"] == "silu" and not cfg["attention_bias"] and not cfg["mlp_bias"]
        assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["dtype"]) == (1, 2, "float32")
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            keys = set(f.keys())
            assert f.get_slice("model.embed_tokens.weight").get_shape() == [8000, 128]
            assert ("lm_head.weight" in keys) is not tied
            if not tied:
                assert f.get_slice("lm_head.weight").get_shape() == [8000, 128]
        mark = json.loads((out / "leviathan_export.json").read_text())
        assert mark["variant"] == name.split("-")[0] and mark["step"] == STEPS and mark["tag"] == f"global_step{STEPS}"
        assert mark["dtype"] == "fp32" and mark["source_run"] == str(run)
        assert mark["tokenizer_sha256"] == sha256_file(out / "tokenizer.model")
        gen = json.loads((out / "generation_config.json").read_text())
        assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)


def _error_line(p):
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr and len(lines) == 1, p.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


def test_bad_run_dir(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "global_step5").mkdir(parents=True)  # written, never completed (no leviathan.json)
    out = tmp_path / "out"
    line = _error_line(run_module(CLI, "--run", run, "--out", out, check=False, timeout=120))
    assert str(run / "checkpoints") in line
    (run / "checkpoints" / "latest").write_text("global_step5")
    line = _error_line(run_module(CLI, "--run", run, "--out", out, check=False, timeout=120))
    assert str(run / "checkpoints" / "latest") in line and "not a complete checkpoint" in line
    line = _error_line(run_module(CLI, "--run", tmp_path / "nothing", "--out", out, check=False, timeout=120))
    assert str(tmp_path / "nothing") in line
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_refuses_foreign_out_dir(trained_run, tmp_path):
    run = trained_run("lev-tp2")
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    for extra in ([], ["--overwrite"]):
        line = _error_line(run_module(CLI, "--run", run, "--out", out, *extra, check=False, timeout=120))
        assert str(out) in line
        assert (out / "notes.txt").read_text() == "keep me" and sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no temporary directory left beside it


def test_bf16_default_and_overwrite(exported, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    run, fp32_out = exported("lev-tp2")
    out = tmp_path / "bf16"
    p = run_module(CLI, "--run", run, "--out", out, timeout=240)
    assert "bfloat16" in p.stdout and "model.safetensors" in p.stdout
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((out / "leviathan_export.json").read_text())["dtype"] == "bf16"
    bf16, fp32 = load_file(str(out / "model.safetensors")), load_file(str(fp32_out / "model.safetensors"))
    assert bf16.keys() == fp32.keys() and all(torch.equal(bf16[k], fp32[k].to(torch.bfloat16)) for k in fp32)
    # an existing export: refused without --overwrite, replaced with it
    _error_line(run_module(CLI, "--run", run, "--out", out, "--dtype", "fp32", check=False, timeout=120))
    run_module(CLI, "--run", run, "--out", out, "--dtype", "fp32", "--overwrite", timeout=240)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bf16"]


@pytest.mark.parametrize("name", ["lev-tp2", "tied-tp2"])
def test_parameter_counts_agree_across_the_commands(exported, name, tmp_path, capsys):
    """One trained count in ``params`` (the run's config), the trainer's ``layout`` record, ``evaluate``'s report and
    console and the export's marker and output; the export's own count is the body plus a ``V x D`` table per
    table (LEV materialised, the padded rows dropped). The trainer's and evaluate's lines name what they scored."""
    from leviathan_pretrain.config import load_config
    from leviathan_pretrain.model import counts
    from leviathan_pretrain.params import main as params_main

    run, out = exported(name)
    assert params_main(["--config", str(run / "config.json"), "--json"]) == 0
    want = json.loads(capsys.readouterr().out)
    cfg = load_config(run / "config.json")
    line = counts.trained_text(counts.param_summary(cfg.model, cfg.parallel.tensor_parallel))
    records = [json.loads(x) for x in (run / "train_log.jsonl").read_text().splitlines()]
    (layout,) = [r for r in records if r.get("event") == "layout"]
    assert layout["params"] == {k: want[k] for k in ("input", "body", "head", "total", "padding")}
    mark = json.loads((out / "leviathan_export.json").read_text())
    assert mark["trained_parameters"] == want["total"] and mark["parameters"] == want["exported"]
    V, D = cfg.model.vocab_size, cfg.model.hidden_size
    tables = 1 if name.startswith("tied") else 2
    assert want["exported"] == want["total"] - want["input"] - want["head"] + tables * V * D
    printed = exported.stdout[name]
    assert counts.exported_text(cfg.model, want["exported"]) in printed and f"the run's {line}" in printed
    assert want["padding"] == (8192 - V) * D  # one table of 8,000 ids padded to 8,192 rows at TP = 2
    # evaluate: the report's params and the console's line; per held-out set the prefix, documents, target tokens
    report = tmp_path / "report.json"
    flags = ("--no-frequency", "--no-geometry", "--no-tensorboard", "--max-tokens", 2000, "--context", 64)
    p = run_module("leviathan_pretrain.evaluate", "--run", run, *flags, "--out", report, timeout=300)
    rep = json.loads(report.read_text())
    assert rep["params"]["total"] == want["total"] and rep["params"]["input_layer"] == want["input"]
    assert rep["params"]["padding"] == want["padding"] and line in p.stdout
    (h,) = rep["heldout"]
    a, b = h["document_range"]
    assert h["prefix"] == str(Path(cfg.data.valid_prefixes[0]).resolve()) and (a, b) == (0, h["documents"])
    assert f"{h['prefix']}: documents 0..{b:,} (the first of the file; " in p.stdout
    assert f"{h['tokens']:>13,} {h['documents']:>8,}" in p.stdout and "target tokens" in p.stdout
    # the trainer's validation: eval_iters x global batch x seq_length tokens of data.valid_prefixes
    valid = [r for r in records if "valid_loss" in r]
    t = cfg.train
    assert valid and all(r["valid_tokens"] == t.eval_iters * t.global_batch_size * cfg.model.seq_length for r in valid)
    assert all(f"from data.valid_prefixes ({Path(cfg.data.valid_prefixes[0]).name})" in r["valid_data"] for r in valid)
