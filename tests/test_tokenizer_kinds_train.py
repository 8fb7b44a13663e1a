"""Every tokenizer kind through the trainer and evaluation: shards written with a Hugging Face tokenizer.json and
with a 70k-id tiktoken encoding (int32 shards) train 20 steps with ``model.vocab_size`` taken from the tokenizer,
the checkpoint records the fingerprint, and evaluate scores WikiText through the same tokenizer (its token count
is the library's own encoding of the articles). A changed tokenizer is refused against the shards' manifest
naming both files; export_hf writes a Hugging Face directory whose AutoTokenizer gives the library's ids on the
articles and whose LlamaForCausalLM gives our logits."""

import json
import math
import shutil

import pytest

from tests.multiproc import run_python
from tests.test_evaluate import WIKI, evaluate
from tests.tokenizer_kinds import reference_encoder

KINDS = {
    "huggingface": ("bpe_tokenizer_json", "huggingface", []),
    "tiktoken-70k": ("big_tiktoken", "tiktoken", ["data.tiktoken_pattern=r50k"]),
}
TINY = [
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.num_attention_heads=2",
    "model.seq_length=64",
    "model.lev.seed_dim=16",
    "model.lev.heads=2",
    "model.lev.rank=8",
    "train.micro_batch_size=4",
    "train.global_batch_size=4",
    "train.eval_interval=0",
    "parallel.device=cpu",
    "parallel.precision=fp32",
    "checkpoint.save_interval=20",
    "logging.log_interval=5",
]


def train(out, *over, timeout=300):
    return run_python(
        "-m",
        "leviathan_pretrain.train",
        "--config",
        "configs/tiny-cpu-lev.yaml",
        *TINY,
        *over,
        f"train.out_dir={out}",
        timeout=timeout,
    )


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(KINDS))
def test_train_and_evaluate_with_each_kind(name, request, minipile_dir, tokenize, tmp_path):
    fixture, kind, extra = KINDS[name]
    tok = request.getfixturevalue(fixture)
    args = ["--tiktoken-pattern", "r50k"] if kind == "tiktoken" else []
    tokenize(minipile_dir / "val.jsonl.zst", tok, tmp_path / "val", "--workers", 2, *args)
    m = json.loads((tmp_path / "val.manifest.json").read_text())
    data = [f"data.prefixes=[{tmp_path / 'val'}]", "data.split=100,0,0", f"data.tokenizer={tok}", *extra]
    p = train(tmp_path / "run", *data, "train.steps=20", "model.vocab_size=null")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    recs = [json.loads(x) for x in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    loss = [r["loss"] for r in recs if "loss" in r]
    assert len(loss) == 20 and all(map(math.isfinite, loss)) and loss[-1] < loss[0]
    meta = json.loads((tmp_path / "run/checkpoints/global_step20/leviathan.json").read_text())
    assert meta["tokenizer_fingerprint"] == m["tokenizer"]["fingerprint"]
    assert (
        meta["config"]["model"]["vocab_size"] == m["tokenizer"]["vocab_size"] == (4000 if kind != "tiktoken" else 70257)
    )

    # WikiText through the same tokenizer: as many scored tokens as the library's own encoding gives
    lines = WIKI.read_text().splitlines(keepends=True)
    heads = [i for i, x in enumerate(lines) if x.startswith(" = ") and not x.startswith(" = = ")]
    small = tmp_path / "wiki.raw"
    small.write_text("".join(lines[: heads[2]]))
    out = tmp_path / "eval.json"
    p = evaluate("--run", tmp_path / "run", "--no-heldout", "--wikitext", small, "--context", 64, "--out", out)
    assert p.returncode == 0, p.stderr[-3000:]
    w = json.loads(out.read_text())["wikitext"]
    from leviathan_pretrain.evaluation import texts as T

    encode, _, _ = reference_encoder(kind, tok)
    articles = [t for _, t in T.wikitext_articles(str(small)).items]
    assert w["tokens"] == sum(len(ids) for ids in encode(articles)) and math.isfinite(w["token_ppl"])

    # export: AutoTokenizer gives the library's ids on the articles, the model's logits are ours on them
    e = run_python(
        "-m",
        "leviathan_pretrain.export_hf",
        "--run",
        tmp_path / "run",
        "--out",
        tmp_path / "hf",
        "--dtype",
        "fp32",
        timeout=300,
    )
    assert e.returncode == 0 and "as LlamaForCausalLM" in e.stdout, e.stderr[-3000:]
    mark = json.loads((tmp_path / "hf/leviathan_export.json").read_text())
    assert mark["tokenizer_kind"] == kind and mark["tokenizer_fingerprint"] == m["tokenizer"]["fingerprint"]
    _check_export(tmp_path / "run", tmp_path / "hf", articles, encode(articles), m["tokenizer"]["eod_id"])


def _check_export(run, out, texts, want, eod):
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from leviathan_pretrain.evaluation.load import eval_world, load_trained
    from leviathan_pretrain.evaluation.scoring import logits_for

    hf = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert [hf.encode(t) for t in texts] == [list(ids) for ids in want] and hf.eos_token_id == eod
    model = LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32, local_files_only=True).eval()
    ids = torch.tensor([list(want[0][:64])])
    with eval_world("cpu"):
        ours = load_trained(run)
        mine = logits_for(ours.model, ids, ours.vocab_size)
    with torch.no_grad():
        theirs = model(ids).logits
    assert theirs.shape == mine.shape and (theirs - mine).abs().max().item() < 1e-4


def _tokenizer_dir(tokenizer_json, d):
    """A user's tokenizer directory holding a copy of ``tokenizer_json`` (the tests change or name it)."""
    d.mkdir()
    shutil.copy(tokenizer_json, d / "tokenizer.json")
    return d


@pytest.mark.timeout(300)
def test_a_changed_tokenizer_is_refused_against_the_shards(bpe_tokenizer_json, minipile_dir, tokenize, tmp_path):
    from tokenizers import Tokenizer

    d = _tokenizer_dir(bpe_tokenizer_json, tmp_path / "tok")
    tokenize(minipile_dir / "val.jsonl.zst", d, tmp_path / "val", "--workers", 2)
    tk = Tokenizer.from_file(str(d / "tokenizer.json"))
    tk.add_special_tokens(["<|pad|>"])
    tk.save(str(d / "tokenizer.json"))
    p = train(tmp_path / "run", f"data.prefixes=[{tmp_path / 'val'}]", f"data.tokenizer={d}", "train.steps=2")
    assert p.returncode == 2, p.stderr[-3000:]
    err = p.stderr.strip().splitlines()[-1]
    assert "another or a changed tokenizer" in err and str(d / "tokenizer.json") in err and "val.manifest.json" in err
    assert f"data.tokenizer={d}" in err


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_demo_takes_the_tokenizer_of_its_shards(bpe_tokenizer_json, minipile_dir, tokenize, tmp_path):
    """The main job on a user's shards written with a tokenizer.json directory: trains (vocabulary from it),
    evaluates and exports with it; --tokenizer without --data-prefix is refused."""
    d = _tokenizer_dir(bpe_tokenizer_json, tmp_path / "tok")
    tokenize(minipile_dir / "val.jsonl.zst", d, tmp_path / "val", "--workers", 2)
    wiki = tmp_path / "wiki.raw"
    lines = WIKI.read_text().splitlines(keepends=True)
    wiki.write_text("".join(lines[:60]))
    demo = ["-m", "leviathan_pretrain.demo", "--out", tmp_path / "demo", "--wikitext", wiki]
    p = run_python(
        *demo, "--data-prefix", tmp_path / "val", "--tokenizer", d, "--steps", "6", "model.seq_length=64", timeout=540
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"(tokenizer {d})" in p.stdout and "[demo] Hugging Face model:" in p.stdout
    mark = json.loads((tmp_path / "demo/hf/leviathan_export.json").read_text())
    assert mark["tokenizer_kind"] == "huggingface" and mark["vocab_size"] == 4000
    assert (tmp_path / "demo/hf/tokenizer.json").read_bytes() == bpe_tokenizer_json.read_bytes()

    p = run_python(*demo, "--tokenizer", d, timeout=120)
    assert p.returncode == 2 and "--tokenizer goes with --data-prefix" in p.stderr, p.stderr
