"""megatron-core's ``MMIDIDX`` index format (``PREFIX.idx``): the one reader and writer of it in this repo.

Layout (little-endian), as megatron-core's ``IndexedDataset`` reads and ``IndexedDatasetBuilder`` writes it::

    b"MMIDIDX\\x00\\x00"  <Q version=1  <B dtype code (megatron's DType: 1 uint8 ... 8 uint16)
    <Q S (sequences)     <Q D (document-index entries, S+1 for one sequence per document)
    int32[S] sequence lengths   int64[S] byte offsets into .bin   int64[D] document index

data_prep writes one sequence per document (document index 0, 1, ..., S). The trainer reads the header and
memory-maps the lengths and offsets (:func:`read_index`); data_prep's merge reads headers only. Format faults
raise :class:`IndexFormatError` with a message naming the file; callers convert it to their own error.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

INDEX_HEADER = b"MMIDIDX\x00\x00"
VERSION = 1
_FIELDS = struct.Struct("<QBQQ")  # version, dtype code, sequences, document-index entries
HEADER_SIZE = len(INDEX_HEADER) + _FIELDS.size  # 34 bytes
# megatron.core.datasets.indexed_dataset.DType: code -> numpy scalar type, and back (keyed by np.dtype)
CODE_DTYPES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
DTYPE_CODES: dict[np.dtype, int] = {np.dtype(t): code for code, t in CODE_DTYPES.items()}
CHUNK = 1 << 20  # index entries per streamed chunk when writing


class IndexFormatError(ValueError):
    """Not a readable MMIDIDX index (bad magic, unsupported version or dtype code, truncated)."""


@dataclass(frozen=True)
class IndexHeader:
    path: str
    dtype: type  # numpy scalar type (np.uint16, np.int32, ...), as megatron-core's reader
    sequences: int
    doc_entries: int  # document-index entries (sequences + 1 for data_prep's shards)

    @property
    def size(self) -> int:
        """Bytes of a complete index with this header."""
        return HEADER_SIZE + self.sequences * (4 + 8) + self.doc_entries * 8

    def lengths_source(self) -> tuple[str, int, int]:
        """Where this index keeps its sequence lengths, as a :func:`write_index` source."""
        return self.path, HEADER_SIZE, self.sequences


@dataclass(frozen=True)
class Index:
    header: IndexHeader
    lengths: np.ndarray  # memory-mapped int32 [sequences]
    pointers: np.ndarray  # memory-mapped int64 [sequences]: byte offset of each sequence in .bin

    @property
    def documents(self) -> int:
        return max(0, self.header.doc_entries - 1)


def read_header(path: str | os.PathLike) -> IndexHeader:
    """The header of the index at ``path``; :class:`IndexFormatError` if it is not a supported MMIDIDX."""
    path = str(path)
    with open(path, "rb") as f:
        head = f.read(HEADER_SIZE)
    if len(head) < HEADER_SIZE or head[: len(INDEX_HEADER)] != INDEX_HEADER:
        raise IndexFormatError(f"{path}: not a megatron-core MMIDIDX index (bad header)")
    version, code, sequences, doc_entries = _FIELDS.unpack(head[len(INDEX_HEADER) :])
    if version != VERSION or code not in CODE_DTYPES:
        raise IndexFormatError(f"{path}: unsupported index version {version} or dtype code {code}")
    return IndexHeader(path, CODE_DTYPES[code], sequences, doc_entries)


def read_index(path: str | os.PathLike) -> Index:
    """Header plus memory-mapped sequence lengths and pointers (the file must hold all the header promises)."""
    header = read_header(path)
    size = Path(path).stat().st_size
    if size < header.size:
        raise IndexFormatError(f"{path}: truncated index ({size} bytes, header promises {header.size})")
    mm = np.memmap(path, mode="r", dtype=np.uint8)
    n = header.sequences
    lengths = np.frombuffer(mm, dtype=np.int32, count=n, offset=HEADER_SIZE)
    pointers = np.frombuffer(mm, dtype=np.int64, count=n, offset=HEADER_SIZE + n * 4)
    return Index(header, lengths, pointers)


def _length_chunks(sources):
    """Yield int32 length chunks from ``sources``: a list of (path, byte offset, count)."""
    for path, offset, count in sources:
        done = 0
        while done < count:
            n = min(CHUNK, count - done)
            yield np.fromfile(path, dtype="<i4", count=n, offset=offset + 4 * done)
            done += n


def write_index(idx_path: str | os.PathLike, dtype, sources, count: int) -> None:
    """Write an ``.idx`` for ``count`` one-sequence documents whose int32 lengths are in ``sources`` (a list of
    (path, byte offset, count): a raw int32 file, or :meth:`IndexHeader.lengths_source` of an index), streamed in
    bounded chunks, then fsync."""
    dtype = np.dtype(dtype)
    itemsize = np.int64(dtype.itemsize)
    with open(idx_path, "wb") as f:
        f.write(INDEX_HEADER)
        f.write(_FIELDS.pack(VERSION, DTYPE_CODES[dtype], count, count + 1))
        seen = 0
        for chunk in _length_chunks(sources):
            chunk.astype("<i4", copy=False).tofile(f)
            seen += len(chunk)
        if seen != count:
            raise RuntimeError(f"index {idx_path}: expected {count} lengths, read {seen}")
        ptr = np.int64(0)
        for chunk in _length_chunks(sources):
            ends = np.cumsum(chunk, dtype=np.int64) * itemsize + ptr
            starts = np.empty_like(ends)
            starts[0] = ptr
            starts[1:] = ends[:-1]
            starts.astype("<i8", copy=False).tofile(f)
            ptr = ends[-1]
        for start in range(0, count + 1, CHUNK):
            np.arange(start, min(count + 1, start + CHUNK), dtype="<i8").tofile(f)
        f.flush()
        os.fsync(f.fileno())
