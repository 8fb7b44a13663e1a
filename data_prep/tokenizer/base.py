"""The one small interface every tokenizer kind implements (data_prep, the trainer, evaluation and export use
only this): encode a batch, encode one text, decode, vocabulary size, EOD id, a fingerprint, and a description
for the manifest. No torch, no transformers."""

from __future__ import annotations

import hashlib
import os

import numpy as np

from common.cli import UserError


class Tokenizer:
    """A loaded tokenizer. Subclasses set the attributes in ``__init__`` and implement the four methods.

    * ``kind``: ``sentencepiece`` | ``huggingface`` | ``tiktoken``
    * ``path``: the file it was loaded from (for a directory or a ``tiktoken:NAME``, the file found)
    * ``vocab_size``: one more than the largest id it can produce (special tokens included)
    * ``eod_id`` / ``eod_token``: the end-of-document id data_prep appends, and its text
    * ``bos_id``: the beginning-of-sequence id, or None
    * ``fingerprint``: sha256 naming exactly what encodes (the file, and for tiktoken its pattern and specials);
      shards' manifests and checkpoints record it, and a different one is refused
    """

    kind: str
    path: str
    vocab_size: int
    eod_id: int
    eod_token: str
    bos_id: int | None = None
    fingerprint: str
    file_sha256: str

    def encode(self, units) -> list[np.ndarray]:
        """One int32 array per text (``str``, or UTF-8 ``bytes`` as data_prep's reader gives), no special tokens
        added (the caller appends the EOD). Releases the GIL for the encode itself, so worker threads scale."""
        raise NotImplementedError

    def encode_one(self, text: str) -> list[int]:
        """The ids of one text, no special tokens added."""
        raise NotImplementedError

    def decode(self, ids) -> str:
        raise NotImplementedError

    def adds_prefix_space(self) -> bool:
        """Whether encoding puts a space before every text (SentencePiece's ``add_dummy_prefix``): then a
        continuation is encoded as the tail of context + continuation."""
        return False

    def chunk_safe(self) -> bool:
        """Whether encoding newline-ended pieces of a document gives exactly the ids of the whole (then data_prep
        may cut long documents, see --chunk-bytes). False unless a kind proves otherwise."""
        return False

    def extra_description(self) -> dict:
        return {}

    def describe(self) -> dict:
        """The manifest's ``tokenizer`` section."""
        return {
            "kind": self.kind,
            "path": os.path.abspath(self.path),
            "sha256": self.file_sha256,
            "fingerprint": self.fingerprint,
            "vocab_size": self.vocab_size,
            "eod_id": self.eod_id,
            "eod_piece": self.eod_token,
            "bos_id": -1 if self.bos_id is None else self.bos_id,
            **self.extra_description(),
        }

    def check(self) -> None:
        """The EOD id is one of the vocabulary's ids."""
        if not 0 <= self.eod_id < self.vocab_size:
            raise UserError(f"{self.path}: EOD id {self.eod_id} is outside the vocabulary (0..{self.vocab_size - 1})")


def combined_fingerprint(*parts: str) -> str:
    """sha256 over several strings (a file's sha256 and the settings that change what it encodes)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()
