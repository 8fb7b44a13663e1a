"""The ``leviathan`` lm-evaluation-harness model on tiny trained runs, through the harness's own evaluator and CLI.

Tasks are built here from real minipile text (YAML configs over local jsonl files, ``dataset_path: json``); every
number the harness reports is recomputed independently from the model's logits with plain torch, one unpadded
sequence at a time: multiple choice (acc, acc_norm, per-choice log-likelihoods and greedy flags, one task with
choices that start mid-word), rolling log-likelihood (word/byte perplexity, bits per byte, with lm-eval's own
rolling windows as the reference plan) and greedy generation (a plain greedy loop). No network: HF datasets and
hub are offline and their cache lives in the test's temporary directory.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before datasets is imported: it reads these at import
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import sentencepiece as spm
import torch
import yaml
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from tests.conftest import REPO, read_jsonl_zst
from tests.trained import STEPS

GEN = {"until": ["."], "max_gen_toks": 12, "do_sample": False}


# ---------------------------------------------------------------- real text -> tasks


def sentences(minipile_dir, n: int) -> list[str]:
    """Prose sentences of 8-30 mostly alphabetic words from minipile val, in file order."""
    out = []
    for rec in read_jsonl_zst(minipile_dir / "val.jsonl.zst"):
        for s in re.split(r"(?<=[.!?])\s+", " ".join(rec["text"].split())):
            words = s.split()
            if 8 <= len(words) <= 30 and sum(w.isalpha() for w in words) >= 0.8 * len(words) and s not in out:
                out.append(s)
    assert len(out) >= n, f"only {len(out)} prose sentences in minipile val"
    return out[:n]


def write_task(d, name: str, rows: list[dict], **config) -> None:
    data = d / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}, "cache_dir": str(d / "hf_cache")},
        "test_split": "test",
        **config,
    }
    (d / f"{name}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))


@pytest.fixture(scope="module")
def tasks(tmp_path_factory, minipile_dir):
    """A directory of four tasks (lev_mc, lev_mc_midword, lev_ppl, lev_gen) over real minipile text."""
    d = tmp_path_factory.mktemp("lm_eval_tasks")
    sents = sentences(minipile_dir, 14)
    halves = [(" ".join(s.split()[: len(s.split()) // 2]), " ".join(s.split()[len(s.split()) // 2 :])) for s in sents]
    mc, mid = [], []
    for i in range(10):
        gold = i % 4
        others = [halves[(i + k) % len(halves)][1] for k in (1, 2, 3)]
        ctx = halves[i][0] if i else " ".join(sents[4:12]) + " " + halves[i][0]  # doc 0: longer than seq_length
        mc.append({"ctx": ctx, "choices": others[:gold] + [halves[i][1]] + others[gold:], "gold": gold})
        cut = len(halves[i][0]) + 4  # inside the second half's first word (or just after it)
        suffix = [sents[(i + k) % len(sents)][cut:] for k in (1, 2, 3)]
        mid.append({"ctx": sents[i][:cut], "choices": suffix[:gold] + [sents[i][cut:]] + suffix[gold:], "gold": gold})
    mc_cfg = {
        "output_type": "multiple_choice",
        "doc_to_text": "ctx",
        "doc_to_choice": "choices",
        "doc_to_target": "gold",
    }
    metrics = {"metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]}
    write_task(d, "lev_mc", mc, **mc_cfg, **metrics)
    write_task(d, "lev_mc_midword", mid, **mc_cfg, **metrics, target_delimiter="")
    records = read_jsonl_zst(minipile_dir / "val.jsonl.zst")
    texts = [records[k]["text"][:n] for k, n in ((3, 40), (4, 900), (5, 2500), (6, 1))]  # 1 to ~4 windows
    ppl = [{"text": t} for t in texts]
    metrics = {"metric_list": [{"metric": m} for m in ("word_perplexity", "byte_perplexity", "bits_per_byte")]}
    write_task(d, "lev_ppl", ppl, output_type="loglikelihood_rolling", doc_to_text="", doc_to_target="text", **metrics)
    prompts = [h[0] for h in halves[:5]] + [" ".join(sents[:10])]  # the last one is longer than seq_length
    gen = [{"prompt": p, "target": "x"} for p in prompts]
    write_task(
        d,
        "lev_gen",
        gen,
        output_type="generate_until",
        doc_to_text="prompt",
        doc_to_target="target",
        generation_kwargs=GEN,
        metric_list=[{"metric": "exact_match"}],
    )
    return d


# ---------------------------------------------------------------- the independent reference


class Reference:
    """Plain torch on one unpadded sequence at a time; tokenization written out from the documented rules."""

    def __init__(self, run):
        from leviathan_pretrain.evaluation.load import load_trained

        self.t = load_trained(run)
        self.sp = spm.SentencePieceProcessor(model_file=str(self.t.tokenizer.path))
        self.eos = self.sp.eos_id()
        self.L = self.t.cfg.model.seq_length

    def logp(self, ids: list[int]) -> torch.Tensor:
        from leviathan_pretrain.evaluation.scoring import logits_for

        logits = logits_for(self.t.model, torch.tensor([ids]), self.t.vocab_size)[0]
        return torch.log_softmax(logits.double(), dim=-1)

    def pair(self, context: str, continuation: str):
        stripped = context.rstrip()
        context, continuation = stripped, context[len(stripped) :] + continuation
        ctx = self.sp.encode(context) if context else []
        whole = self.sp.encode(context + continuation)
        cont = whole[len(ctx) :] if whole[: len(ctx)] == ctx else self.sp.encode(continuation)
        return [self.eos, *ctx], cont

    def scored(self, context_ids: list[int], pred: list[int]) -> tuple[float, bool]:
        """Log-probability of ``pred`` after ``context_ids`` (the last seq_length inputs), and all-greedy."""
        inp = (context_ids + pred)[-(self.L + 1) :][:-1]
        logp = self.logp(inp)[len(inp) - len(pred) :]
        return float(sum(logp[i, t] for i, t in enumerate(pred))), all(
            int(logp[i].argmax()) == t for i, t in enumerate(pred)
        )

    def loglikelihood(self, context: str, continuation: str) -> tuple[float, bool]:
        ctx, cont = self.pair(context, continuation)
        if len(cont) <= self.L:
            return self.scored(ctx, cont)
        # no window holds the continuation: its share of lm-eval's rolling windows over the whole sequence
        seq, per_target = ctx + cont, []
        for w in get_rolling_token_windows(seq[1:], prefix_token=seq[0], max_seq_len=self.L, context_len=1):
            context_ids, pred = make_disjoint_window(w)
            inp = (context_ids + pred)[-(self.L + 1) :][:-1]
            logp = self.logp(inp)[len(inp) - len(pred) :]
            per_target += [(float(logp[i, t]), int(logp[i].argmax()) == t) for i, t in enumerate(pred)]
        tail = per_target[-len(cont) :]
        return sum(x[0] for x in tail), all(x[1] for x in tail)

    def rolling(self, tokens: list[int]) -> float:
        """lm-eval's own rolling windows (utils.get_rolling_token_windows, disjoint) after EOS."""
        windows = get_rolling_token_windows(tokens, prefix_token=self.eos, max_seq_len=self.L, context_len=1)
        return sum(self.scored(*make_disjoint_window(w))[0] for w in windows)

    def generate(self, prompt: str, until: list[str], max_new: int) -> str:
        seq, gen = [self.eos, *self.sp.encode(prompt)], []
        for _ in range(max_new):
            token = int(self.logp((seq + gen)[-self.L :])[-1].argmax())
            if token == self.eos:
                break
            gen.append(token)
            if any(s in self.sp.decode(gen) for s in until):
                break
        text = self.sp.decode(gen)
        for s in until:
            text = text.split(s)[0]
        return text


def mc_metrics(ref: Reference, samples: list[dict]) -> dict:
    """acc / acc_norm from independent log-likelihoods of the (context, continuation) pairs the harness sent;
    checks each logged response against them on the way."""
    acc, acc_norm = [], []
    for s in samples:
        lls = []
        for (context, continuation), (ll, greedy) in zip(s["arguments"], s["filtered_resps"], strict=True):
            want_ll, want_greedy = ref.loglikelihood(context, continuation)
            assert ll == pytest.approx(want_ll, abs=1e-3), (context, continuation)
            assert greedy == want_greedy
            lls.append(want_ll)
        choices, gold = s["doc"]["choices"], s["doc"]["gold"]
        acc.append(float(max(range(len(lls)), key=lambda i: lls[i]) == gold))
        acc_norm.append(float(max(range(len(lls)), key=lambda i: lls[i] / len(choices[i])) == gold))
    return {"acc": sum(acc) / len(acc), "acc_norm": sum(acc_norm) / len(acc_norm)}


@pytest.fixture(scope="module")
def lev_run(trained_run):
    return trained_run("lev-tp2")


# ---------------------------------------------------------------- tests


def test_encode_pair_keeps_the_continuation_exact(tokenizer_model, tmp_path):
    """The scored tokens are the continuation's: the tail of the full text's tokens where no piece spans the
    boundary, the continuation's own tokens where one does; context whitespace moves to the continuation; an
    empty context is EOS alone. A dummy-prefix tokenizer keeps lm-eval's tail (no spurious space)."""
    from data_prep.tokenizer import open_tokenizer
    from leviathan_pretrain.evaluation.lm_eval_adapter import encode_pair

    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_model))
    tok = open_tokenizer(str(tokenizer_model))  # the interface encode_pair takes; sp is the reference
    eos = sp.eos_id()
    assert not tok.adds_prefix_space() and tok.eod_id == eos
    cases = [
        ("The cat sat on the", " mat."),
        ("The cat sat on the ", "mat."),
        ("Question: what is it?\nAnswer:", " a dictionary"),
        ("It was a dark and storm", "y night"),
        ("x", "yzzy"),
        ("", "Hello world"),
        ("The answer is", ""),
    ]
    crossed = 0
    for context, continuation in cases:
        ctx, cont = encode_pair(tok, context, continuation, eos)
        assert ctx[0] == eos and eos not in cont
        assert sp.decode(ctx[1:]) + sp.decode(cont) == context + continuation
        assert sp.decode(cont) == context[len(context.rstrip()) :] + continuation
        crossed += sp.encode(context + continuation)[: len(ctx) - 1] != ctx[1:]
    assert encode_pair(tok, "", "Hello world", eos) == ([eos], sp.encode("Hello world"))
    assert encode_pair(tok, "The cat", " sat", eos) == ([eos, *sp.encode("The cat")], sp.encode(" sat"))
    assert crossed >= 1  # the mid-word cases do cross a piece boundary with this tokenizer

    text = ["The quick brown fox jumps over the lazy dog.", "Hello world, this is a test.", "More words here."] * 40
    model = tmp_path / "dummy.model"
    with open(model, "wb") as f:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(text),
            model_writer=f,
            vocab_size=200,
            hard_vocab_limit=False,
            add_dummy_prefix=True,
            minloglevel=3,
        )
    dummy = spm.SentencePieceProcessor(model_file=str(model))
    dummy_tok = open_tokenizer(str(model))
    assert dummy_tok.adds_prefix_space()
    for context, continuation in (("The quick brown", " fox jumps"), ("The quick bro", "wn fox")):
        ctx, cont = encode_pair(dummy_tok, context, continuation, dummy.eos_id())
        whole = dummy.encode(context + continuation)
        assert ctx[1:] == dummy.encode(context) and cont == whole[len(ctx) - 1 :]


def test_harness_tasks_match_plain_torch(lev_run, tasks):
    """simple_evaluate over the four tasks; every reported metric equals the independent computation."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    import leviathan_pretrain.evaluation.lm_eval_adapter  # noqa: F401
    from leviathan_pretrain.evaluation.load import eval_world

    out = lm_eval.simple_evaluate(
        model="leviathan",
        model_args=f"run={lev_run},batch_size=3",
        tasks=["lev_mc", "lev_mc_midword", "lev_ppl", "lev_gen"],
        task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True,
    )
    res, samples = out["results"], out["samples"]
    assert out["config"]["leviathan_step"] == STEPS and out["config"]["model_variant"] == "lev"
    with eval_world("cpu"):
        ref = Reference(lev_run)
        for name in ("lev_mc", "lev_mc_midword"):
            assert len(samples[name]) == 10
            want = mc_metrics(ref, samples[name])
            assert res[name]["acc,none"] == pytest.approx(want["acc"], abs=1e-12), name
            assert res[name]["acc_norm,none"] == pytest.approx(want["acc_norm"], abs=1e-12), name
        # the long context was cut from the left; some mid-word choice crossed a piece boundary
        assert len(ref.pair(*samples["lev_mc"][0]["arguments"][0])[0]) > ref.L
        crossed = [
            c
            for s in samples["lev_mc_midword"]
            for c in s["arguments"]
            if ref.sp.encode(c[0] + c[1])[: len(ref.sp.encode(c[0]))] != ref.sp.encode(c[0])
        ]
        assert crossed

        lls, words, nbytes = 0.0, 0, 0
        lengths = []
        for s in samples["lev_ppl"]:
            text = s["doc"]["text"]
            tokens = ref.sp.encode(text)
            lengths.append(len(tokens))
            want = ref.rolling(tokens)
            assert s["filtered_resps"][0] == pytest.approx(want, abs=1e-3)
            lls, words, nbytes = lls + want, words + len(re.split(r"\s+", text)), nbytes + len(text.encode())
        assert max(lengths) > 3 * ref.L and min(lengths) <= 1  # several windows, and a one-token text
        assert res["lev_ppl"]["word_perplexity,none"] == pytest.approx(math.exp(-lls / words), rel=1e-6)
        assert res["lev_ppl"]["byte_perplexity,none"] == pytest.approx(math.exp(-lls / nbytes), rel=1e-6)
        assert res["lev_ppl"]["bits_per_byte,none"] == pytest.approx(-lls / nbytes / math.log(2), rel=1e-6)

        got = [s["filtered_resps"][0] for s in samples["lev_gen"]]
        want = [ref.generate(s["doc"]["prompt"], GEN["until"], GEN["max_gen_toks"]) for s in samples["lev_gen"]]
        assert got == want
        assert any(got) and len(ref.sp.encode(samples["lev_gen"][-1]["doc"]["prompt"])) > ref.L
    print(json.dumps({k: v for k, v in res.items()}, indent=1))


def test_cli_entry_point(lev_run, tasks, tmp_path):
    """``python -m leviathan_pretrain.lm_eval`` with lm_eval's arguments: exit 0, the table, the JSON results."""
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_DATASETS_CACHE=str(tmp_path / "hf"), HF_HOME=str(tmp_path / "hf"))
    args = ["--model", "leviathan", "--model_args", f"run={lev_run},batch_size=4", "--tasks", "lev_mc,lev_ppl"]
    args += ["--include_path", str(tasks), "--output_path", str(tmp_path / "out")]
    p = subprocess.run(
        [sys.executable, "-m", "leviathan_pretrain.lm_eval", *args],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
        cwd=REPO,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    assert re.search(r"\|\s*Tasks\s*\|", p.stdout) and "lev_mc" in p.stdout and "word_perplexity" in p.stdout
    assert "leviathan (" in p.stdout, p.stdout
    files = list((tmp_path / "out").rglob("results_*.json"))
    assert len(files) == 1, files
    results = json.loads(files[0].read_text())["results"]
    assert 0.0 <= results["lev_mc"]["acc,none"] <= 1.0 and results["lev_ppl"]["word_perplexity,none"] > 1.0
    # (without --device the CLI sends device=cuda:0: on a CPU-only machine the model falls back to the CPU)


def test_two_adapters_args_and_long_continuations(lev_run, trained_run):
    """Two adapters in one process (one TIED run, batch 3, max_length 64): both score like the reference, the
    second survives the first's close; model_args win over the harness's defaults; long continuations slide;
    bad arguments fail clearly."""
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model, model_registry

    from leviathan_pretrain.evaluation.lm_eval_adapter import LeviathanLM
    from leviathan_pretrain.evaluation.load import EvalError, eval_world

    assert get_model("leviathan") is LeviathanLM and "hf" in model_registry  # lm-eval's own models still there
    tied = trained_run("tied-tp2")
    a = LeviathanLM.create_from_arg_string(f"run={lev_run},step={STEPS}", {"batch_size": 1, "device": "cuda:0"})
    b = LeviathanLM.create_from_arg_obj({"run": str(tied), "batch_size": 3, "max_length": 64}, {"batch_size": 1})
    assert a.batch_size == 1 and b.batch_size == 3 and b.max_length == 64
    assert a.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert a.trained.variant == "lev" and b.trained.variant == "tied"
    long_text = " ".join(["the history of the world is long and full of words"] * 12)  # > 64 tokens
    pairs = [("The cat sat on the", " mat."), ("", "Hello there."), ("A B C", " D E F"), ("Once upon a", long_text)]
    reqs = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    got_a, got_b = a.loglikelihood(reqs, disable_tqdm=True), b.loglikelihood(reqs, disable_tqdm=True)
    a.close()
    again = b.loglikelihood(reqs, disable_tqdm=True)  # b still works after a left the shared world
    assert again == got_b
    rolling = b.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (long_text,), 0)], disable_tqdm=True)
    prompts = ["import os\nimport", "The cat sat on the", "1. To remove, as f", "\n\n\n", long_text]
    kwargs = {"until": ["\n\n"], "max_gen_toks": 10}
    generated = b.generate_until([Instance("generate_until", {}, (p, dict(kwargs)), 0) for p in prompts], True)
    with eval_world("cpu"):
        ra, rb = Reference(lev_run), Reference(tied)
        rb.L = 64
        assert len(ra.pair(*pairs[-1])[1]) > ra.L  # the long continuation is longer than both windows
        for pair, got_pair, ref in ((p, g, r) for r, got in ((ra, got_a), (rb, got_b)) for p, g in zip(pairs, got)):
            want = ref.loglikelihood(*pair)
            assert got_pair[0] == pytest.approx(want[0], abs=1e-3) and got_pair[1] == want[1], pair
        assert rolling[0] == pytest.approx(rb.rolling(rb.sp.encode(long_text)), abs=1e-3)
        assert generated == [rb.generate(p, kwargs["until"], kwargs["max_gen_toks"]) for p in prompts]
        assert len(set(generated)) > 1, generated  # the TIED run's greedy output depends on the prompt
    b.close()

    with pytest.raises(EvalError, match="no such run directory"):
        LeviathanLM(run=str(lev_run) + "-missing")
    with pytest.raises(EvalError, match="no complete checkpoint at step 7"):
        LeviathanLM(run=str(lev_run), step=7)
    with pytest.raises(ValueError, match="max_length"):
        LeviathanLM(run=str(lev_run), max_length=4096)
    with pytest.raises(TypeError):
        LeviathanLM.create_from_arg_string(f"run={lev_run},pretrained=gpt2")
