"""``python -m leviathan_pretrain.evaluate`` on real trained runs (tests/trained.py), every number recomputed
independently with plain torch / numpy from the model's logits.

- the merged TP = 1 model of a TP = 2, PP = 2 and ZeRO-3 checkpoint reproduces the trainer's own validation
  loss at that step (the trainer's validation batches, through the trainer's data code);
- LEV's materialised table (inference) gives the training-mode logits;
- the sliding windows score every target exactly once, with the context they promise;
- held-out ppl, frequency buckets, WikiText token/word ppl and LAMBADA accuracy/ppl equal plain recomputations;
- TensorBoard scalars read back; data-parallel evaluation on 2 ranks equals 1 process; bad input.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess

import numpy as np
import pytest
import torch

from leviathan_pretrain.evaluation.load import eval_world, load_trained
from leviathan_pretrain.evaluation.scoring import score_stream, windows
from tests.conftest import read_jsonl_zst
from tests.multiproc import REPO, run_python, run_ranks
from tests.trained import STEPS

WIKI = REPO.parent / "shared" / "data" / "wikitext-103-test.raw"


def evaluate(*args, timeout=300) -> subprocess.CompletedProcess:
    return run_python("-m", "leviathan_pretrain.evaluate", *map(str, args), timeout=timeout)


def evaluate_here(*args) -> subprocess.CompletedProcess:
    """``evaluate``'s ``main`` in this process (its exit code and output, as the command gives them): for the bad-input
    cases, which need no fresh process and would each pay the libraries' import again."""
    import contextlib
    import io

    from leviathan_pretrain.evaluate import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in args])
    return subprocess.CompletedProcess(list(args), rc, out.getvalue(), err.getvalue())


@pytest.fixture
def run_copy(trained_run, tmp_path):
    """A copy of a trained run (evaluation writes eval/ and TensorBoard files into it)."""

    def make(name):
        dst = tmp_path / name
        shutil.copytree(trained_run(name), dst, ignore=shutil.ignore_patterns("data_cache"))
        return dst

    return make


@pytest.fixture(scope="module")
def world():
    with eval_world("cpu"):
        yield


def plain_losses(model, stream: np.ndarray, vocab: int, context: int, stride: int) -> np.ndarray:
    """Per-target nats computed target by target's window, the obvious way (reference for the scorer)."""
    out = np.full(len(stream) - 1, np.nan)
    for w in windows(len(stream), context, stride):
        ids = torch.as_tensor(stream[w.start : w.end], dtype=torch.long)[None]
        with torch.no_grad():
            logits = model(ids, torch.arange(ids.shape[1])[None])[0, :, :vocab].float()
        tgt = torch.as_tensor(stream[w.start + 1 : w.end + 1], dtype=torch.long)
        nll = torch.nn.functional.cross_entropy(logits, tgt, reduction="none").double().numpy()
        out[w.end - w.new : w.end] = nll[-w.new :]
    return out


@pytest.mark.parametrize(
    "name", ["lev-tp2", "tied-tp2", "untied-pp2", "lev-z3dp2", "albert-tp2", "flat_mlp-tp2", "factored_mlp-tp2"]
)
def test_merged_model_reproduces_the_trainers_validation_loss(name, trained_run, world):
    """The checkpoint's layout (TP=2 shards, pipeline layer files, ZeRO-3 partitions) merged into one model gives
    the validation loss the trainer logged at that step, on the trainer's own validation batches."""
    from leviathan_pretrain.data import datasets as D
    from leviathan_pretrain.model.head import masked_mean

    run = trained_run(name)
    tr = load_trained(run, lookup=False)
    cfg = tr.cfg
    logged = [r for r in map(json.loads, (run / "train_log.jsonl").read_text().splitlines()) if "valid_loss" in r]
    assert logged[-1]["step"] == tr.step
    splits = D.build_datasets(cfg, D.data_summary(cfg)["eod_id"], needs_data=True)
    t = cfg.train
    batches = D.Batches(splits[1], t.micro_batch_size, 1, 0, t.global_batch_size)
    losses = []
    for i in range(t.eval_iters):
        for mb in batches.global_batch(i * t.global_batch_size):
            with torch.no_grad():
                logits = tr.model(mb["tokens"], mb["position_ids"])  # all padded vocabulary columns, as trained
            per_token = torch.nn.functional.cross_entropy(
                logits.float().transpose(1, 2), mb["labels"], reduction="none"
            )
            losses.append(float(masked_mean(per_token, mb["loss_mask"])))
    assert abs(np.mean(losses) - logged[-1]["valid_loss"]) < 2e-4, (np.mean(losses), logged[-1])


@pytest.mark.parametrize("name", ["lev-tp2", "tied-tp2"])
def test_lookup_table_gives_the_training_mode_logits(name, trained_run, world, minipile_shards):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(minipile_shards["val"], mmap=True)
    ids = torch.as_tensor(np.concatenate([ds[i] for i in range(5)])[: 4 * 96].reshape(4, 96), dtype=torch.long)
    pos = torch.arange(96)[None].expand(4, 96)
    function = load_trained(trained_run(name), lookup=False)
    table = load_trained(trained_run(name), lookup=True)
    if name.startswith("lev"):
        assert table.model.input_layer.lookup_table is not None  # one lookup at inference
        assert function.model.input_layer.lookup_table is None
    with torch.no_grad():
        a, b = function.model(ids, pos), table.model(ids, pos)
    assert (a - b).abs().max() < 1e-5


def test_windows_score_every_target_once_with_the_promised_context(trained_run, world, minipile_shards):
    for n, ctx, stride in [(1, 4, 4), (2, 4, 4), (10, 4, 4), (10, 4, 1), (37, 8, 3), (100, 16, 16), (5, 16, 8)]:
        seen = []
        for w in windows(n, ctx, stride):
            assert 0 < w.end - w.start <= ctx and 1 <= w.new <= stride
            targets = range(w.end - w.new + 1, w.end + 1)
            # each scored target sees min(ctx, t) tokens of context, at least ctx - stride + 1 when available
            assert all(t - w.start >= min(t, ctx - stride + 1) for t in targets)
            seen += targets
        assert seen == list(range(1, n)), (n, ctx, stride, seen)
    tr = load_trained(trained_run("lev-tp2"))
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(minipile_shards["val"], mmap=True)  # alive while its memory-mapped rows are read
    stream = np.concatenate([ds[i] for i in range(3)])[:300]
    for ctx, stride in [(64, 64), (64, 24)]:
        got = score_stream(tr.model, stream, tr.vocab_size, ctx, stride, batch_size=3).loss
        ref = plain_losses(tr.model, stream, tr.vocab_size, ctx, stride)
        assert not np.isnan(got).any() and np.abs(got - ref).max() < 1e-4


def test_heldout_and_frequency_buckets_equal_a_plain_recomputation(run_copy, world, minipile_shards):
    run = run_copy("lev-tp2")
    p = evaluate("--run", run, "--data", minipile_shards["val"], "--max-tokens", 3000, "--context", 64)
    assert p.returncode == 0, p.stderr
    rep = json.loads((run / "eval" / f"global_step{STEPS}.json").read_text())
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(minipile_shards["val"], mmap=True)
    stream, docs = [], 0
    while sum(map(len, stream)) + len(ds[docs]) <= 3000 or not stream:
        stream.append(ds[docs])
        docs += 1
    stream = np.concatenate(stream).astype(np.int64)
    tr = load_trained(run)
    ref = plain_losses(tr.model, stream, tr.vocab_size, 64, 64)
    (h,) = rep["heldout"]
    assert h["tokens"] == len(stream) - 1 and h["documents"] == docs
    sec = h["seconds"]  # rounded to 0.01 s in the report; the rate is of the unrounded time
    assert 0 < h["tokens"] / (sec + 0.006) < h["tokens_per_s"] < h["tokens"] / max(sec - 0.006, 1e-3)
    assert f"scored in {h['seconds']:.1f} s: {h['tokens_per_s']:,.0f} target tokens/s" in p.stdout
    assert abs(h["loss"] - ref.mean()) < 1e-5 and abs(h["ppl"] - math.exp(ref.mean())) / h["ppl"] < 1e-4
    counts = np.load(minipile_shards["train"] + ".counts.npy").astype(np.int64)
    rel, targets = counts / counts.sum(), stream[1:]
    edges = [0, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1.01]
    buckets = {b["name"]: b for b in rep["frequency"]["buckets"]}
    assert rep["frequency"]["training_tokens"] == counts.sum()
    assert sum(b["tokens"] for b in buckets.values()) == len(targets)
    unseen = counts[targets] == 0
    assert buckets["unseen"]["tokens"] == unseen.sum()
    for name, lo, hi in zip(list(buckets)[1:], edges, edges[1:]):
        m = ~unseen & (rel[targets] >= lo) & (rel[targets] < hi)
        b = buckets[name]
        assert b["tokens"] == m.sum() and b["types"] == len(set(targets[m]))
        if m.any():
            assert abs(b["ppl"] - math.exp(ref[m].mean())) / b["ppl"] < 1e-4, name
    # the eval/ scalars sit in the run's TensorBoard directory, at the checkpoint's step
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    (ev,) = acc.Scalars("eval/val/ppl")
    assert ev.step == STEPS and abs(ev.value - h["ppl"]) / h["ppl"] < 1e-5
    assert "train/loss" in acc.Tags()["scalars"]  # beside the training curves
    assert "by training frequency" in p.stdout and "report:" in p.stdout
    # the token vectors' geometry: the model's own rows, overall and in the frequency buckets' id sets
    from leviathan_pretrain.model import geometry as G

    geo = rep["geometry"]
    ids = G.sample_ids(torch.arange(tr.vocab_size))
    for key, rows_of in (("input", G.input_rows), ("head", G.head_rows)):
        want = G.row_geometry(rows_of(tr.model, ids))
        assert {k: geo[key][k] for k in want} == pytest.approx(want, rel=1e-9), key
        assert [b["name"] for b in geo[key]["buckets"]] == list(buckets)
        unseen_ids = np.flatnonzero(counts[: tr.vocab_size] == 0)
        assert geo[key]["buckets"][0]["types"] == len(unseen_ids)
    (cos,) = acc.Scalars("eval/geometry/input/cosine")
    assert cos.step == STEPS and cos.value == pytest.approx(geo["input"]["cosine"], rel=1e-6)
    assert "token vectors" in p.stdout and "effective rank" in p.stdout


def test_wikitext_and_lambada_equal_a_plain_recomputation(run_copy, world, tmp_path, minipile_dir):
    import sentencepiece as spm

    lines = WIKI.read_text().splitlines(keepends=True)
    heads = [i for i, x in enumerate(lines) if x.startswith(" = ") and not x.startswith(" = = ")]
    small = tmp_path / "wiki.raw"
    small.write_text("".join(lines[: heads[3]]))  # three articles
    texts = read_jsonl_zst(minipile_dir / "val.jsonl.zst")
    lam = tmp_path / "lambada.jsonl"
    examples = [" ".join(t["text"].split()[:12]) for t in texts[:12] if len(t["text"].split()) > 12]
    lam.write_text(
        "\n".join([json.dumps({"text": t}) for t in examples] + ["not json", json.dumps({"text": "one"})]) + "\n"
    )
    run = run_copy("tied-tp2")
    p = evaluate("--run", run, "--no-heldout", "--wikitext", small, "--lambada", lam, "--context", 64)
    assert p.returncode == 0, p.stderr
    rep = json.loads((run / "eval" / f"global_step{STEPS}.json").read_text())
    tr = load_trained(run)
    sp = spm.SentencePieceProcessor(model_file=str(tr.tokenizer.path))
    eod = sp.eos_id()
    articles = ["".join(lines[a:b]) for a, b in zip(heads[:3], heads[1:4])]
    nats = sum(plain_losses(tr.model, np.array([eod, *sp.encode(a)]), tr.vocab_size, 64, 32).sum() for a in articles)
    w = rep["wikitext"]
    assert w["articles"] == 3 and w["words"] == sum(len(a.split()) for a in articles)
    assert w["tokens"] == sum(len(sp.encode(a)) for a in articles)
    ends = [[*range(32, len(sp.encode(a)), 32), len(sp.encode(a))] for a in articles]  # each window's last target
    inputs = sum(min(e, 64) for article in ends for e in article)  # its inputs: at most the context
    assert w["model_tokens_per_s"] == pytest.approx(w["tokens_per_s"] * inputs / w["tokens"], rel=0.01)
    assert abs(w["word_ppl"] - math.exp(nats / w["words"])) / w["word_ppl"] < 1e-4
    hits, word_nats = [], []
    for t in examples:
        ctx, word = t.rsplit(" ", 1)
        n = len(sp.encode(word))
        ids = [eod, *sp.encode(ctx)][-(64 + 1 - n) :] + sp.encode(word)  # a long context is cut from the left
        x = torch.tensor(ids[:-1])[None]
        with torch.no_grad():
            logp = torch.log_softmax(tr.model(x, torch.arange(x.shape[1])[None])[0, -n:, : tr.vocab_size], -1)
        tgt = torch.tensor(ids[-n:])
        word_nats.append(-logp.gather(1, tgt[:, None]).sum().item())
        hits.append(bool((logp.argmax(-1) == tgt).all()))
    la = rep["lambada"]
    assert la["examples"] == len(examples) and la["skipped"] == {"invalid json": 1, "fewer than two words": 1}
    assert la["accuracy"] == pytest.approx(np.mean(hits)) and la["ppl"] == pytest.approx(
        math.exp(np.mean(word_nats)), rel=1e-4
    )


def test_two_data_parallel_ranks_equal_one_process(run_copy, minipile_shards, tmp_path):
    """Also several runs in one process (a sweep): TIED then LEV on two ranks; LEV's report equals LEV alone."""
    run, before = run_copy("lev-tp2"), run_copy("tied-tp2")
    opts = ["--data", minipile_shards["val"], "--max-tokens", 2000, "--context", 32, "--no-tensorboard"]
    assert evaluate("--run", run, *opts, "--out", tmp_path / "one.json").returncode == 0
    run_ranks(["-m", "leviathan_pretrain.evaluate", "--run", str(before), str(run), *map(str, opts)], timeout=240)
    one = json.loads((tmp_path / "one.json").read_text())
    two, tied = (json.loads((r / "eval" / f"global_step{STEPS}.json").read_text()) for r in (run, before))
    assert two["settings"]["world"] == 2 and one["heldout"][0]["tokens"] == two["heldout"][0]["tokens"]
    assert abs(one["heldout"][0]["loss"] - two["heldout"][0]["loss"]) < 1e-9
    assert [b["tokens"] for b in one["frequency"]["buckets"]] == [b["tokens"] for b in two["frequency"]["buckets"]]
    assert (two["variant"], tied["variant"]) == ("lev", "tied") and tied["heldout"][0]["tokens"] == two["heldout"][0][
        "tokens"
    ]
    assert abs(tied["heldout"][0]["loss"] - two["heldout"][0]["loss"]) > 1e-3  # each run its own weights
    assert one["geometry"] == two["geometry"]  # read off the weights: the same on any number of ranks


def test_bad_input_is_one_clear_error(run_copy, tmp_path, minipile_shards, gpt2_tiktoken):
    empty = tmp_path / "empty-run"
    (empty / "checkpoints").mkdir(parents=True)
    p = evaluate_here("--run", empty)  # any exception but the one-line error would propagate here and fail the test
    assert p.returncode == 2 and p.stderr.startswith("error: ") and p.stderr.count("\n") == 1, p.stderr
    assert "no complete checkpoint" in p.stderr and str(empty / "checkpoints") in p.stderr
    run = run_copy("lev-tp2")
    p = evaluate_here("--run", run, "--step", 7)
    assert p.returncode == 2 and "no complete checkpoint at step 7" in p.stderr and f"global_step{STEPS}" in p.stderr
    other = tmp_path / "other.tiktoken"  # another real tokenizer (GPT-2's ranks): another fingerprint
    shutil.copy(gpt2_tiktoken, other)
    p = evaluate_here("--run", run, "--tokenizer", other, "--no-heldout", "--wikitext", WIKI)
    assert p.returncode == 2 and str(other) in p.stderr
    assert "differs from the tokenizer this run trained with" in p.stderr
    blank = tmp_path / "blank.raw"
    blank.write_text("\n\n   \n")
    p = evaluate_here("--run", run, "--no-heldout", "--wikitext", blank)
    assert p.returncode == 2 and str(blank) in p.stderr and "no article" in p.stderr
    p = evaluate_here("--run", run, "--data", tmp_path / "nope")
    assert p.returncode == 2 and "nope.bin: not found" in p.stderr
    p = evaluate_here("--run", run, run, "--out", tmp_path / "r.json")
    assert p.returncode == 2 and "--out names one report and 2 runs were given" in p.stderr
    # a checkpoint whose recorded config is not the one its weights were trained with
    meta = json.loads((run / "checkpoints" / f"global_step{STEPS}" / "leviathan.json").read_text())
    meta["config"]["model"]["hidden_size"] = 64
    (run / "checkpoints" / f"global_step{STEPS}" / "leviathan.json").write_text(json.dumps(meta))
    p = evaluate_here("--run", run, "--no-tensorboard")
    assert p.returncode == 2 and "another configuration" in p.stderr and p.stderr.count("\n") == 1
