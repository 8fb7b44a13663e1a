"""megatron-core ``MMIDIDX`` shards (``PREFIX.bin`` + ``PREFIX.idx``) written and merged with numpy only.

The bytes are exactly what megatron-core's ``IndexedDatasetBuilder`` writes for the same documents
(one sequence per document, no sequence modes); ``tests/test_data_prep_megatron.py`` checks that for
uint16 and int32. ``.idx`` layout (little-endian)::

    b"MMIDIDX\\x00\\x00"  <Q version=1  <B dtype code (8 uint16, 4 int32)
    <Q S (sequences)     <Q S+1 (document-index entries)
    int32[S] sequence lengths   int64[S] byte offsets into .bin   int64[S+1] = 0, 1, ..., S

Everything is streamed in bounded chunks, so memory does not grow with the corpus: while writing,
lengths go to a ``.lens`` side file; the ``.idx`` is produced from it at the end.
"""
from __future__ import annotations

import os
import shutil
import struct

import numpy as np

from data_prep.cli import UserError

INDEX_HEADER = b"MMIDIDX\x00\x00"
HEADER_SIZE = len(INDEX_HEADER) + 8 + 1 + 8 + 8      # 34 bytes
DTYPE_CODES = {np.dtype(np.uint16): 8, np.dtype(np.int32): 4}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
CHUNK = 1 << 20                                       # index entries per streamed chunk
UINT16_LIMIT = 65536


def choose_dtype(vocab_size: int, requested: str = "auto") -> np.dtype:
    """The token dtype: the smallest that holds every id (uint16 if vocab <= 65536, else int32)."""
    if requested == "auto":
        return np.dtype(np.uint16) if vocab_size <= UINT16_LIMIT else np.dtype(np.int32)
    if requested == "uint16":
        if vocab_size > UINT16_LIMIT:
            raise UserError(f"--dtype uint16 cannot hold token ids of a {vocab_size}-piece vocabulary "
                            f"(uint16 holds ids < {UINT16_LIMIT}); use --dtype int32 or --dtype auto")
        return np.dtype(np.uint16)
    if requested == "int32":
        return np.dtype(np.int32)
    raise UserError(f"unknown --dtype {requested!r}; choose auto, uint16 or int32")


# ---------------------------------------------------------------------------------------------
# reading an index header (for merging; megatron-core's IndexedDataset is the reader)

class IndexInfo:
    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        with open(self.path, "rb") as f:
            head = f.read(HEADER_SIZE)
        if len(head) < HEADER_SIZE or head[:9] != INDEX_HEADER:
            raise UserError(f"{self.path}: not a megatron-core MMIDIDX index")
        version, code, seqs, docs = struct.unpack("<QBQQ", head[9:])
        if version != 1 or code not in CODE_DTYPES:
            raise UserError(f"{self.path}: unsupported index (version {version}, dtype code {code})")
        self.dtype = CODE_DTYPES[code]
        self.sequences = seqs
        self.doc_entries = docs


# ---------------------------------------------------------------------------------------------
# writing

def _length_chunks(sources):
    """Yield int32 length chunks from ``sources``: a list of (path, byte offset, count)."""
    for path, offset, count in sources:
        done = 0
        while done < count:
            n = min(CHUNK, count - done)
            yield np.fromfile(path, dtype="<i4", count=n, offset=offset + 4 * done)
            done += n


def write_index(idx_path: str | os.PathLike, dtype: np.dtype, sources, count: int) -> None:
    """Write an ``.idx`` for ``count`` one-sequence documents whose lengths are in ``sources``."""
    itemsize = np.int64(np.dtype(dtype).itemsize)
    with open(idx_path, "wb") as f:
        f.write(INDEX_HEADER)
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", DTYPE_CODES[np.dtype(dtype)]))
        f.write(struct.pack("<Q", count))
        f.write(struct.pack("<Q", count + 1))
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


class ShardWriter:
    """Appends documents (token arrays, EOD included) to ``PREFIX.bin``; ``finish()`` writes the
    ``.idx`` and ``PREFIX.counts.npy`` (int64 occurrences of each token id)."""

    def __init__(self, prefix: str, dtype: np.dtype, vocab_size: int):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        self.vocab_size = vocab_size
        self._bin = open(prefix + ".bin", "wb")
        self._lens = open(prefix + ".lens", "wb")
        self.counts = np.zeros(vocab_size, np.int64)
        self.documents = 0
        self.tokens = 0
        self.text_bytes = 0

    def add(self, tokens: np.ndarray, lengths: np.ndarray, text_bytes: int = 0) -> None:
        """Append documents: ``tokens`` is their concatenation, ``lengths`` their sizes (all > 0)."""
        if len(lengths) == 0:
            return
        self.add_partial(tokens)
        lengths.astype("<i4", copy=False).tofile(self._lens)
        self.documents += len(lengths)
        self.text_bytes += text_bytes

    def add_partial(self, tokens: np.ndarray) -> None:
        """Append tokens of a document still being written (see :meth:`end_document`)."""
        self.counts += np.bincount(tokens, minlength=self.vocab_size)
        tokens.astype(self.dtype, copy=False).tofile(self._bin)
        self.tokens += int(tokens.size)

    def end_document(self, length: int, text_bytes: int) -> None:
        """Close a document written with :meth:`add_partial`: ``length`` tokens in total (> 0)."""
        np.array([length], dtype="<i4").tofile(self._lens)
        self.documents += 1
        self.text_bytes += text_bytes

    def finish(self) -> dict:
        for f in (self._bin, self._lens):
            f.flush()
            os.fsync(f.fileno())
            f.close()
        lens = self.prefix + ".lens"
        write_index(self.prefix + ".idx", self.dtype, [(lens, 0, self.documents)], self.documents)
        os.unlink(lens)
        np.save(self.prefix + ".counts.npy", self.counts)
        return {"documents": self.documents, "tokens": self.tokens, "text_bytes": self.text_bytes}

    def abort(self) -> None:
        for f in (self._bin, self._lens):
            f.close()


def _append_file(src: str, dst) -> None:
    """Append ``src`` to the open binary file ``dst``: an in-kernel copy (reflink on XFS/btrfs), and if
    that fails at any point, a read loop from the byte it reached - in both files - so no byte is
    copied twice or skipped."""
    dst.flush()                                # earlier buffered writes land before the kernel copy
    out = dst.fileno()
    start = os.lseek(out, 0, os.SEEK_CUR)      # the kernel's offset (the copy moves it, not Python's)
    done = 0
    with open(src, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        try:
            while done < size:
                n = os.copy_file_range(f.fileno(), out, size - done)
                if n == 0:
                    break
                done += n
        except (AttributeError, OSError):      # unsupported here, or failed part-way: ``done`` bytes are in
            pass
        if done == size:
            return
        f.seek(done)
        os.lseek(out, start + done, os.SEEK_SET)
        shutil.copyfileobj(f, dst, 1 << 24)
        dst.flush()


def merge_shards(parts: list[str], out_prefix: str, dtype: np.dtype, vocab_size: int) -> dict:
    """Concatenate shards ``parts`` (in order) into ``out_prefix`` .bin/.idx/.counts.npy.

    One part is moved, not copied. Returns documents/tokens totals.
    """
    dtype = np.dtype(dtype)
    infos = [IndexInfo(p + ".idx") for p in parts]
    for p, info in zip(parts, infos):
        if info.dtype != dtype:
            raise RuntimeError(f"{p}: dtype {info.dtype} differs from {dtype}")
    counts = np.zeros(vocab_size, np.int64)
    for p in parts:
        counts += np.load(p + ".counts.npy")
    total = sum(i.sequences for i in infos)
    if len(parts) == 1:
        os.replace(parts[0] + ".bin", out_prefix + ".bin")
        os.replace(parts[0] + ".idx", out_prefix + ".idx")
    else:
        with open(out_prefix + ".bin", "wb") as out:
            for p in parts:
                _append_file(p + ".bin", out)
            out.flush()
            os.fsync(out.fileno())
        write_index(out_prefix + ".idx", dtype,
                    [(i.path, HEADER_SIZE, i.sequences) for i in infos], total)
    np.save(out_prefix + ".counts.npy", counts)
    tokens = int(os.path.getsize(out_prefix + ".bin") // dtype.itemsize)
    return {"documents": total, "tokens": tokens}
