"""A SentencePiece ``.model`` (what ``data_prep.train_tokenizer --kind sentencepiece`` writes).

The batch encode releases the GIL for the whole encode (its pybind source: ``py::gil_scoped_release`` around
``RunBatch``) and, with ``out_type="numpy"``, returns int32 arrays without building Python ints."""

from __future__ import annotations

import sentencepiece as spm

from common.cli import UserError
from common.fileio import sha256_file
from data_prep.tokenizer.base import Tokenizer


def load_processor(path: str):
    """The SentencePieceProcessor of ``path``, or None if it is not a SentencePiece model."""
    sp = spm.SentencePieceProcessor()
    try:
        sp.Load(path)
    except (OSError, RuntimeError):
        return None
    return sp


class SentencePieceTokenizer(Tokenizer):
    kind = "sentencepiece"

    def __init__(self, path: str, sp=None, eod_token: str | None = None):
        self.path = path
        self.sp = sp if sp is not None else load_processor(path)
        if self.sp is None:
            raise UserError(f"{path}: not a SentencePiece model")
        self.file_sha256 = sha256_file(path)
        self.fingerprint = self.file_sha256  # what older manifests and checkpoints record as the sha256
        self.vocab_size = int(self.sp.vocab_size())
        if eod_token is not None:
            eod = int(self.sp.piece_to_id(eod_token))
            if eod == self.sp.unk_id() and eod_token != self.sp.id_to_piece(eod):
                raise UserError(f"{path}: --eod-token {eod_token!r} is not a piece of this SentencePiece model")
        else:
            eod = int(self.sp.eos_id())
        self.eod_id = eod
        if self.eod_id < 0:
            raise UserError(
                f"{path}: the tokenizer has no EOS piece (eos_id=-1); data_prep appends EOS as the end-of-document "
                "token, so train it with an eos_id (train_tokenizer does) or name one with --eod-token"
            )
        self.eod_token = self.sp.id_to_piece(self.eod_id)
        bos = int(self.sp.bos_id())
        self.bos_id = bos if bos >= 0 else None

    def adds_prefix_space(self) -> bool:
        return self.sp.normalize("a").startswith("\u2581")

    def chunk_safe(self) -> bool:
        """Whether cutting a document just after a newline and encoding the pieces separately gives exactly the
        ids of encoding it whole: true when the normalizer keeps text as is (newlines and spaces, no dummy
        prefix, no whitespace removal) and no multi-character piece contains a newline, so a newline is a
        boundary no BPE merge or unigram piece crosses. Checked, then probed."""
        sp = self.sp
        probe = "  a \n\n b\t\n  \n c  d \n"
        try:
            if sp.normalize(probe) != probe.replace(" ", "\u2581"):
                return False
        except (AttributeError, RuntimeError, TypeError):
            return False
        pieces = sp.id_to_piece(list(range(self.vocab_size)))
        if any("\n" in p and len(p) > 1 for p in pieces):
            return False
        whole = sp.encode(probe)
        parts = [x for part in ("  a \n", "\n", " b\t\n", "  \n", " c  d \n") for x in sp.encode(part)]
        return whole == parts

    def extra_description(self) -> dict:
        return {"unk_id": int(self.sp.unk_id()), "pad_id": int(self.sp.pad_id())}

    def encode(self, units: list[str]):
        return self.sp.encode(units, out_type="numpy", add_eos=False, add_bos=False, num_threads=1)

    def encode_one(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def decode(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])

    def id_to_piece(self, i: int) -> str:
        return self.sp.id_to_piece(int(i))
