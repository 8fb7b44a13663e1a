"""The sample a tokenizer is trained on: one pass over the inputs keeps a uniform random sample of documents within
a byte budget (bottom-k reservoir over seeded random keys: memory stays at the budget, the sample depends only on the
seed and the input order). Documents longer than the window bound contribute a seeded random window; input records
over the record bound are skipped (``record_too_long``) by the reader without being held in memory. Both tokenizer
trainers (SentencePiece, :mod:`data_prep.train_bpe`) read the same :class:`Sample`.
"""

from __future__ import annotations

import hashlib
import heapq
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field

from common.cli import UserError
from data_prep.console import human_bytes, log, per_file
from data_prep.input_files import expand_inputs
from data_prep.pile_sets import NO_SET, SetFilter, make_set_filter
from data_prep.sources import FileReader


class Reservoir:
    """Bottom-k (by seeded random key) sample of documents under a byte budget."""

    def __init__(self, budget: int, max_doc: int, seed: int):
        self.budget, self.max_doc = budget, max_doc
        self.rng = random.Random(seed)
        self.heap: list = []  # (-key, order, doc bytes, set name)
        self.bytes = 0
        self.seen_docs = 0
        self.seen_bytes = 0

    def offer(self, order: tuple, doc: bytes, name) -> None:
        self.seen_docs += 1
        self.seen_bytes += len(doc)
        key = self.rng.random()
        if len(doc) > self.max_doc:
            start = int(self.rng.random() * (len(doc) - self.max_doc))
            doc = doc[start : start + self.max_doc]
            nl = doc.find(b"\n")
            if start and 0 <= nl < len(doc) - 1:
                doc = doc[nl + 1 :]
        if self.heap and self.bytes + len(doc) > self.budget and -self.heap[0][0] < key:
            return  # would be evicted at once
        heapq.heappush(self.heap, (-key, order, doc, name))
        self.bytes += len(doc)
        while self.bytes > self.budget and len(self.heap) > 1:
            _, _, d, _ = heapq.heappop(self.heap)
            self.bytes -= len(d)

    def sample(self) -> list:
        return sorted(((o, d, n) for _, o, d, n in self.heap), key=lambda t: t[0])


@dataclass
class Sample:
    """The documents drawn for training and where they came from."""

    reservoir: Reservoir
    docs: list  # (order, document bytes, set name), in input order
    inputs: list  # per input file: path, bytes, sha256, records, documents, skips
    skipped: Counter
    set_filter: SetFilter
    sha256: str = ""  # of the sample: length-prefixed documents, in order
    sets: dict = field(default_factory=dict)  # documents per set
    seconds: float = 0.0  # reading and sampling


def draw_sample(opts) -> Sample:
    """One pass over the inputs into the seeded reservoir; UserError if nothing usable is left. ``opts``: a
    :class:`data_prep.tokenizer_training.TokenizerTrainingOptions` (inputs, set filter, reader settings, budget,
    seed)."""
    t0 = time.monotonic()
    inputs = expand_inputs(opts.input)
    sf = make_set_filter(opts.include_sets, opts.exclude_sets, opts.preset)
    res = Reservoir(int(opts.sample_bytes * 1e6), int(opts.max_doc_bytes * 1e3), opts.seed)
    in_meta, skipped = [], Counter()
    for fi, path in enumerate(inputs):
        r = FileReader(
            path,
            fmt=opts.format,
            json_key=opts.json_key,
            text_unit=opts.text_unit,
            set_filter=sf,
            max_record_bytes=opts.max_record,
        )
        seq = 0
        for batch in r.batches():
            for doc, sid in zip(batch.units, batch.set_ids):
                res.offer((fi, seq), doc, r.set_names[sid])
                seq += 1
        st = r.stats
        skipped.update(st.skipped)
        in_meta.append(
            {
                "path": os.path.abspath(path),
                "bytes": st.bytes,
                "sha256": st.sha256,
                "records": st.records,
                "documents": st.documents,
                "skipped": dict(st.skipped),
                "filtered_sets": dict(st.filtered),
            }
        )
        if per_file(fi, len(inputs)):
            log(f"read {path} ({fi + 1}/{len(inputs)}): {st.documents:,} docs (sample so far {human_bytes(res.bytes)})")
    sample = Sample(res, res.sample(), in_meta, skipped, sf)
    if not sample.docs:
        raise UserError("no usable documents in the inputs (all skipped or filtered)")
    h = hashlib.sha256()
    sets: Counter = Counter()
    for _, doc, name in sample.docs:
        h.update(len(doc).to_bytes(8, "little"))
        h.update(doc)
        sets[NO_SET if name is None else name] += 1
    sample.sha256, sample.sets = h.hexdigest(), dict(sorted(sets.items()))
    sample.seconds = time.monotonic() - t0
    return sample
