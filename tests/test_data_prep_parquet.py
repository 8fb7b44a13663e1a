"""Parquet input (data_prep/parquet_source.py): the same documents as the jsonl reader gives, row by row, the set from
``meta`` (struct or JSON text) or a ``pile_set_name`` column, and one error naming the file for a file-level problem."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.cli import UserError
from data_prep.input_files import input_format
from data_prep.pile_sets import SetFilter
from data_prep.sources import FileReader

SETS = ["Github", "Enron Emails", "Pile-CC"]


def records(n=50):
    out = [
        {"text": f"doc {i}: caf\u00e9 \u65e5\u672c\n" * (1 + i % 4), "meta": {"pile_set_name": SETS[i % 3]}}
        for i in range(n)
    ]
    out[7]["text"], out[9]["text"], out[11]["text"] = "", "  \n ", "x" * 300  # skipped: empty, whitespace, too long
    return out


def read(path, **kw) -> tuple:
    r = FileReader(str(path), read_size=64, max_record_bytes=200, **kw)
    batches = list(r.batches(chunk_bytes=0))
    docs = [d for b in batches for d in b.units]
    sets = [r.set_names[i] for b in batches for i in b.set_ids]
    return docs, sets, r.stats.records, dict(r.stats.skipped), dict(r.stats.filtered), r.stats.bytes


@pytest.mark.parametrize("meta", ["struct", "json-text", "column", "none"])
def test_parquet_gives_the_jsonl_documents_and_sets(tmp_path, meta):
    recs = records()
    jl = tmp_path / "a.jsonl"
    jl.write_text("".join(json.dumps(r) + "\n" for r in recs))
    texts = [r["text"] for r in recs]
    if meta == "struct":
        table = pa.table({"id": list(range(len(recs))), "text": texts, "meta": [r["meta"] for r in recs]})
    elif meta == "json-text":
        table = pa.table({"text": texts, "meta": [json.dumps(r["meta"]) for r in recs]})
    elif meta == "column":
        table = pa.table({"pile_set_name": [r["meta"]["pile_set_name"] for r in recs], "text": texts})
    else:
        table = pa.table({"text": texts})
        jl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    pqf = tmp_path / "a.parquet"
    pq.write_table(table, pqf, row_group_size=7)  # several row groups, cut inside the reader's batches
    assert input_format(str(pqf)) == ("parquet", "")
    got, want = read(pqf), read(jl)
    assert got[:5] == want[:5] and got[5] == pqf.stat().st_size
    assert len(got[0]) == 47 and got[3] == {"empty_text": 1, "whitespace_only": 1, "record_too_long": 1}
    if meta != "none":  # the set filter reads the same column
        f = SetFilter(include={"Github"})
        assert read(pqf, set_filter=f)[:5] == read(jl, set_filter=f)[:5]
        assert read(pqf, set_filter=f)[4] == {"Enron Emails": 17, "Pile-CC": 15}  # 11, too long, is skipped first


def test_another_text_column_and_null_texts(tmp_path):
    path = tmp_path / "b.parquet"
    pq.write_table(pa.table({"content": ["one", None, "three"], "text": [1, 2, 3]}), path)
    docs, _, records_, skipped, *_ = read(path, json_key="content")
    assert docs == [b"one", b"three"] and records_ == 3 and skipped == {"missing_text_key": 1}


def test_file_level_problems_are_one_error_naming_the_file(tmp_path):
    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"text": [f"document {i} " * 20 for i in range(2000)], "n": list(range(2000))}), good)
    raw = good.read_bytes()
    cases = {
        "empty.parquet": (b"", "not a readable Parquet file"),
        "cut.parquet": (raw[: len(raw) // 2], "not a readable Parquet file"),
    }
    for name, (data, msg) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(UserError, match=rf"^{tmp_path / name}: {msg}.*re-download it or leave it out"):
            read(tmp_path / name)
    with pytest.raises(UserError, match=rf"^{good}: no column 'body' \(the file has: text, n\); .*--json-key"):
        read(good, json_key="body")
    with pytest.raises(UserError, match=rf"^{good}: column 'n' holds int64, not text; .*--json-key"):
        read(good, json_key="n")
    with pytest.raises(UserError, match="compresses its own pages"):
        input_format(str(tmp_path / "x.parquet.zst"))


def test_tokenize_gives_the_jsonl_shards_byte_for_byte(
    minipile_dir, tokenizer_model, minipile_shards, tokenize, read_corpus, tmp_path
):
    """`tokenize` on minipile's val split as Parquet (several row groups, meta as a struct) writes the shard the
    val.jsonl.zst gave (the fixture's), .bin and .idx byte for byte, and the same set counts."""
    recs = read_corpus(minipile_dir / "val.jsonl.zst")
    table = pa.table({"text": [r["text"] for r in recs], "meta": [r["meta"] for r in recs]})
    src = tmp_path / "val.parquet"
    pq.write_table(table, src, row_group_size=max(1, len(recs) // 5))
    prefix = str(tmp_path / "val")
    tokenize(src, tokenizer_model, prefix, timeout=120)
    for ext in (".bin", ".idx"):
        assert open(prefix + ext, "rb").read() == open(minipile_shards["val"] + ext, "rb").read(), ext
    ours, theirs = (json.load(open(p + ".manifest.json")) for p in (prefix, minipile_shards["val"]))
    assert [ours[k] for k in ("documents", "tokens", "sets", "skipped")] == [
        theirs[k] for k in ("documents", "tokens", "sets", "skipped")
    ]
