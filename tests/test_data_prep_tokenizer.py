"""train_tokenizer: exact vocabulary sizes (50k, 100k, 200k), BPE and unigram, a seeded bounded
sample, provenance, and a clear error when the sample cannot support the vocabulary."""

import hashlib
import json

import pytest
import sentencepiece as spm

from data_prep.tokenizer_sample import Reservoir


def _train(run_cli, src, out, *extra, timeout=300):
    return run_cli("data_prep.train_tokenizer", "--input", *src, "--output", out, *map(str, extra), timeout=timeout)


def _check_model(path, vocab, model_type="bpe"):
    sp = spm.SentencePieceProcessor(model_file=str(path))
    assert sp.vocab_size() == vocab
    assert (sp.unk_id(), sp.bos_id(), sp.eos_id(), sp.pad_id()) == (0, 1, 2, -1)
    assert all(sp.piece_to_id(f"<0x{b:02X}>") != 0 for b in range(256))  # byte fallback pieces
    meta = json.loads((path.parent / "tokenizer_meta.json").read_text())
    assert meta["vocab_size"] == vocab and meta["eod_id"] == 2
    assert meta["model_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    s = meta["trainer_settings"]
    assert s["model_type"] == model_type and s["byte_fallback"] and s["split_digits"]
    assert s["normalization_rule_name"] == "identity" and not s["remove_extra_whitespaces"]
    return sp, meta


@pytest.mark.timeout(300)
@pytest.mark.parametrize("vocab, sample_mb", [(50000, 2), (100000, 4)])
def test_large_vocabularies_come_out_exact(vocab, sample_mb, minipile_dir, run_cli, tmp_path):
    src = [minipile_dir / "train" / "00.jsonl.zst"]
    _train(run_cli, src, tmp_path, "--vocab-size", vocab, "--sample-bytes", sample_mb)
    sp, meta = _check_model(tmp_path / "tokenizer.model", vocab)
    assert meta["sample"]["bytes"] <= sample_mb * 1e6 and meta["sample"]["documents"] > 10
    assert sp.decode(sp.encode("    return {'a': 1}\n")) == "    return {'a': 1}\n"


def test_200k_vocabulary_comes_out_exact(tokenizer_model_200k):
    sp, meta = _check_model(tokenizer_model_200k, 200000)
    assert sp.encode("12345") == [sp.piece_to_id(c) for c in "12345"]  # digits split
    assert meta["sample"]["bytes"] <= 12e6


def test_too_small_a_sample_says_how_much_it_supports(minipile_dir, run_cli, tmp_path):
    p = run_cli(
        "data_prep.train_tokenizer",
        "--input",
        minipile_dir / "val.jsonl.zst",
        "--output",
        tmp_path,
        "--vocab-size",
        100000,
        "--sample-bytes",
        1,
        check=False,
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --vocab-size 100000 is too large for this sample") and "--sample-bytes" in last
    assert not (tmp_path / "tokenizer.model").exists()


def test_unigram_and_provenance(minipile_dir, run_cli, tmp_path, read_corpus):
    src = minipile_dir / "val.jsonl.zst"
    _train(
        run_cli, [src], tmp_path, "--vocab-size", 2000, "--sample-bytes", 0.5, "--model-type", "unigram", "--seed", 3
    )
    sp, meta = _check_model(tmp_path / "tokenizer.model", 2000, "unigram")
    texts = [r["text"] for r in read_corpus(src)]
    assert sp.decode(sp.encode(texts)) == texts
    inp = meta["inputs"][0]
    assert inp["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest() and inp["documents"] == len(texts)
    smp = meta["sample"]
    assert smp["seed"] == 3 and smp["documents_seen"] == len(texts)
    assert sum(smp["sets"].values()) == smp["documents"] <= len(texts)


def test_same_seed_same_model_other_seed_other_sample(minipile_dir, run_cli, tmp_path):
    src = [minipile_dir / "val.jsonl.zst", minipile_dir / "test.jsonl.zst"]
    metas = []
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        _train(run_cli, src, tmp_path / name, "--vocab-size", 1000, "--sample-bytes", 0.4, "--seed", seed)
        metas.append(json.loads((tmp_path / name / "tokenizer_meta.json").read_text()))
    assert (tmp_path / "a" / "tokenizer.model").read_bytes() == (tmp_path / "b" / "tokenizer.model").read_bytes()
    assert metas[0]["sample"]["sha256"] == metas[1]["sample"]["sha256"] != metas[2]["sample"]["sha256"]
    p = run_cli(
        "data_prep.train_tokenizer", "--input", *src, "--output", tmp_path / "a", "--vocab-size", 1000, check=False
    )
    assert p.returncode == 2 and "already exists" in p.stderr


def test_preset_filters_the_sample(tmp_path, run_cli):
    src = tmp_path / "mix.jsonl"
    with open(src, "w") as f:
        for i in range(300):
            for name in ("Books3", "Github", "OpenWebText2"):
                f.write(
                    json.dumps(
                        {"text": f"{name} document {i} " + "lorem ipsum dolor " * 20, "meta": {"pile_set_name": name}}
                    )
                    + "\n"
                )
    _train(run_cli, [src], tmp_path / "tok", "--vocab-size", 300, "--preset", "pile-uncopyrighted")
    meta = json.loads((tmp_path / "tok" / "tokenizer_meta.json").read_text())
    assert list(meta["sample"]["sets"]) == ["Github"]
    assert meta["inputs"][0]["filtered_sets"] == {"Books3": 300, "OpenWebText2": 300}


def test_reservoir_is_seeded_bounded_and_uniform():
    def sample(seed, budget=10_000):
        r = Reservoir(budget, max_doc=1000, seed=seed)
        for i in range(5000):
            r.offer((0, i), b"x" * (50 + i % 100), None)
        return r

    a, b, c = sample(0), sample(0), sample(1)
    order = [o for o, _, _ in a.sample()]
    assert order == sorted(order) and order == [o for o, _, _ in b.sample()] != [o for o, _, _ in c.sample()]
    assert 9_000 < a.bytes <= 10_000 and a.seen_docs == 5000
    # roughly uniform over the input: each fifth of the stream holds about a fifth of the sample
    picks = [o[1] for o, _, _ in sample(5, budget=100_000).sample()]
    fifths = [sum(1 for p in picks if k * 1000 <= p < (k + 1) * 1000) for k in range(5)]
    assert min(fifths) > 0.7 * len(picks) / 5 and max(fifths) < 1.3 * len(picks) / 5
    # long documents contribute a bounded window
    r = Reservoir(10**6, max_doc=100, seed=0)
    r.offer((0, 0), b"line\n" * 1000, None)
    assert len(r.sample()[0][1]) <= 100


def test_overlong_records_are_skipped_when_sampling(run_cli, tmp_path):
    src = tmp_path / "in.jsonl"
    lines = [json.dumps({"text": f"document {i} " + "lorem ipsum dolor " * 20}) for i in range(300)]
    lines.insert(150, json.dumps({"text": "x" * 3_000_000}))
    src.write_text("\n".join(lines) + "\n")
    _train(run_cli, [src], tmp_path / "tok", "--vocab-size", 300, "--max-record-bytes", 1)
    meta = json.loads((tmp_path / "tok" / "tokenizer_meta.json").read_text())
    assert meta["inputs"][0]["skipped"] == {"record_too_long": 1} and meta["inputs"][0]["documents"] == 300
    assert meta["sample"]["max_record_bytes"] == 1_000_000


@pytest.mark.timeout(300)
def test_kind_bpe_writes_a_byte_level_tokenizer_json(minipile_dir, run_cli, read_corpus, tmp_path):
    """--kind bpe: exactly --vocab-size ids, <|endoftext|> the EOD, every text decodes back exactly, the same sample
    as SentencePiece's (same seed), data_prep reads it as a Hugging Face tokenizer; too small a sample is an error."""
    from tokenizers import Tokenizer

    from data_prep.tokenizer import open_tokenizer

    src = [minipile_dir / "train" / "00.jsonl.zst"]
    _train(run_cli, src, tmp_path / "bpe", "--kind", "bpe", "--vocab-size", 3000, "--sample-bytes", 2)
    path = tmp_path / "bpe" / "tokenizer.json"
    tk = Tokenizer.from_file(str(path))
    assert tk.get_vocab_size(with_added_tokens=True) == 3000
    meta = json.loads((tmp_path / "bpe" / "tokenizer_meta.json").read_text())
    assert meta["kind"] == "bpe" and meta["vocab_size"] == 3000 and meta["eod_piece"] == "<|endoftext|>"
    assert meta["eod_id"] == tk.token_to_id("<|endoftext|>")
    assert meta["model_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    texts = [r["text"] for r in read_corpus(minipile_dir / "val.jsonl.zst")[:40]]
    texts += ["    return {'a': 1}\n", "unicode: Grüße 東京 🙂\r\n\t  x  ", "<|endoftext|> in text"]
    for t in texts:
        assert tk.decode(tk.encode(t, add_special_tokens=False).ids, skip_special_tokens=False) == t
    tok = open_tokenizer(str(tmp_path / "bpe"))
    assert (tok.kind, tok.vocab_size, tok.eod_id) == ("huggingface", 3000, meta["eod_id"])
    # the same seeded sample as a SentencePiece run
    _train(run_cli, src, tmp_path / "sp", "--vocab-size", 3000, "--sample-bytes", 2)
    sp_meta = json.loads((tmp_path / "sp" / "tokenizer_meta.json").read_text())
    assert sp_meta["sample"]["sha256"] == meta["sample"]["sha256"]
    p = run_cli(
        "data_prep.train_tokenizer",
        *("--kind", "bpe", "--input", *src, "--output", tmp_path / "big", "--vocab-size", 500000),
        *("--sample-bytes", 0.2),
        check=False,
    )
    assert p.returncode == 2 and "raise --sample-bytes" in p.stderr.strip().splitlines()[-1], p.stderr
    assert not (tmp_path / "big" / "tokenizer.json").exists()
