"""Tokenize one input file into shard(s) in a directory: reader thread -> encoder threads -> writer.

Threading: every tokenizer kind's batch encode (data_prep/tokenizer/) releases the GIL for the encode
itself and returns one int32 array per text. So:

* one **reader** thread reads + hashes + decompresses + parses (orjson) and cuts ~``batch_bytes``
  batches into a bounded queue;
* ``workers`` **encoder** threads each encode whole batches (the library single-threaded inside),
  so no core idles at the tail of a batch while another finishes a long document;
* the calling thread **writes** results strictly in batch order (np.concatenate, np.bincount,
  ``tofile``), so the output never depends on thread timing.

At most ``workers + 1`` batches are in flight plus ``workers + 1`` queued: memory is bounded by the
batch size, not the corpus.
"""

from __future__ import annotations

import os
import queue
import re
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from data_prep.pile_sets import NO_SET
from data_prep.shards import ShardWriter
from data_prep.sources import FileReader
from data_prep.tokenizer import Tokenizer


def set_slug(name: str | None) -> str:
    """File-name-safe form of a set name: ``Wikipedia (en)`` -> ``Wikipedia_en``."""
    if name is None or name == NO_SET:
        return "no_set"
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_.")
    return slug or "set"


class _Stop(Exception):
    pass


def _reader_thread(reader: FileReader, q: queue.Queue, stop: threading.Event, chunk_bytes: int) -> None:
    def put(item):
        while True:
            try:
                q.put(item, timeout=0.2)
                return
            except queue.Full:
                if stop.is_set():
                    raise _Stop from None

    try:
        for batch in reader.batches(chunk_bytes):
            put(batch)
        put(None)
    except _Stop:
        pass
    except BaseException as e:  # forwarded to the consumer, re-raised there
        try:
            put(e)
        except _Stop:
            pass


class FileTokenizer:
    """Tokenizes one file into ``out_dir/shard-<slug>.{bin,idx,counts.npy}`` (slug ``all`` unless split)."""

    def __init__(
        self,
        tok: Tokenizer,
        dtype: np.dtype,
        *,
        workers: int,
        split_by_set: bool,
        reader_kwargs: dict,
        progress=None,
        chunk_bytes: int = 0,
    ):
        self.tok = tok
        self.dtype = dtype
        self.workers = max(1, workers)
        self.split_by_set = split_by_set
        self.reader_kwargs = reader_kwargs
        self.progress = progress
        self.chunk_bytes = chunk_bytes
        self._eod = np.array([tok.eod_id], dtype=np.int32)

    def run(self, path: str, out_dir: str) -> dict:
        t0 = time.monotonic()
        reader = FileReader(path, **self.reader_kwargs)
        self._reader = reader
        self._out_dir = out_dir
        self._writers: dict = {}
        self._set_stats: dict = {}
        self._no_tokens = 0
        self._raw_seen = 0
        self._open_len = 0
        q: queue.Queue = queue.Queue(maxsize=self.workers + 1)
        stop = threading.Event()
        th = threading.Thread(
            target=_reader_thread, args=(reader, q, stop, self.chunk_bytes), name="data_prep-reader", daemon=True
        )
        th.start()
        try:
            with ThreadPoolExecutor(self.workers, thread_name_prefix="data_prep-encode") as ex:
                inflight: deque = deque()
                try:
                    while True:
                        item = q.get()
                        if item is None:
                            break
                        if isinstance(item, BaseException):
                            raise item
                        inflight.append((item, ex.submit(self.tok.encode, item.units)))
                        while len(inflight) > self.workers:
                            self._write(*inflight.popleft())
                    while inflight:
                        self._write(*inflight.popleft())
                finally:
                    stop.set()
                    for _, fut in inflight:
                        fut.cancel()
        except BaseException:
            for w in self._writers.values():
                w.abort()
            raise
        finally:
            th.join(timeout=5)
        shards = {}
        for key, w in self._writers.items():
            info = w.finish()
            info["file"] = os.path.basename(w.prefix)
            shards[key] = info
        st = reader.stats
        if self._no_tokens:
            st.skipped["no_tokens"] += self._no_tokens
        return {
            "path": path,
            "bytes": st.bytes,
            "sha256": st.sha256,
            "records": st.records,
            "documents": sum(s["documents"] for s in self._set_stats.values()),
            "tokens": sum(s["tokens"] for s in self._set_stats.values()),
            "text_bytes": sum(s["text_bytes"] for s in self._set_stats.values()),
            "sets": self._set_stats,
            "shards": {("" if k is None else k): v for k, v in shards.items()}
            if not self.split_by_set
            else {(NO_SET if k is None else k): v for k, v in shards.items()},
            "skipped": dict(st.skipped),
            "filtered_sets": dict(st.filtered),
            "skipped_examples": st.examples,
            "u2581_docs": st.u2581_docs,
            "elapsed_s": round(time.monotonic() - t0, 3),
        }

    def _writer_for(self, key):
        w = self._writers.get(key)
        if w is None:
            slug = "all" if not self.split_by_set else set_slug(key)
            taken = {os.path.basename(x.prefix) for x in self._writers.values()}
            name = f"shard-{slug}"
            i = 1
            while name in taken:  # two set names with one slug
                i += 1
                name = f"shard-{slug}-{i}"
            w = self._writers[key] = ShardWriter(os.path.join(self._out_dir, name), self.dtype, self.tok.vocab_size)
        return w

    def _write_pieces(self, batch, arrs) -> None:
        """A run of pieces of one long document: tokens go straight to the shard, so memory stays
        bounded by the batch; the length is recorded after the last run."""
        sid = batch.set_ids[0]
        name = self._reader.set_names[sid]
        w = self._writer_for(name if self.split_by_set else None)
        tokens = np.concatenate(arrs) if arrs else np.zeros(0, np.int32)
        if batch.last_piece:
            tokens = np.concatenate([tokens, self._eod])
        w.add_partial(tokens)
        self._open_len += len(tokens)
        self._progress(1 if batch.last_piece else 0, len(tokens), batch.nbytes)
        if not batch.last_piece:
            return
        length, self._open_len = self._open_len, 0
        if length == 1:  # encoded to nothing: the EOD just written is the only token
            raise RuntimeError("a long document encoded to no tokens")  # cannot happen: it has text
        w.end_document(length, batch.doc_bytes[0])
        self._count_set(name, 1, length, batch.doc_bytes[0])

    def _count_set(self, name, documents: int, tokens: int, text_bytes: int) -> None:
        """Add to the per-``pile_set_name`` totals of the manifest."""
        s = self._set_stats.setdefault(NO_SET if name is None else name, {"documents": 0, "tokens": 0, "text_bytes": 0})
        s["documents"] += documents
        s["tokens"] += tokens
        s["text_bytes"] += text_bytes

    def _progress(self, documents: int, tokens: int, text_bytes: int) -> None:
        if self.progress is not None:
            raw = self._reader.stats.bytes
            self.progress.update(documents, tokens, text_bytes, raw - self._raw_seen)
            self._raw_seen = raw

    def _write(self, batch, fut) -> None:
        arrs = fut.result()  # one int32 array per unit, no EOD yet
        if batch.last_piece is not None:
            self._write_pieces(batch, arrs)
            return
        unit_len = np.fromiter(map(len, arrs), dtype=np.int64, count=len(arrs))
        if batch.pieces is None:
            first = None
            doc_tok = unit_len
        else:
            counts = np.asarray(batch.pieces, dtype=np.int64)
            first = np.zeros(len(counts) + 1, dtype=np.int64)
            np.cumsum(counts, out=first[1:])
            doc_tok = np.add.reduceat(unit_len, first[:-1])
        doc_bytes = np.asarray(batch.doc_bytes, dtype=np.int64)
        sids = np.asarray(batch.set_ids, dtype=np.int64)
        docs = np.flatnonzero(doc_tok > 0)  # 0: the text encoded to nothing
        self._no_tokens += len(doc_tok) - len(docs)
        if len(docs) == 0:
            return
        lengths = (doc_tok[docs] + 1).astype(np.int32)  # + EOD
        doc_bytes, sids = doc_bytes[docs], sids[docs]
        names = self._reader.set_names
        nsets = len(names)
        docs_per = np.bincount(sids, minlength=nsets)
        toks_per = np.bincount(sids, weights=lengths, minlength=nsets)
        bytes_per = np.bincount(sids, weights=doc_bytes, minlength=nsets)
        for sid in np.flatnonzero(docs_per):
            self._count_set(names[sid], int(docs_per[sid]), int(toks_per[sid]), int(bytes_per[sid]))

        eod = self._eod

        def flat(sel) -> np.ndarray:  # documents ``sel`` (indices) + EOD each
            parts = []
            if first is None:
                for d in sel:
                    parts.append(arrs[d])
                    parts.append(eod)
            else:
                for d in sel:
                    parts.extend(arrs[first[d] : first[d + 1]])
                    parts.append(eod)
            return np.concatenate(parts)

        if not self.split_by_set:
            self._writer_for(None).add(flat(docs), lengths, int(doc_bytes.sum()))
        else:
            for sid in np.flatnonzero(docs_per):
                idx = np.flatnonzero(sids == sid)
                self._writer_for(names[sid]).add(flat(docs[idx]), lengths[idx], int(doc_bytes[idx].sum()))
        self._progress(len(docs), int(lengths.sum()), int(doc_bytes.sum()))
