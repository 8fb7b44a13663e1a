"""Every tokenizer kind through data_prep.tokenize: a Hugging Face tokenizer.json (a byte-level BPE trained here), a
real published tiktoken vocabulary (GPT-2's ranks, shipped in the openai-whisper package), a test-made ranks file
with more than 65,536 ids (int32 shards). For each: 1 worker, 2 workers and --mpi give the same bytes; megatron-core
reads back exactly the library's own encoding plus the EOD; counts sum to the tokens; the manifest names the kind."""

import filecmp
import hashlib
import json
import shutil

import numpy as np
import pytest

from tests.test_data_prep_badinput import _assert_one_line_error
from tests.test_data_prep_mpi import MPIRUN, mpirun
from tests.tokenizer_kinds import reference_encoder

KINDS = {
    # name: (fixture, kind, extra args, dtype)
    "huggingface": ("bpe_tokenizer_json", "huggingface", [], np.uint16),
    "tiktoken-gpt2": ("gpt2_tiktoken", "tiktoken", [], np.uint16),
    "tiktoken-70k": ("big_tiktoken", "tiktoken", ["--tiktoken-pattern", "r50k"], np.int32),
}


@pytest.fixture(scope="module")
def inputs(minipile_dir, read_corpus, tmp_path_factory):
    """Two jsonl inputs (so both MPI ranks get work): minipile val's first 250 records and train's first 150, plus
    text that looks like a special token, unicode, and runs of spaces and newlines."""
    d = tmp_path_factory.mktemp("kinds_in")
    recs = read_corpus(minipile_dir / "val.jsonl.zst")[:250]
    recs += [{"text": t, "meta": {"pile_set_name": "edge"}} for t in EDGE]
    other = read_corpus(minipile_dir / "train" / "00.jsonl.zst")[:150]
    paths = []
    for k, part in enumerate((recs, other)):
        p = d / f"in{k}.jsonl"
        p.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in part))
        paths.append(p)
    return paths, [r["text"] for r in recs + other]


EDGE = [
    "<|endoftext|> is text here, not the special token </s> <s>",
    "unicode: Grüße, 東京, emoji 🙂🙃, Ελληνικά, \u0301combining",
    "runs:     four spaces\n\n\n\nfour newlines\t\ttabs \r\n crlf   ",
    "digits 1234567890 3.14159 1,000,000",
    "  leading, trailing and   inner spaces  ",
]


@pytest.mark.multiproc
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(KINDS))
def test_each_kind_tokenizes_to_the_library_encoding(name, inputs, request, run_cli, tmp_path):
    assert MPIRUN
    fixture, kind, extra, dtype = KINDS[name]
    tok = request.getfixturevalue(fixture)
    paths, texts = inputs
    args = ["--input", *paths, "--tokenizer", tok, *extra, "--no-progress"]
    for workers in (1, 2):
        run_cli("data_prep.tokenize", *args, "--workers", workers, "--output-prefix", tmp_path / f"w{workers}")
    rc, log = mpirun([*args, "--workers", 1, "--output-prefix", tmp_path / "mpi"], timeout=300)
    assert rc == 0, log
    for ext in (".bin", ".idx", ".counts.npy"):
        for other in ("w2", "mpi"):
            assert filecmp.cmp(tmp_path / f"w1{ext}", tmp_path / f"{other}{ext}", shallow=False), (other, ext)

    from megatron.core.datasets.indexed_dataset import IndexedDataset

    encode, eod, vocab = reference_encoder(kind, tok)
    ds = IndexedDataset(str(tmp_path / "w1"))
    assert ds.index.dtype == dtype and len(ds) == len(texts)
    want = [ids + [eod] for ids in encode(texts)]
    got = [ds[i].tolist() for i in range(len(ds))]
    assert got == want
    if dtype == np.int32:
        assert max(max(g) for g in got) > 65535  # ids only an int32 shard holds
    m = json.loads((tmp_path / "w1.manifest.json").read_text())
    counts = np.load(tmp_path / "w1.counts.npy")
    assert counts.shape == (vocab,) and counts.sum() == m["tokens"] == sum(map(len, want))
    assert m["documents"] == len(texts) and counts[eod] == sum(w.count(eod) for w in want)
    # text that looks like a special token: tiktoken's ordinary encoding keeps it text; the tokenizers library
    # always matches added tokens (Megatron-LM and transformers write the same)
    in_text = want[texts.index(EDGE[0])].count(eod)
    assert in_text == (2 if kind == "huggingface" else 1)
    t = m["tokenizer"]
    assert t["kind"] == kind and t["eod_id"] == eod == m["eod_id"] and t["eod_piece"] == "<|endoftext|>"
    assert t["sha256"] == hashlib.sha256(tok.read_bytes()).hexdigest() and len(t["fingerprint"]) == 64
    assert m["dtype"] == np.dtype(dtype).name


def test_a_tokenizer_directory_and_a_tiktoken_cache_name_are_accepted(
    bpe_tokenizer_json, gpt2_tiktoken, inputs, tokenize, tmp_path
):
    src = inputs[0][0]
    tokenize(src, bpe_tokenizer_json.parent, tmp_path / "dir")
    tokenize(src, bpe_tokenizer_json, tmp_path / "file")
    assert filecmp.cmp(tmp_path / "dir.bin", tmp_path / "file.bin", shallow=False)
    # tiktoken:NAME is the file tiktoken's cache holds under sha1(url); missing: one error naming both
    cache = tmp_path / "cache"
    cache.mkdir()
    env = {"TIKTOKEN_CACHE_DIR": str(cache)}
    p = tokenize(src, "tiktoken:r50k_base", tmp_path / "named", env=env, check=False)
    url = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
    cached = cache / hashlib.sha1(url.encode()).hexdigest()
    _assert_one_line_error(p, str(cached), url, "nothing is downloaded")
    shutil.copy(gpt2_tiktoken, cached)
    tokenize(src, "tiktoken:r50k_base", tmp_path / "named", env=env)
    tokenize(src, gpt2_tiktoken, tmp_path / "path")
    assert filecmp.cmp(tmp_path / "named.bin", tmp_path / "path.bin", shallow=False)
    assert json.loads((tmp_path / "named.manifest.json").read_text())["tokenizer"]["pattern"] == "r50k_base"


def test_bad_tokenizers_are_one_line_errors(
    bpe_tokenizer_json, gpt2_tiktoken, big_tiktoken, inputs, tokenize, tmp_path
):
    src, prefix = inputs[0][0], tmp_path / "out"
    junk = tmp_path / "vocab.txt"
    junk.write_text("neither a SentencePiece model, nor tokenizer.json, nor ranks\n")
    p = tokenize(src, junk, prefix, check=False)
    _assert_one_line_error(p, str(junk), "SentencePiece", "tokenizer.json", "tiktoken")
    # a ranks file that is no published encoding needs its pattern
    p = tokenize(src, big_tiktoken, prefix, check=False)
    _assert_one_line_error(p, "--tiktoken-pattern", "o200k")
    p = tokenize(src, big_tiktoken, prefix, "--tiktoken-pattern", "gpt5", check=False)
    _assert_one_line_error(p, "unknown", "cl100k")
    # named like a published encoding but a different file
    fake = tmp_path / "o200k_base.tiktoken"
    shutil.copy(big_tiktoken, fake)
    p = tokenize(src, fake, prefix, check=False)
    _assert_one_line_error(p, "o200k_base", "sha256", "--tiktoken-pattern")
    # a damaged ranks line names the file and line
    bad = tmp_path / "bad.tiktoken"
    lines = gpt2_tiktoken.read_text().splitlines()
    bad.write_text("\n".join(lines[:10] + ["IQ== not-a-rank"] + lines[10:20]) + "\n")
    p = tokenize(src, bad, prefix, "--tiktoken-pattern", "r50k", check=False)
    _assert_one_line_error(p, f"{bad}:11")
    p = tokenize(src, bpe_tokenizer_json, prefix, "--tiktoken-pattern", "r50k", check=False)
    _assert_one_line_error(p, "huggingface", "--tiktoken-pattern")
    p = tokenize(src, bpe_tokenizer_json, prefix, "--eod-token", "<|nope|>", check=False)
    _assert_one_line_error(p, "<|nope|>", "not in the vocabulary")
    p = tokenize(src, gpt2_tiktoken, prefix, "--eod-token", "<|nope|>", check=False)
    _assert_one_line_error(p, "<|nope|>", "<|endoftext|>")
    broken = tmp_path / "tokenizer.json"
    broken.write_text('{"version": "1.0", "model": ')
    p = tokenize(src, broken, prefix, check=False)
    _assert_one_line_error(p, str(broken), "not a Hugging Face tokenizer.json")
    assert not list(tmp_path.glob("out.*"))


def test_eod_token_overrides_and_a_changed_tokenizer_is_not_reused(bpe_tokenizer_json, inputs, tokenize, tmp_path):
    src = inputs[0][0]
    d = tmp_path / "tok"
    d.mkdir()
    shutil.copy(bpe_tokenizer_json, d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))
    tokenize(src, d, tmp_path / "a", "--keep-work")
    # the same tokenizer with one more added token is another tokenizer: the kept part is redone, not reused
    from tokenizers import Tokenizer

    tk = Tokenizer.from_file(str(d / "tokenizer.json"))
    tk.add_special_tokens(["<|pad|>"])
    tk.save(str(d / "tokenizer.json"))
    p = tokenize(src, d, tmp_path / "a", "--overwrite", "--eod-token", "<|pad|>")
    assert "reusing" not in p.stderr
    m = json.loads((tmp_path / "a.manifest.json").read_text())
    pad = tk.token_to_id("<|pad|>")
    assert m["eod_id"] == pad == m["tokenizer"]["vocab_size"] - 1 and m["tokenizer"]["eod_piece"] == "<|pad|>"
    bin_ = np.fromfile(tmp_path / "a.bin", dtype=np.uint16)
    assert (bin_ == pad).sum() == m["documents"]
