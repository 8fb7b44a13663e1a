"""megatron-core ``MMIDIDX`` shards (``PREFIX.bin`` + ``PREFIX.idx``) written and merged with numpy only.

The bytes are exactly what megatron-core's ``IndexedDatasetBuilder`` writes for the same documents
(one sequence per document, no sequence modes); ``tests/test_data_prep_megatron.py`` checks that for
uint16 and int32. The ``.idx`` format itself is data_prep/mmidx.py's.

Everything is streamed in bounded chunks, so memory does not grow with the corpus: while writing,
lengths go to a ``.lens`` side file; the ``.idx`` is produced from it at the end.
"""

from __future__ import annotations

import os
import shutil

import numpy as np

from common.cli import UserError
from data_prep.mmidx import IndexFormatError, read_header, write_index

UINT16_LIMIT = 65536


def choose_dtype(vocab_size: int, requested: str = "auto") -> np.dtype:
    """The token dtype: the smallest that holds every id (uint16 if vocab <= 65536, else int32)."""
    if requested == "auto":
        return np.dtype(np.uint16) if vocab_size <= UINT16_LIMIT else np.dtype(np.int32)
    if requested == "uint16":
        if vocab_size > UINT16_LIMIT:
            raise UserError(
                f"--dtype uint16 cannot hold token ids of a {vocab_size}-piece vocabulary "
                f"(uint16 holds ids < {UINT16_LIMIT}); use --dtype int32 or --dtype auto"
            )
        return np.dtype(np.uint16)
    if requested == "int32":
        return np.dtype(np.int32)
    raise UserError(f"unknown --dtype {requested!r}; choose auto, uint16 or int32")


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
    dst.flush()  # earlier buffered writes land before the kernel copy
    out = dst.fileno()
    start = os.lseek(out, 0, os.SEEK_CUR)  # the kernel's offset (the copy moves it, not Python's)
    done = 0
    with open(src, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        try:
            while done < size:
                n = os.copy_file_range(f.fileno(), out, size - done)
                if n == 0:
                    break
                done += n
        except (AttributeError, OSError):  # unsupported here, or failed part-way: ``done`` bytes are in
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
    try:
        headers = [read_header(p + ".idx") for p in parts]
    except IndexFormatError as e:
        raise UserError(str(e)) from None
    for p, h in zip(parts, headers):
        if np.dtype(h.dtype) != dtype:
            raise RuntimeError(f"{p}: dtype {np.dtype(h.dtype)} differs from {dtype}")
    counts = np.zeros(vocab_size, np.int64)
    for p in parts:
        counts += np.load(p + ".counts.npy")
    total = sum(h.sequences for h in headers)
    if len(parts) == 1:
        os.replace(parts[0] + ".bin", out_prefix + ".bin")
        os.replace(parts[0] + ".idx", out_prefix + ".idx")
    else:
        with open(out_prefix + ".bin", "wb") as out:
            for p in parts:
                _append_file(p + ".bin", out)
            out.flush()
            os.fsync(out.fileno())
        write_index(out_prefix + ".idx", dtype, [h.lengths_source() for h in headers], total)
    np.save(out_prefix + ".counts.npy", counts)
    tokens = int(os.path.getsize(out_prefix + ".bin") // dtype.itemsize)
    return {"documents": total, "tokens": tokens}
