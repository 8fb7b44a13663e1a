"""Bad input: unusable records are skipped and counted by reason; file-level problems are one-line
errors naming the file; outputs never appear half-written; no zero-length document ever."""

import json
import os

import pytest
import sentencepiece as spm
import zstandard
from megatron.core.datasets.indexed_dataset import IndexedDataset

GOOD = ["first good document", "def f(x):\n    return x\n", "last good one \u00e9\u4e2d"]
BAD_LINES = [  # (raw line, skip reason)
    (b'{"text": "unterminated', "invalid_json"),
    (b'{"meta": {"pile_set_name": "Github"}}', "missing_text_key"),
    (b'{"text": "caf\xe9 latin-1"}', "invalid_utf8"),
    (b'{"text": ""}', "empty_text"),
    (b'{"text": " \\n\\t  \\u3000"}', "whitespace_only"),
    (b"[1, 2, 3]", "not_an_object"),
    (b'{"text": 42}', "text_not_a_string"),
    (b"", "blank_line"),
    (b'{"text": "lone \\ud800 surrogate"}', "invalid_json"),
]


def _good(i):
    return json.dumps({"text": GOOD[i], "meta": {"pile_set_name": "Github"}}).encode()


def write_lines(path, lines, compress=False):
    data = b"\n".join(lines) + b"\n"
    if compress:
        data = zstandard.ZstdCompressor(level=3).compress(data)
    path.write_bytes(data)
    return path


def _outputs(prefix):
    return [
        p
        for p in (prefix + ".bin", prefix + ".idx", prefix + ".manifest.json", prefix + ".counts.npy")
        if os.path.exists(p)
    ]


def _assert_one_line_error(p, *needles):
    assert p.returncode == 2, p.stderr
    err = p.stderr.strip().splitlines()
    assert "Traceback" not in p.stderr and err[-1].startswith("error: "), p.stderr
    for n in needles:
        assert n in err[-1], (n, err[-1])


@pytest.mark.parametrize("compress", [False, True])
def test_bad_records_are_skipped_and_counted(compress, tokenizer_model, tokenize, tmp_path):
    lines = [_good(0)] + [b for b, _ in BAD_LINES] + [_good(1), _good(2)]
    src = write_lines(tmp_path / ("in.jsonl.zst" if compress else "in.jsonl"), lines, compress)
    prefix = str(tmp_path / "out")
    p = tokenize(src, tokenizer_model, prefix)
    m = json.load(open(prefix + ".manifest.json"))
    expected = {}
    for _, reason in BAD_LINES:
        expected[reason] = expected.get(reason, 0) + 1
    assert m["skipped"] == dict(sorted(expected.items()))
    assert m["documents"] == 3 and m["records"] == len(lines)
    where = {(e["line"], e["reason"]) for e in m["skipped_examples"]}
    assert where == {(i + 2, r) for i, (_, r) in enumerate(BAD_LINES)}
    assert all(e["file"] == str(src) for e in m["skipped_examples"])
    assert f"{src}:2: skipped record (invalid_json" in p.stderr  # logged with FILE:LINE
    ds = IndexedDataset(prefix)
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_model))
    assert [sp.decode(ds[i][:-1].tolist()) for i in range(len(ds))] == GOOD
    assert ds.sequence_lengths.min() >= 2  # never a zero-length (or EOD-only) document


def test_on_bad_record_error_names_file_and_line(tokenizer_model, tokenize, tmp_path):
    src = write_lines(tmp_path / "in.jsonl", [_good(0), _good(1), b'{"text": broken'])
    prefix = str(tmp_path / "out")
    p = tokenize(src, tokenizer_model, prefix, "--on-bad-record", "error", check=False)
    _assert_one_line_error(p, f"{src}:3", "invalid_json")
    assert _outputs(prefix) == []


def test_truncated_zst_is_an_error_naming_the_file(minipile_dir, tokenizer_model, tokenize, tmp_path):
    raw = (minipile_dir / "val.jsonl.zst").read_bytes()
    src = tmp_path / "val_truncated.jsonl.zst"
    src.write_bytes(raw[: len(raw) * 2 // 3])
    prefix = str(tmp_path / "out")
    p = tokenize([minipile_dir / "test.jsonl.zst", src], tokenizer_model, prefix, check=False)
    _assert_one_line_error(p, str(src), "truncated zstd stream", "after line")
    assert _outputs(prefix) == []


def test_corrupt_zst_is_an_error_naming_the_file(minipile_dir, tokenizer_model, tokenize, tmp_path):
    # like the Pile's files (zstd's command line writes content checksums), so corruption is detectable
    plain = zstandard.ZstdDecompressor().stream_reader(open(minipile_dir / "val.jsonl.zst", "rb")).read()
    raw = bytearray(zstandard.ZstdCompressor(level=3, write_checksum=True).compress(plain))
    for i in range(len(raw) // 2, len(raw) // 2 + 64):
        raw[i] ^= 0x5A
    src = tmp_path / "val_corrupt.jsonl.zst"
    src.write_bytes(bytes(raw))
    prefix = str(tmp_path / "out")
    p = tokenize(src, tokenizer_model, prefix, check=False)
    _assert_one_line_error(p, str(src), "zstd")
    assert _outputs(prefix) == []


@pytest.mark.timeout(300)
def test_a_50mb_single_document_round_trips(minipile_dir, tokenizer_model, tokenize, read_corpus, tmp_path):
    texts = [r["text"] for r in read_corpus(minipile_dir / "train" / "00.jsonl.zst")[:400]]
    big = "\n".join(texts)
    big = big * (50_000_000 // len(big.encode()) + 1)
    big = big.encode()[:50_000_000].decode("utf-8", errors="ignore")
    assert len(big.encode()) > 49_999_000
    src = tmp_path / "big.jsonl"
    with open(src, "wb") as f:
        f.write(json.dumps({"text": "small one before"}).encode() + b"\n")
        f.write(json.dumps({"text": big, "meta": {"pile_set_name": "Books3"}}, ensure_ascii=False).encode() + b"\n")
        f.write(json.dumps({"text": "small one after"}).encode() + b"\n")
    prefix = str(tmp_path / "out")
    tokenize(src, tokenizer_model, prefix, "--workers", 2, timeout=280)
    ds = IndexedDataset(prefix)
    assert len(ds) == 3
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_model))
    assert sp.decode(ds[1][:-1].tolist()) == big
    assert sp.decode(ds[0][:-1].tolist()) == "small one before" and sp.decode(ds[2][:-1].tolist()) == "small one after"
    m = json.load(open(prefix + ".manifest.json"))
    assert m["sets"]["Books3"]["text_bytes"] == len(big.encode())


def test_missing_input_is_a_one_line_error(tokenizer_model, tokenize, tmp_path):
    prefix = str(tmp_path / "out")
    p = tokenize(tmp_path / "nope.jsonl.zst", tokenizer_model, prefix, check=False)
    _assert_one_line_error(p, "input file not found", "nope.jsonl.zst")
    p = tokenize(str(tmp_path / "*.jsonl"), tokenizer_model, prefix, check=False)
    _assert_one_line_error(p, "matches no file")
    assert _outputs(prefix) == []


def test_existing_output_is_refused_unless_overwrite(minipile_dir, tokenizer_model, tokenize, tmp_path):
    prefix = str(tmp_path / "out")
    tokenize(minipile_dir / "test.jsonl.zst", tokenizer_model, prefix)
    before = {f: open(f, "rb").read() for f in _outputs(prefix)}
    assert len(before) == 4
    p = tokenize(minipile_dir / "val.jsonl.zst", tokenizer_model, prefix, check=False)
    _assert_one_line_error(p, "already exists", "--overwrite")
    assert {f: open(f, "rb").read() for f in _outputs(prefix)} == before
    tokenize(minipile_dir / "val.jsonl.zst", tokenizer_model, prefix, "--overwrite")
    assert open(prefix + ".bin", "rb").read() != before[prefix + ".bin"]
    assert json.load(open(prefix + ".manifest.json"))["inputs"][0]["path"].endswith("val.jsonl.zst")


def test_vocab_that_does_not_fit_the_dtype_is_refused(minipile_dir, tokenizer_model_200k, tokenize, tmp_path):
    prefix = str(tmp_path / "out")
    p = tokenize(minipile_dir / "test.jsonl.zst", tokenizer_model_200k, prefix, "--dtype", "uint16", check=False)
    _assert_one_line_error(p, "uint16", "200000", "--dtype int32")
    assert _outputs(prefix) == []


def test_bad_tokenizer_files_are_one_line_errors(minipile_dir, tokenize, tmp_path):
    not_model = tmp_path / "tokenizer.model"
    not_model.write_bytes(b"this is not a sentencepiece model")
    src, prefix = minipile_dir / "test.jsonl.zst", tmp_path / "out"
    p = tokenize(src, not_model, prefix, check=False)
    _assert_one_line_error(p, "not a tokenizer of a kind data_prep reads", "SentencePiece .model", "tokenizer.json")
    p = tokenize(src, tmp_path / "missing.model", prefix, check=False)
    _assert_one_line_error(p, "tokenizer not found", "missing.model")
    # a model without an EOS piece cannot mark document ends
    text = tmp_path / "t.txt"
    text.write_text("some words to learn a tiny model from\n" * 50)
    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(tmp_path / "noeos"), vocab_size=40, eos_id=-1, model_type="bpe", minloglevel=2
    )
    p = tokenize(src, tmp_path / "noeos.model", prefix, check=False)
    _assert_one_line_error(p, "no EOS piece")


def test_all_records_skipped_is_an_error_not_an_empty_shard(tokenizer_model, tokenize, tmp_path):
    src = write_lines(tmp_path / "in.jsonl", [b'{"text": ""}', b'{"text": "  "}', b"nonsense"])
    prefix = str(tmp_path / "out")
    p = tokenize(src, tokenizer_model, prefix, check=False)
    _assert_one_line_error(p, "no documents to write")
    assert _outputs(prefix) == []


@pytest.mark.parametrize("compress", [False, True])
def test_an_overlong_record_is_skipped_and_counted(compress, tokenizer_model, tokenize, tmp_path):
    """--max-record-bytes: a longer line (e.g. a corrupt file without newlines) is skipped as
    record_too_long, never held in memory whole; the records around it are tokenized."""
    long_line = b'{"text": "' + b"x" * 20_000_000 + b'"}'
    src = write_lines(
        tmp_path / ("in.jsonl.zst" if compress else "in.jsonl"), [_good(0), long_line, _good(1), _good(2)], compress
    )
    prefix = str(tmp_path / "out")
    p = tokenize(src, tokenizer_model, prefix, "--max-record-bytes", 1)
    m = json.load(open(prefix + ".manifest.json"))
    assert m["skipped"] == {"record_too_long": 1} and m["records"] == 4 and m["documents"] == 3
    assert [(e["file"], e["line"], e["reason"]) for e in m["skipped_examples"]] == [(str(src), 2, "record_too_long")]
    assert f"{src}:2: skipped record (record_too_long" in p.stderr
    assert m["options"]["max_record_bytes"] == 1_000_000
    ds = IndexedDataset(prefix)
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_model))
    assert [sp.decode(ds[i][:-1].tolist()) for i in range(len(ds))] == GOOD
    p = tokenize(
        src, tokenizer_model, str(tmp_path / "strict"), "--max-record-bytes", 1, "--on-bad-record", "error", check=False
    )
    _assert_one_line_error(p, f"{src}:2", "record_too_long")
    assert _outputs(str(tmp_path / "strict")) == []
    p = tokenize(src, tokenizer_model, prefix, "--max-record-bytes", 0, check=False)
    _assert_one_line_error(p, "--max-record-bytes")
