"""The streaming reader: lines across read chunks, multi-frame zstd and multi-member gzip, document cutting."""

import gzip
import json
import re

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from common.cli import UserError
from data_prep.sources import FileReader, split_after_newlines

lines_st = st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")), max_size=30)


COMPRESS = {"": lambda b: b, ".zst": zstandard.ZstdCompressor().compress, ".gz": lambda b: gzip.compress(b, mtime=0)}


@settings(max_examples=150, deadline=None)
@given(
    lines=lines_st,
    read_size=st.integers(1, 64),
    trailing_newline=st.booleans(),
    suffix=st.sampled_from(sorted(COMPRESS)),
)
def test_lines_survive_any_read_chunking(tmp_path_factory, lines, read_size, trailing_newline, suffix):
    data = b"\n".join(lines) + (b"\n" if trailing_newline and lines else b"")
    path = tmp_path_factory.mktemp("lines") / f"f.txt{suffix}"
    path.write_bytes(COMPRESS[suffix](data))
    got = list(FileReader(str(path), read_size=read_size)._lines())
    expected = data.split(b"\n")
    if expected and expected[-1] == b"":
        expected.pop()
    assert got == expected


def test_gzip_reads_as_zstd_and_plain_do_member_by_member(tmp_path):
    """The same records as .jsonl, .jsonl.zst and .jsonl.gz (several gzip members, as pigz or `cat a.gz b.gz` write):
    the same documents, sets, records and skips."""
    recs = [
        {"text": f"doc {i} caf\u00e9", "meta": {"pile_set_name": ["Github", "Enron Emails"][i % 2]}} for i in range(40)
    ]
    lines = [json.dumps(r).encode() + b"\n" for r in recs] + [b"not json\n", b"\n"]
    data = b"".join(lines)
    (tmp_path / "a.jsonl").write_bytes(data)
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
    (tmp_path / "a.jsonl.gz").write_bytes(b"".join(gzip.compress(x, mtime=0) for x in (data[:100], data[100:], b"")))
    got = {}
    for name in ("a.jsonl", "a.jsonl.zst", "a.jsonl.gz"):
        r = FileReader(str(tmp_path / name), read_size=7)
        batches = list(r.batches())
        got[name] = (
            [d for b in batches for d in b.units],
            [r.set_names[i] for b in batches for i in b.set_ids],
            r.stats.records,
            dict(r.stats.skipped),
        )
        assert r.stats.bytes == (tmp_path / name).stat().st_size
    assert got["a.jsonl.gz"] == got["a.jsonl.zst"] == got["a.jsonl"]
    assert len(got["a.jsonl"][0]) == 40 and got["a.jsonl"][3] == {"invalid_json": 1, "blank_line": 1}


@pytest.mark.parametrize("suffix", [".zst", ".gz"])
def test_truncated_or_corrupt_compressed_input_is_an_error_naming_the_file(tmp_path, suffix):
    data = b"".join(json.dumps({"text": f"document number {i}"}).encode() + b"\n" for i in range(2000))
    packed = zstandard.ZstdCompressor(write_checksum=True).compress(data) if suffix == ".zst" else gzip.compress(data)
    name = {".zst": "zstd", ".gz": "gzip"}[suffix]
    cut = tmp_path / f"cut.jsonl{suffix}"
    cut.write_bytes(packed[: len(packed) // 2])
    with pytest.raises(UserError, match=rf"^{re.escape(str(cut))}: truncated {name} stream .* after line \d+"):
        list(FileReader(str(cut)).batches())
    bad = bytearray(packed)
    for i in range(len(bad) // 3, len(bad) // 3 + 64):
        bad[i] ^= 0xFF
    corrupt = tmp_path / f"corrupt.jsonl{suffix}"
    corrupt.write_bytes(bytes(bad))
    with pytest.raises(UserError, match=rf"^{re.escape(str(corrupt))}: corrupt {name} data after line \d+"):
        list(FileReader(str(corrupt)).batches())


def test_multi_frame_zstd_and_empty_files(tmp_path):
    recs = [{"text": f"doc {i}"} for i in range(10)]
    frames = b"".join(zstandard.ZstdCompressor().compress(json.dumps(r).encode() + b"\n") for r in recs)
    (tmp_path / "multi.jsonl.zst").write_bytes(frames)  # e.g. pzstd output: one frame per block
    r = FileReader(str(tmp_path / "multi.jsonl.zst"), read_size=5)
    docs = [d for b in r.batches() for d in b.units]
    assert docs == [f"doc {i}".encode() for i in range(10)] and r.stats.records == 10
    (tmp_path / "empty.jsonl").write_bytes(b"")
    r = FileReader(str(tmp_path / "empty.jsonl"))
    assert list(r.batches()) == [] and r.stats.records == 0


@settings(max_examples=200, deadline=None)
@given(doc=st.text(alphabet=st.sampled_from("ab \n\u00e9"), max_size=400).map(str.encode), target=st.integers(1, 50))
def test_documents_are_cut_just_after_newlines(doc, target):
    pieces = split_after_newlines(doc, target)
    assert b"".join(pieces) == doc
    assert all(p.endswith(b"\n") for p in pieces[:-1])
    assert all(pieces) or pieces == [b""]
    assert len(pieces) == 1 or len(doc) > 2 * target


def test_batches_group_documents_and_pieces(tmp_path):
    long_doc = "line of text\n" * 2000  # 26 kB
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["short", long_doc, "tail"]))
    r = FileReader(str(src), batch_bytes=10_000)
    batches = list(r.batches(chunk_bytes=1000))
    # "short" alone, then the long document as piece batches of ~10 kB, the last flagged, then "tail"
    assert batches[0].units == [b"short"] and batches[0].last_piece is None
    pieces = [b for b in batches if b.last_piece is not None]
    assert [b.last_piece for b in pieces] == [False] * (len(pieces) - 1) + [True]
    assert b"".join(u for b in pieces for u in b.units) == long_doc.encode()
    assert batches[-1].units == [b"tail"] and r.stats.documents == 3
    whole = list(FileReader(str(src), batch_bytes=10_000).batches(chunk_bytes=0))
    assert [u for b in whole for u in b.units] == [b"short", long_doc.encode(), b"tail"]


def test_an_overlong_line_is_skipped_in_bounded_memory(tmp_path):
    import tracemalloc

    src = tmp_path / "in.jsonl"
    with open(src, "wb") as f:
        f.write(b'{"text": "before"}\n{"text": "')
        for _ in range(20):  # a 20 MB line
            f.write(b"z" * 1_000_000)
        f.write(b'"}\n{"text": "after"}\n' + b"y" * 3_000_000)  # and a long last line without newline
    tracemalloc.start()
    try:
        r = FileReader(str(src), max_record_bytes=1_000_000)
        docs = [d for b in r.batches() for d in b.units]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert docs == [b"before", b"after"]
    assert r.stats.skipped == {"record_too_long": 2} and r.stats.records == 4
    assert [(e["line"], e["reason"]) for e in r.stats.examples] == [(2, "record_too_long"), (4, "record_too_long")]
    assert peak < 6_000_000, peak


@pytest.mark.parametrize(
    "unit, data, docs, line",
    [
        ("file", b"x" * 2_500_000, [], 1),
        ("line", b"short one\n" + b"w" * 2_500_000 + b"\ntail\n", [b"short one", b"tail"], 2),
        ("paragraph", b"short one\n\n" + b"para line\n" * 300_000 + b"\ntail\n", [b"short one", b"tail"], 3),
        ("paragraph", b"short one\n\n" + b"w" * 2_500_000 + b"\nsame paragraph\n\ntail", [b"short one", b"tail"], 3),
    ],
)
def test_overlong_plain_text_records_are_skipped(unit, data, docs, line, tmp_path):
    src = tmp_path / "in.txt"
    src.write_bytes(data)
    r = FileReader(str(src), text_unit=unit, max_record_bytes=1_000_000)
    assert [d for b in r.batches() for d in b.units] == docs
    assert r.stats.skipped["record_too_long"] == 1
    assert [e["line"] for e in r.stats.examples if e["reason"] == "record_too_long"] == [line]
    assert r.stats.sha256 and r.stats.bytes == len(data)  # the whole file is still read


@settings(max_examples=150, deadline=None)
@given(lines=lines_st, read_size=st.integers(1, 64), limit=st.integers(0, 30))
def test_lines_longer_than_the_limit_become_markers(tmp_path_factory, lines, read_size, limit):
    from data_prep.bounded_lines import TOO_LONG

    data = b"".join(ln + b"\n" for ln in lines)
    path = tmp_path_factory.mktemp("lines") / "f.txt"
    path.write_bytes(data)
    got = list(FileReader(str(path), read_size=read_size, max_record_bytes=limit)._lines())
    assert got == [ln if len(ln) <= limit else TOO_LONG for ln in lines]
