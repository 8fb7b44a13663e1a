"""The streaming reader: lines across read chunks, multi-frame zstd, document cutting for encoding."""
import json

import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from data_prep.sources import FileReader, split_after_newlines

lines_st = st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")), max_size=30)


@settings(max_examples=150, deadline=None)
@given(lines=lines_st, read_size=st.integers(1, 64), trailing_newline=st.booleans(), compress=st.booleans())
def test_lines_survive_any_read_chunking(tmp_path_factory, lines, read_size, trailing_newline, compress):
    data = b"\n".join(lines) + (b"\n" if trailing_newline and lines else b"")
    path = tmp_path_factory.mktemp("lines") / ("f.txt.zst" if compress else "f.txt")
    path.write_bytes(zstandard.ZstdCompressor().compress(data) if compress else data)
    got = list(FileReader(str(path), read_size=read_size)._lines())
    expected = data.split(b"\n")
    if expected and expected[-1] == b"":
        expected.pop()
    assert got == expected


def test_multi_frame_zstd_and_empty_files(tmp_path):
    recs = [{"text": f"doc {i}"} for i in range(10)]
    frames = b"".join(zstandard.ZstdCompressor().compress(json.dumps(r).encode() + b"\n") for r in recs)
    (tmp_path / "multi.jsonl.zst").write_bytes(frames)               # e.g. pzstd output: one frame per block
    r = FileReader(str(tmp_path / "multi.jsonl.zst"), read_size=5)
    docs = [d for b in r.batches() for d in b.units]
    assert docs == [f"doc {i}".encode() for i in range(10)] and r.stats.records == 10
    (tmp_path / "empty.jsonl").write_bytes(b"")
    r = FileReader(str(tmp_path / "empty.jsonl"))
    assert list(r.batches()) == [] and r.stats.records == 0


@settings(max_examples=200, deadline=None)
@given(doc=st.text(alphabet=st.sampled_from("ab \n\u00e9"), max_size=400).map(str.encode),
       target=st.integers(1, 50))
def test_documents_are_cut_just_after_newlines(doc, target):
    pieces = split_after_newlines(doc, target)
    assert b"".join(pieces) == doc
    assert all(p.endswith(b"\n") for p in pieces[:-1])
    assert all(pieces) or pieces == [b""]
    assert len(pieces) == 1 or len(doc) > 2 * target


def test_batches_group_documents_and_pieces(tmp_path):
    long_doc = "line of text\n" * 2000                                # 26 kB
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
