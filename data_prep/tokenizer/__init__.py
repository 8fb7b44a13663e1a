"""Every tokenizer kind data_prep and the trainer read, behind one interface, detected from the file:

- :mod:`.base`           the interface (``Tokenizer``) every kind implements
- :mod:`.sp`             a SentencePiece ``.model``
- :mod:`.hf`             a Hugging Face ``tokenizer.json``, or a directory holding one (the ``tokenizers`` library)
- :mod:`.tiktoken_file`  a tiktoken encoding: a ``.tiktoken`` ranks file plus its split pattern, or ``tiktoken:NAME``
                         from tiktoken's local cache

``open_tokenizer(spec, pattern=None, eod_token=None)`` is the one entry point. Nothing here downloads."""

from __future__ import annotations

import os

from common.cli import UserError
from data_prep.tokenizer.base import Tokenizer, combined_fingerprint

KINDS = ("sentencepiece", "huggingface", "tiktoken")
ACCEPTED = (
    "a SentencePiece .model, a Hugging Face tokenizer.json (or a directory holding one), a tiktoken ranks file "
    "(.tiktoken, with --tiktoken-pattern) or tiktoken:NAME"
)

__all__ = ["ACCEPTED", "KINDS", "Tokenizer", "combined_fingerprint", "detect_kind", "open_tokenizer", "resolve"]


def resolve(spec: str) -> tuple[str, str | None]:
    """(the file to read, the kind a directory or a ``tiktoken:`` name fixes, else None)."""
    if spec.startswith("tiktoken:"):
        from data_prep.tokenizer.tiktoken_file import cached_path

        return cached_path(spec.split(":", 1)[1]), "tiktoken"
    if os.path.isdir(spec):
        for name, kind in (("tokenizer.json", "huggingface"), ("tokenizer.model", "sentencepiece")):
            if os.path.isfile(os.path.join(spec, name)):
                return os.path.join(spec, name), kind
        found = sorted(f for f in os.listdir(spec) if f.endswith((".tiktoken", ".model")))
        if len(found) == 1:
            return os.path.join(spec, found[0]), None
        raise UserError(f"{spec}: a directory without a tokenizer.json or tokenizer.model; pass the file ({ACCEPTED})")
    if not os.path.isfile(spec):
        raise UserError(f"tokenizer not found: {spec} ({ACCEPTED})")
    return spec, None


def detect_kind(path: str) -> str | None:
    """The kind of the file at ``path`` from its first bytes (SentencePiece: the one that is loaded to know)."""
    return _detect(path)[0]


def _detect(path: str) -> tuple[str | None, object]:
    """(kind, the loaded SentencePieceProcessor when it is SentencePiece's, so it is loaded once)."""
    from data_prep.tokenizer.tiktoken_file import looks_like_ranks

    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError as e:
        raise UserError(f"{path}: cannot read the tokenizer ({e.strerror})") from None
    if head.lstrip()[:1] == b"{":
        return "huggingface", None
    if looks_like_ranks(head):
        return "tiktoken", None
    from data_prep.tokenizer.sp import load_processor

    sp = load_processor(path)
    return ("sentencepiece" if sp is not None else None), sp


def open_tokenizer(spec: str, pattern: str | None = None, eod_token: str | None = None) -> Tokenizer:
    """The tokenizer ``spec`` names (a file, a directory, ``tiktoken:NAME``); ``pattern``: the tiktoken split pattern
    (``--tiktoken-pattern``), ``eod_token``: the end-of-document token's text (``--eod-token``) instead of the
    tokenizer's own. UserError, one line naming the file, for anything unusable."""
    path, kind = resolve(str(spec))
    sp = None
    if kind is None:
        kind, sp = _detect(path)
    if kind is None:
        raise UserError(f"{path}: not a tokenizer of a kind data_prep reads ({ACCEPTED})")
    if pattern and kind != "tiktoken":
        raise UserError(f"{path}: a {kind} tokenizer; --tiktoken-pattern applies to tiktoken ranks files only")
    if kind == "huggingface":
        from data_prep.tokenizer.hf import HuggingFaceTokenizer

        tok = HuggingFaceTokenizer(path, eod_token=eod_token)
    elif kind == "tiktoken":
        from data_prep.tokenizer.tiktoken_file import TiktokenTokenizer

        label = spec if str(spec).startswith("tiktoken:") else None
        tok = TiktokenTokenizer(path, pattern=pattern, eod_token=eod_token, label=label)
    else:
        from data_prep.tokenizer.sp import SentencePieceTokenizer

        tok = SentencePieceTokenizer(path, sp=sp, eod_token=eod_token)
    tok.check()
    return tok
