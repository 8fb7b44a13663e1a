"""Offline preprocessing: The Pile (jsonl / text, .zst / .gz; Parquet) -> SentencePiece -> megatron-core shards.

Commands (each has ``--help``):

* ``python -m data_prep.make_corpus``     build a small real corpus in the Pile's jsonl.zst format
* ``python -m data_prep.train_tokenizer`` train a SentencePiece model on a seeded sample
* ``python -m data_prep.tokenize``        write megatron-core ``MMIDIDX`` ``.bin/.idx`` shards
* ``python -m data_prep.data_demo``            all of the above on the Python standard library's sources

Nothing in this package imports torch or megatron.core: start-up cost counts.
"""

__version__ = "1.0"
