"""Parquet input: the documents of one ``.parquet`` file for :class:`data_prep.sources.FileReader`.

Streamed with pyarrow in record batches (never the whole file, nor a whole row group of other columns: only the
text column and the set column are read). The text comes from the column ``--json-key`` names (default ``text``);
the Pile set from a ``meta`` column (a struct with a ``pile_set_name`` field, or a JSON string as in The Pile's jsonl)
or a ``pile_set_name`` column, when the file has one. A record's "line" in messages is its row, counted from 1.

The same documents as jsonl and as Parquet give the same shards byte for byte: both hand the text's UTF-8 bytes and
its set name to the same batching. Record-level problems are skipped and counted as for jsonl (a null text is
``missing_text_key``; empty, whitespace-only, too long); a file-level one is one error naming the file: not Parquet
(an empty file, a truncated or corrupt footer), no such column, a column that does not hold strings, a page that
does not decode (with the row reached).
"""

from __future__ import annotations

import hashlib

import orjson

from common.cli import UserError
from data_prep.pile_sets import NO_SET

BATCH_ROWS = 1024  # rows per record batch read: memory is this many documents, whatever the row groups hold
SET_COLUMNS = ("meta", "pile_set_name")  # where the Pile set is read from, the first the file has


def parquet_docs(r):
    """Yield (UTF-8 bytes, set name) per usable row of ``r.path`` (``r``: the FileReader, its stats and skips)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    _hash(r)  # the file's sha256 and size, as for every input (the manifest and a resume compare them)
    try:
        pf = pq.ParquetFile(r.path)
    except (OSError, pa.ArrowException) as e:
        raise UserError(
            f"{r.path}: not a readable Parquet file ({e}); an empty, truncated or corrupt file: re-download it "
            "or leave it out"
        ) from None
    schema, key = pf.schema_arrow, r.json_key
    if key not in schema.names:
        raise UserError(
            f"{r.path}: no column {key!r} (the file has: {', '.join(schema.names)}); name the text column with "
            "--json-key"
        )
    kind = schema.field(key).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise UserError(f"{r.path}: column {key!r} holds {kind}, not text; name the text column with --json-key")
    set_col = next((c for c in SET_COLUMNS if c in schema.names and c != key), None)
    keep = r.set_filter.keep
    batches = pf.iter_batches(batch_size=BATCH_ROWS, columns=[key] + ([set_col] if set_col else []))
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (OSError, pa.ArrowException) as e:
            raise UserError(
                f"{r.path}: corrupt Parquet data after row {r.line} ({e}); re-download it or leave it out"
            ) from None
        texts = batch.column(0).to_pylist()
        names = _set_names(batch.column(1), set_col) if set_col else [None] * len(texts)
        for text, name in zip(texts, names):
            r.line += 1
            r.stats.records += 1
            if text is None:
                r._skip("missing_text_key", f"{key!r} is null")
                continue
            doc = text.encode("utf-8")
            if len(doc) > r.max_record:  # before the set filter, as the jsonl reader's too-long line
                r._skip("record_too_long", f"longer than {r.max_record:,} bytes")
                continue
            if not keep(name):
                r.stats.filtered[NO_SET if name is None else name] += 1
                continue
            if r._usable(text, doc):
                yield doc, name


def _set_names(col, name: str) -> list:
    """Each row's set name, read as the jsonl reader reads ``meta``: ``meta.pile_set_name`` of a struct ``meta`` or of a
    JSON-text ``meta`` (anything else there: no set), or a ``pile_set_name`` column's value."""
    import pyarrow as pa

    if pa.types.is_struct(col.type):
        if col.type.get_field_index("pile_set_name") < 0:
            return [None] * len(col)
        values = col.field("pile_set_name").to_pylist()
    elif name == "meta":
        values = []
        for v in col.to_pylist():
            try:
                m = orjson.loads(v) if type(v) is str else None
            except orjson.JSONDecodeError:
                m = None
            values.append(m.get("pile_set_name") if type(m) is dict else None)
    else:
        values = col.to_pylist()
    return [None if v is None or type(v) in (dict, list) else str(v) for v in values]


def _hash(r) -> None:
    h = hashlib.sha256()
    try:
        with open(r.path, "rb") as f:
            while raw := f.read(r.read_size):
                h.update(raw)
                r.stats.bytes += len(raw)
    except OSError as e:
        raise UserError(f"{r.path}: cannot open: {e.strerror}") from None
    r.stats.sha256 = h.hexdigest()
