"""Round trip on a real corpus: every document's tokens, read back with megatron-core's
IndexedDataset and detokenized, give back the input text exactly; counts and manifest agree."""

import dataclasses
import hashlib
import json

import numpy as np
import pytest
import sentencepiece as spm

from data_prep.manifest import Manifest


@pytest.fixture(scope="module")
def indexed_dataset():
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    return IndexedDataset


@pytest.mark.parametrize("split", ["train", "val"])
def test_every_document_round_trips(
    split, minipile_dir, tokenizer_model, minipile_shards, read_corpus, indexed_dataset
):
    src = minipile_dir / "train" / "00.jsonl.zst" if split == "train" else minipile_dir / "val.jsonl.zst"
    texts = [r["text"] for r in read_corpus(src)]
    ds = indexed_dataset(minipile_shards[split])
    assert len(ds) == len(texts) and ds.index.dtype == np.uint16
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_model))
    eod = sp.eos_id()
    docs = [ds[i] for i in range(len(ds))]
    assert all(len(d) >= 2 and d[-1] == eod and (d[:-1] != eod).all() for d in docs)
    decoded = sp.decode([d[:-1].tolist() for d in docs])
    bad = [i for i, (a, b) in enumerate(zip(decoded, texts)) if a != b]
    assert not bad, f"{len(bad)} documents differ after the round trip, first: #{bad[0]}"


def test_counts_and_manifest_agree_with_the_shard(minipile_dir, tokenizer_model, minipile_shards, read_corpus):
    prefix = minipile_shards["train"]
    m = json.loads(open(prefix + ".manifest.json").read())
    tokens = np.fromfile(prefix + ".bin", dtype=np.uint16)
    counts = np.load(prefix + ".counts.npy")
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_model))
    assert counts.dtype == np.int64 and counts.shape == (sp.vocab_size(),)
    assert (counts == np.bincount(tokens, minlength=sp.vocab_size())).all()
    recs = read_corpus(minipile_dir / "train" / "00.jsonl.zst")
    assert m["documents"] == len(recs) == counts[m["eod_id"]]
    assert m["tokens"] == len(tokens)
    assert m["eod_id"] == sp.eos_id() == 2 and m["tokenizer"]["eod_piece"] == "</s>"
    assert m["tokenizer"]["sha256"] == hashlib.sha256(tokenizer_model.read_bytes()).hexdigest()
    assert m["text_bytes"] == sum(len(r["text"].encode()) for r in recs)
    assert m["skipped"] == {} and m["dtype"] == "uint16"
    src = minipile_dir / "train" / "00.jsonl.zst"
    assert m["inputs"][0]["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
    assert m["inputs"][0]["bytes"] == src.stat().st_size
    by_set = {}
    for r in recs:
        by_set[r["meta"]["pile_set_name"]] = by_set.get(r["meta"]["pile_set_name"], 0) + 1
    assert {k: v["documents"] for k, v in m["sets"].items()} == by_set
    assert sum(v["tokens"] for v in m["sets"].values()) == m["tokens"]


def test_manifest_reads_back_as_written(minipile_shards):
    """The manifest file is Manifest.to_json(): same keys, same order, same values."""
    path = minipile_shards["train"] + ".manifest.json"
    text = open(path, encoding="utf-8").read()
    m = Manifest.from_json(json.loads(text))
    assert list(json.loads(text)) == [f.name for f in dataclasses.fields(Manifest)]
    assert json.dumps(m.to_json(), indent=1, ensure_ascii=False) + "\n" == text
    with pytest.raises(ValueError, match="manifest without"):
        Manifest.from_json({k: v for k, v in m.to_json().items() if k != "ranks"})


def test_tricky_text_round_trips(tokenizer_model):
    """Whitespace, code, control characters and characters absent from training decode exactly."""
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_model))
    samples = [
        "def f(x):\n\tif x:\r\n        return  x  \n\n\n",
        "   leading and trailing   ",
        "\n",
        " ",
        "a\u00a0b\u2003c",
        "tab\tand\x0bvt\x0cff\x00nul",
        "digits 1234567890 3.14159e-10",
        "emoji \U0001f600\U0001f469\u200d\U0001f52c ok",
        "CJK \u4e2d\u6587\u5b57 \ud55c\uad6d\uc5b4 \u0627\u0644\u0639\u0631\u0628\u064a\u0629",
        "combining e\u0301 vs \u00e9, ligature \ufb01, fullwidth \uff21",
    ]
    for s in samples:
        assert sp.decode(sp.encode(s)) == s, repr(s)
