"""The Hugging Face tokenizer export_hf writes, per tokenizer kind (``hf/tokenizer.py``): loaded back
with ``AutoTokenizer`` (no custom code, offline), it gives exactly the ids the shards were written with (the
library's own encoding, called directly) on every validation text and on edge cases, names the EOD as eos, puts
the special tokens at their own ids, adds no BOS / EOS, and decodes as ours does.

Kinds: a SentencePiece model; a byte-level BPE ``tokenizer.json`` (copied byte for byte) and the same with a
Llama-3-style post-processor that adds a BOS; tiktoken encodings: GPT-2's ranks (r50k), the published cl100k_base
(special tokens with gaps between their ids), cl100k's ranks under the o200k split pattern, and a 70k-id one."""

from __future__ import annotations

import json

import pytest

from data_prep.tokenizer import open_tokenizer
from tests.conftest import read_jsonl_zst
from tests.tokenizer_kinds import asset, reference_encoder

pytestmark = pytest.mark.timeout(300)

EDGE_TEXTS = [
    "Hello world",
    " leading space",
    "two  spaces,   three,\ttab and trailing   ",
    "lines\nand\n\nblank lines\r\nCRLF\n\n\n\n",
    " " * 33 + "\n" * 5 + "\t \t",
    "unicode: café naïve Ωμέγα 日本語 한국어 😀👍 ∑√∞ «quotes» — dash \u200b zero width",
    "digits 0123456789 3.14159 1,000,000 1913 20240131",
    "DON'T it's WE'LL they've",
    "<|endoftext|> as text, <|endoftext|>twice, <s> and </s>, <|fim_prefix|>",
    "",
    " ",
    "\n",
]

CASES = {
    "sentencepiece": ("tokenizer_model", None),
    "huggingface": ("bpe_tokenizer_json", None),
    "huggingface-bos": ("bpe_tokenizer_json", None),
    "tiktoken-gpt2": ("gpt2_tiktoken", "r50k"),
    "tiktoken-cl100k": ("cl100k", None),
    "tiktoken-cl100k-o200k-pattern": ("cl100k", "o200k"),
    "tiktoken-70k": ("big_tiktoken", "r50k"),
}


@pytest.fixture(scope="module")
def val_texts(minipile_dir):
    return [r["text"] for r in read_jsonl_zst(minipile_dir / "val.jsonl.zst")]


def _with_bos_post_processor(src, tmp_path):
    """``src`` with a ``<|begin_of_text|>`` special token and Llama 3's post-processor (BOS before every text),
    and a tokenizer_config.json naming it, as Llama 3's directory has."""
    from tokenizers import Tokenizer, processors

    tk = Tokenizer.from_file(str(src))
    tk.add_special_tokens(["<|begin_of_text|>"])
    bos = tk.token_to_id("<|begin_of_text|>")
    tk.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos)],
    )
    d = tmp_path / "llama-like"
    d.mkdir()
    tk.save(str(d / "tokenizer.json"))
    conf = {"bos_token": "<|begin_of_text|>", "eos_token": "<|endoftext|>"}
    (d / "tokenizer_config.json").write_text(json.dumps(conf))
    return d


@pytest.mark.parametrize("case", list(CASES))
def test_autotokenizer_gives_our_ids(case, request, val_texts, tmp_path):
    from transformers import AutoTokenizer

    from leviathan_pretrain.hf.tokenizer import write_tokenizer

    fixture, pattern = CASES[case]
    path = asset("cl100k_base.tiktoken") if fixture == "cl100k" else request.getfixturevalue(fixture)
    if case == "huggingface-bos":
        path = _with_bos_post_processor(path, tmp_path)
    tok = open_tokenizer(str(path), pattern, None)
    out = tmp_path / "hf"
    out.mkdir()
    record = write_tokenizer(tok, out)
    hf = AutoTokenizer.from_pretrained(str(out), local_files_only=True)

    kind = tok.kind
    # the library itself, as the shards were written
    encode, _, _ = reference_encoder(kind, tok.path, getattr(tok, "pat_str", None))
    texts = val_texts + EDGE_TEXTS
    assert any("\n" in t for t in val_texts) and any(ord(c) > 127 for t in val_texts for c in t)
    want = encode(texts)
    for text, ids in zip(texts, want):
        assert hf.encode(text) == list(ids), text[:200]
        assert hf(text)["input_ids"] == list(ids)  # nothing added: the training data has no BOS / EOS
    assert hf.eos_token_id == tok.eod_id and hf.eos_token == tok.eod_token
    for text, ids in list(zip(texts, want))[-len(EDGE_TEXTS) :] + list(zip(texts, want))[:5]:
        assert hf.decode(list(ids)) == tok.decode(ids), text[:200]

    if kind == "huggingface":
        src = json.loads(open(tok.path).read())
        if case == "huggingface-bos":  # the same file but the post-processor that adds the BOS
            assert record["post_processor_removed_ids"] == [tok.bos_id] and hf.bos_token_id == tok.bos_id
            assert json.loads((out / "tokenizer.json").read_text()) == {**src, "post_processor": None}
        else:
            assert record["post_processor_removed_ids"] == []
            assert (out / "tokenizer.json").read_bytes() == open(tok.path, "rb").read()
    if kind == "tiktoken":
        for s, i in tok.special_tokens.items():
            assert hf.convert_tokens_to_ids(s) == i, s  # cl100k's specials sit after a gap: at their own ids
            assert hf.decode([i]) == s
        assert record["tiktoken_pattern"] == (pattern or "cl100k") + "_base"
    if case == "tiktoken-cl100k":
        assert tok.special_tokens["<|endofprompt|>"] == 100276 and hf.convert_tokens_to_ids("<|endofprompt|>") == 100276
    if fixture == "big_tiktoken":
        assert tok.vocab_size == 70257 and hf.eos_token_id == hf.convert_tokens_to_ids("<|endoftext|>") == 70256


def test_possessive_bounded_repeats_are_converted_or_refused():
    from leviathan_pretrain.hf.tokenizer import ExportError, onig_pattern

    assert onig_pattern(r"\p{N}{1,3}+| ?\p{L}++|\s+") == r"\p{N}{1,3}| ?\p{L}++|\s+"
    assert onig_pattern(r"a|\p{N}{2}+") == r"a|\p{N}{2}"
    with pytest.raises(ExportError, match="possessive bounded repeat"):
        onig_pattern(r"\p{N}{1,3}+x|y")
