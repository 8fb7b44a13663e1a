"""Input readers: jsonl / plain text, each optionally .zst or .gz, and Parquet (data_prep/parquet_source.py) as
batches of documents, skip accounting.
(Input globs and formats: data_prep/input_files.py; set filters: data_prep/pile_sets.py; bounded lines and
paragraphs: data_prep/bounded_lines.py; their public names are importable from here too.)

What counts as bad input, and what happens (the policy the README documents):

* record-level problems are **skipped and counted by reason** (manifest ``skipped``), the first few
  of each kind are logged with ``FILE:LINE`` and kept in ``skipped_examples``; with
  ``--on-bad-record error`` the first one is instead a hard error naming ``FILE:LINE``:
  ``invalid_json``, ``invalid_utf8``, ``not_an_object``, ``missing_text_key``, ``text_not_a_string``,
  ``empty_text``, ``whitespace_only``, ``blank_line`` (an empty line in a jsonl file),
  ``record_too_long`` (a line / text record longer than ``max_record_bytes``, e.g. a corrupt file
  without newlines: its bytes are dropped as they are read, never held whole), and
  ``no_tokens`` (counted by the tokenizer: the text encodes to nothing).
* file-level problems are **hard errors** naming the file (and the line reached): a missing or
  unreadable input, a truncated or corrupt ``.zst`` / ``.gz`` stream. A broken download must not turn into a
  silently shorter corpus; re-download the file or leave it out.
* documents dropped by ``--include-sets`` / ``--exclude-sets`` are counted per set (``filtered_sets``).
"""

from __future__ import annotations

import hashlib
import zlib
from collections import Counter
from dataclasses import dataclass, field

import orjson
import zstandard

from common.cli import UserError
from data_prep.bounded_lines import MAX_RECORD_BYTES, TOO_LONG, split_lines, split_paragraphs
from data_prep.console import log
from data_prep.input_files import expand_inputs, input_format
from data_prep.parquet_source import parquet_docs
from data_prep.pile_sets import NO_SET, PILE_SET_NAMES, PRESETS, SetFilter, make_set_filter

__all__ = [  # the readers' public names, wherever they are defined
    "EXAMPLES_PER_REASON",
    "MAX_RECORD_BYTES",
    "NO_SET",
    "PILE_SET_NAMES",
    "PRESETS",
    "SKIP_REASONS",
    "TOO_LONG",
    "Batch",
    "FileReader",
    "FileStats",
    "SetFilter",
    "expand_inputs",
    "input_format",
    "make_set_filter",
    "split_after_newlines",
]

SKIP_REASONS = (
    "invalid_json",
    "invalid_utf8",
    "not_an_object",
    "missing_text_key",
    "text_not_a_string",
    "empty_text",
    "whitespace_only",
    "blank_line",
    "record_too_long",
    "no_tokens",
)
EXAMPLES_PER_REASON = 5
U2581 = "\u2581".encode()  # SentencePiece's space marker: decodes as " ", so such text cannot round-trip


# compression (data_prep/input_files.py) -> (its name in messages, its unit, a new streaming decompressor, its error)
_CODECS = {
    "zst": ("zstd", "frame", lambda: zstandard.ZstdDecompressor().decompressobj(), zstandard.ZstdError),
    "gz": ("gzip", "member", lambda: zlib.decompressobj(wbits=31), zlib.error),  # 31: a gzip header and trailer
}


@dataclass
class Batch:
    units: list  # UTF-8 bytes to encode: whole documents, or consecutive pieces of one
    pieces: list | None  # units per document (None: one unit each)
    doc_bytes: list  # UTF-8 size of each document
    set_ids: list  # index into FileReader.set_names, one per document
    nbytes: int  # sum of doc_bytes (of the units, for a piece batch)
    last_piece: bool | None = None  # None: whole documents; else a run of pieces of ONE long
    # document (doc_bytes/set_ids hold it), True for its last run


def split_after_newlines(doc: bytes, target: int) -> list:
    """Cut ``doc`` into pieces of ~``target`` bytes, each cut just after a newline."""
    pieces, start, n = [], 0, len(doc)
    while n - start > 2 * target:
        cut = doc.find(b"\n", start + target)
        if cut < 0 or cut >= n - 1:
            break
        pieces.append(doc[start : cut + 1])
        start = cut + 1
    pieces.append(doc[start:] if start else doc)
    return pieces


@dataclass
class FileStats:
    path: str
    bytes: int = 0  # raw (possibly compressed) file size read
    sha256: str = ""
    records: int = 0  # lines (jsonl) or candidate documents (text)
    documents: int = 0  # documents handed to the tokenizer
    skipped: Counter = field(default_factory=Counter)
    filtered: Counter = field(default_factory=Counter)
    examples: list = field(default_factory=list)
    u2581_docs: int = 0  # documents containing U+2581 (decodes as a space)


class FileReader:
    """Streams one input file as :class:`Batch` es of at most ~``batch_bytes`` of text.

    Reads and hashes the raw bytes in ``read_size`` chunks, decompresses zstd frame by frame or gzip member by
    member (a truncated stream is an error), splits lines without quadratic copying, parses with orjson.
    Memory is bounded by ``batch_bytes`` plus the longest single document, at most ``max_record_bytes``:
    a longer line (or text record) is skipped as ``record_too_long`` while it is read.
    """

    def __init__(
        self,
        path: str,
        *,
        fmt: str = "auto",
        json_key: str = "text",
        text_unit: str = "file",
        set_filter: SetFilter | None = None,
        on_bad: str = "skip",
        batch_bytes: int = 4 << 20,
        max_batch_docs: int = 1 << 16,
        read_size: int = 1 << 20,
        max_record_bytes: int = MAX_RECORD_BYTES,
    ):
        self.path = path
        self.fmt, self.compressed = input_format(path, fmt)
        if text_unit not in ("file", "line", "paragraph"):
            raise UserError(f"unknown --text-unit {text_unit!r}; choose file, line or paragraph")
        self.json_key = json_key
        self.text_unit = text_unit
        self.set_filter = set_filter or SetFilter()
        self.on_bad = on_bad
        self.batch_bytes = batch_bytes
        self.max_batch_docs = max_batch_docs
        self.read_size = read_size
        self.max_record = max_record_bytes
        self.stats = FileStats(path)
        self.set_names: list = []
        self._set_index: dict = {}
        self.line = 0

    # -- raw bytes -----------------------------------------------------------------------------
    def _chunks(self):
        h = hashlib.sha256()
        try:
            f = open(self.path, "rb")
        except OSError as e:
            raise UserError(f"{self.path}: cannot open: {e.strerror}") from None
        with f:
            if not self.compressed:
                while raw := f.read(self.read_size):
                    h.update(raw)
                    self.stats.bytes += len(raw)
                    yield raw
            else:
                name, unit, new, error = _CODECS[self.compressed]
                dobj, pending = new(), False
                while raw := f.read(self.read_size):
                    h.update(raw)
                    self.stats.bytes += len(raw)
                    out = []
                    try:
                        while raw:
                            pending = True
                            out.append(dobj.decompress(raw))
                            raw = b""
                            if dobj.eof:  # frame (member) done; maybe another follows: pzstd, pigz, cat a b
                                pending = False
                                raw = dobj.unused_data
                                dobj = new()
                    except error as e:
                        raise UserError(
                            f"{self.path}: corrupt {name} data after line {self.line} "
                            f"(compressed byte ~{self.stats.bytes}): {e}; re-download it or leave it out"
                        ) from None
                    data = b"".join(out)
                    if data:
                        yield data
                if pending:
                    raise UserError(
                        f"{self.path}: truncated {name} stream (file ends inside a {unit} after "
                        f"line {self.line}, {self.stats.bytes} compressed bytes); "
                        "re-download it or leave it out"
                    )
        self.stats.sha256 = h.hexdigest()

    def _lines(self):
        """Complete lines (without the trailing newline); the last line may lack one. A line longer
        than ``max_record_bytes`` is yielded as :data:`TOO_LONG`: its bytes are dropped as they come."""
        return split_lines(self._chunks(), self.max_record)

    # -- accounting ----------------------------------------------------------------------------
    def _skip(self, reason: str, detail: str = "") -> None:
        where = f"{self.path}:{self.line}"
        if self.on_bad == "error":
            raise UserError(f"{where}: bad record ({reason}{': ' + detail if detail else ''})")
        st = self.stats
        st.skipped[reason] += 1
        if st.skipped[reason] <= EXAMPLES_PER_REASON:
            st.examples.append({"file": self.path, "line": self.line, "reason": reason, "detail": detail[:200]})
        if st.skipped[reason] == 1:
            log(
                f"warning: {where}: skipped record ({reason}{': ' + detail[:120] if detail else ''}); "
                "further ones are counted in the manifest"
            )

    def _set_id(self, name) -> int:
        sid = self._set_index.get(name)
        if sid is None:
            sid = self._set_index[name] = len(self.set_names)
            self.set_names.append(name)
        return sid

    # -- documents -----------------------------------------------------------------------------
    def _jsonl_docs(self):
        """Yield (utf8 bytes, set name) per usable record."""
        loads, key, keep = orjson.loads, self.json_key, self.set_filter.keep
        for line in self._lines():
            self.line += 1
            self.stats.records += 1
            if line is TOO_LONG:
                self._skip("record_too_long", f"longer than {self.max_record:,} bytes")
                continue
            if not line or line.isspace():
                self._skip("blank_line")
                continue
            try:
                rec = loads(line)
            except orjson.JSONDecodeError as e:
                try:
                    line.decode("utf-8")
                except UnicodeDecodeError as u:
                    self._skip("invalid_utf8", str(u))
                    continue
                self._skip("invalid_json", str(e))
                continue
            if type(rec) is not dict:
                self._skip("not_an_object", type(rec).__name__)
                continue
            text = rec.get(key)
            if text is None:
                self._skip("missing_text_key", f"no {key!r} key" if key not in rec else f"{key!r} is null")
                continue
            if type(text) is not str:
                self._skip("text_not_a_string", type(text).__name__)
                continue
            meta = rec.get("meta")
            if type(meta) is str:
                try:
                    meta = loads(meta)
                except orjson.JSONDecodeError:
                    meta = None
            name = meta.get("pile_set_name") if type(meta) is dict else None
            if name is not None and type(name) is not str:
                name = str(name)
            if not keep(name):
                self.stats.filtered[NO_SET if name is None else name] += 1
                continue
            doc = text.encode("utf-8")
            if self._usable(text, doc):
                yield doc, name

    def _whole_file(self):
        """The file as one record, or TOO_LONG (the rest is still read: hashed, zstd checked)."""
        parts, n = [], 0
        for data in self._chunks():
            n += len(data)
            if n <= self.max_record:
                parts.append(data)
            elif parts:
                parts = []
        self.line = 1
        yield b"".join(parts) if n <= self.max_record else TOO_LONG

    def _text_docs(self):
        if self.text_unit == "file":
            units = self._whole_file()
        elif self.text_unit == "line":
            units = self._lines()
        else:
            units = self._paragraphs()
        keep = self.set_filter.keep
        for raw in units:
            if self.text_unit == "line":
                self.line += 1
            self.stats.records += 1
            if raw is TOO_LONG:
                self._skip("record_too_long", f"longer than {self.max_record:,} bytes")
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as u:
                self._skip("invalid_utf8", str(u))
                continue
            if not keep(None):
                self.stats.filtered[NO_SET] += 1
                continue
            if self._usable(text, raw):
                yield raw, None

    def _usable(self, text: str, doc: bytes) -> bool:
        """Skip (and count) an empty or whitespace-only document; count one holding U+2581."""
        if not text:
            self._skip("empty_text")
            return False
        if text.isspace():
            self._skip("whitespace_only")
            return False
        if U2581 in doc:
            self.stats.u2581_docs += 1
        return True

    def _paragraphs(self):
        """Blank-line separated paragraphs; ``self.line`` is the first line of each. A paragraph longer
        than ``max_record_bytes`` is TOO_LONG (its lines are dropped as they come)."""
        for start, paragraph in split_paragraphs(self._lines(), self.max_record):
            self.line = start
            yield paragraph

    def batches(self, chunk_bytes: int = 0):
        """Yield batches; with ``chunk_bytes`` > 0, documents longer than twice that are cut into
        newline-ended pieces (see pipeline.Tokenizer.chunk_safe for when that is exact), and a
        document longer than a batch becomes several piece batches, encoded in parallel."""
        if self.fmt == "parquet":
            docs_iter = parquet_docs(self)
        else:
            docs_iter = self._jsonl_docs() if self.fmt == "jsonl" else self._text_docs()
        units, pieces, sizes, sids, nbytes = [], [], [], [], 0
        split = chunk_bytes > 0
        limit = 2 * chunk_bytes
        set_id = self._set_id
        for doc, name in docs_iter:
            n = len(doc)
            if split and n > limit:
                parts = split_after_newlines(doc, chunk_bytes)
                if n > self.batch_bytes and len(parts) > 1:
                    if units:
                        yield self._batch(units, pieces, sizes, sids, nbytes)
                        units, pieces, sizes, sids, nbytes = [], [], [], [], 0
                    yield from self._piece_batches(parts, n, set_id(name))
                    continue
                units.extend(parts)
                pieces.append(len(parts))
            else:
                units.append(doc)
                pieces.append(1)
            sizes.append(n)
            sids.append(set_id(name))
            nbytes += n
            if nbytes >= self.batch_bytes or len(units) >= self.max_batch_docs:
                yield self._batch(units, pieces, sizes, sids, nbytes)
                units, pieces, sizes, sids, nbytes = [], [], [], [], 0
        if units:
            yield self._batch(units, pieces, sizes, sids, nbytes)

    def _batch(self, units, pieces, sizes, sids, nbytes) -> Batch:
        self.stats.documents += len(sizes)
        return Batch(units, pieces if len(pieces) != len(units) else None, sizes, sids, nbytes)

    def _piece_batches(self, parts: list, n: int, sid: int):
        self.stats.documents += 1
        run, run_bytes = [], 0
        for i, p in enumerate(parts):
            run.append(p)
            run_bytes += len(p)
            if run_bytes >= self.batch_bytes or i == len(parts) - 1:
                yield Batch(run, None, [n], [sid], run_bytes, last_piece=i == len(parts) - 1)
                run, run_bytes = [], 0
