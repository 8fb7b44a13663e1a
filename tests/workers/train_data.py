"""Test data for the trainer tests: small megatron-core shards of a learnable synthetic language.

Documents are walks of a fixed random sparse Markov chain over ``vocab`` ids (each id has 4 successors,
drawn Zipf-like so a few ids are frequent), ended by EOD id 0, so a model's loss falls quickly from
ln(vocab) (unigram statistics first, then the transitions) -- written with
megatron-core's own ``IndexedDatasetBuilder`` plus the ``PREFIX.counts.npy`` the data_prep stage writes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np


def write_shard(
    prefix: str | Path,
    vocab: int = 512,
    docs: int = 200,
    seed: int = 0,
    min_len: int = 20,
    max_len: int = 300,
    dtype=np.uint16,
    counts: bool = True,
) -> str:
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(prefix)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    zipf = 1.0 / np.arange(1, vocab) ** 1.1
    succ = np.random.default_rng(1234).choice(np.arange(1, vocab), size=(vocab, 4), p=zipf / zipf.sum())
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    total = np.zeros(vocab, dtype=np.int64)
    for _ in range(docs):
        n = int(rng.integers(min_len, max_len))
        ids = np.empty(n, dtype=np.int64)
        ids[0] = rng.integers(1, vocab)
        choice = rng.integers(0, 4, size=n)
        for i in range(1, n - 1):
            ids[i] = succ[ids[i - 1], choice[i]]
        ids[-1] = 0
        total += np.bincount(ids, minlength=vocab)
        b.add_document(torch.from_numpy(ids), [n])
    b.finalize(prefix + ".idx")
    if counts:
        np.save(prefix + ".counts.npy", total)
    return prefix


if __name__ == "__main__":
    print(write_shard(sys.argv[1], docs=int(sys.argv[2]) if len(sys.argv) > 2 else 200))
