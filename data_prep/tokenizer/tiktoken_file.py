"""A tiktoken encoding: a ``.tiktoken`` ranks file (one ``base64(token bytes) rank`` per line) plus the split pattern
and special tokens that make it an encoding. The pattern and the specials of OpenAI's published encodings
(r50k_base, p50k_base, cl100k_base, o200k_base, ...) come from tiktoken's own ``tiktoken_ext.openai_public`` so they
are never copied here; the ranks file is read by data_prep itself, never through tiktoken's loader, which downloads,
and deletes a cached file whose hash differs. Nothing is downloaded, ever.

Which pattern: ``--tiktoken-pattern NAME`` (``o200k``, ``cl100k``, ``r50k``, ``p50k`` or a full name); without it, the
encoding whose published sha256 the file has, or whose name the file has (``o200k_base.tiktoken``, refused if its
sha256 differs). Specials: the published ones when the file is that encoding's, else ``<|endoftext|>`` right after
the largest rank. ``tiktoken:NAME`` is the file tiktoken caches NAME under (``$TIKTOKEN_CACHE_DIR``, else
``$DATA_GYM_CACHE_DIR``, else ``<tmp>/data-gym-cache``, named sha1 of its URL)."""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import json
import os
import tempfile

import numpy as np
import tiktoken
from tiktoken_ext import openai_public

from common.cli import UserError
from common.fileio import sha256_file
from data_prep.tokenizer.base import Tokenizer, combined_fingerprint

ENCODINGS = ("r50k_base", "p50k_base", "cl100k_base", "o200k_base")
ENDOFTEXT = "<|endoftext|>"


def encoding_spec(name: str) -> dict:
    """``{name, pat_str, special_tokens, explicit_n_vocab, url, sha256}`` of a published encoding (a copy)."""
    spec = _published(name)
    return {**spec, "special_tokens": dict(spec["special_tokens"])}


@functools.cache
def _published(name: str) -> dict:
    """``{name, pat_str, special_tokens, explicit_n_vocab, url, sha256}`` of a published encoding, from tiktoken's
    own definition (its ranks loader replaced by one that records the URL and hash and returns nothing)."""
    seen = {}

    def record(url, expected_hash=None):
        seen.update(url=url, sha256=expected_hash)
        return {}

    real = openai_public.load_tiktoken_bpe
    openai_public.load_tiktoken_bpe = record
    try:
        spec = getattr(openai_public, name)()
    finally:
        openai_public.load_tiktoken_bpe = real
    return {
        "name": spec["name"],
        "pat_str": spec["pat_str"],
        "special_tokens": dict(spec["special_tokens"]),
        "explicit_n_vocab": spec.get("explicit_n_vocab"),
        **seen,
    }


def pattern_name(pattern: str) -> str:
    """``o200k`` / ``o200k_base`` -> ``o200k_base``; UserError naming the accepted ones otherwise."""
    name = pattern if pattern.endswith("_base") else f"{pattern}_base"
    if name not in ENCODINGS:
        short = ", ".join(e.removesuffix("_base") for e in ENCODINGS)
        raise UserError(f"--tiktoken-pattern {pattern!r}: unknown; one of {short} (or their *_base names)")
    return name


def cache_dir() -> str:
    """Where tiktoken caches its downloads (the same rule as ``tiktoken.load.read_file_cached``)."""
    for var in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if os.environ.get(var):
            return os.environ[var]
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


def cached_path(name: str) -> str:
    """The file of ``tiktoken:NAME``; UserError naming where to put it when it is not there."""
    if name not in ENCODINGS:
        raise UserError(f"tiktoken:{name}: unknown encoding; one of {', '.join(ENCODINGS)}")
    spec = encoding_spec(name)
    path = os.path.join(cache_dir(), hashlib.sha1(spec["url"].encode()).hexdigest())
    if not os.path.isfile(path):
        raise UserError(
            f"tiktoken:{name}: {path} does not exist (tiktoken's cache; nothing is downloaded at run time): put "
            f"{spec['url']} there, or pass the downloaded file itself (--tokenizer {name}.tiktoken)"
        )
    return path


def looks_like_ranks(head: bytes) -> bool:
    """The first line of ``head`` is ``<base64> <int>``."""
    first = head.split(b"\n", 1)[0].strip()
    parts = first.split(b" ")
    if len(parts) != 2 or not parts[1].isdigit():
        return False
    try:
        base64.b64decode(parts[0], validate=True)
    except (binascii.Error, ValueError):
        return False
    return True


def read_ranks(path: str) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            parts = line.split()
            try:
                if len(parts) != 2:
                    raise ValueError
                token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
            except (binascii.Error, ValueError):
                raise UserError(f"{path}:{n}: not a tiktoken ranks line ('<base64 token> <rank>')") from None
            if token in ranks:
                raise UserError(f"{path}:{n}: token {token!r} appears twice")
            ranks[token] = rank
    if not ranks:
        raise UserError(f"{path}: an empty tiktoken ranks file")
    return ranks


def _choose_spec(path: str, sha: str, pattern: str | None) -> tuple[str, dict | None]:
    """(pattern's encoding name, the published spec the file is, or None)."""
    published = {}
    for name in ENCODINGS:
        s = encoding_spec(name)
        published.setdefault(s["sha256"], s)
    same = published.get(sha)
    if pattern is not None:
        name = pattern_name(pattern)
        return name, same if same is not None and same["pat_str"] == encoding_spec(name)["pat_str"] else None
    if same is not None:
        return same["name"], same
    stem = os.path.basename(path).removesuffix(".tiktoken")
    if stem in ENCODINGS:
        raise UserError(
            f"{path}: named like tiktoken's {stem} but its sha256 {sha[:12]}... is not the published one "
            f"({encoding_spec(stem)['sha256'][:12]}...): a different or damaged file; to use it anyway: "
            f"--tiktoken-pattern {stem.removesuffix('_base')}"
        )
    raise UserError(
        f"{path}: a tiktoken ranks file needs its split pattern: pass --tiktoken-pattern "
        f"{'|'.join(e.removesuffix('_base') for e in ENCODINGS)}"
    )


class TiktokenTokenizer(Tokenizer):
    kind = "tiktoken"

    def __init__(self, path: str, pattern: str | None = None, eod_token: str | None = None, label: str | None = None):
        self.path = path
        self.file_sha256 = sha256_file(path)
        name, published = _choose_spec(path, self.file_sha256, pattern)
        ranks = read_ranks(path)
        n_ranks = max(ranks.values()) + 1
        if published is not None:
            specials, n_vocab = published["special_tokens"], published["explicit_n_vocab"]
        else:
            specials, n_vocab = {ENDOFTEXT: n_ranks}, None
        self.pattern = name
        self.pat_str = encoding_spec(name)["pat_str"]
        self.special_tokens = specials
        self.label = label
        try:
            self.enc = tiktoken.Encoding(
                name=label or os.path.basename(path),
                pat_str=self.pat_str,
                mergeable_ranks=ranks,
                special_tokens=specials,
                explicit_n_vocab=n_vocab,
            )
        except (AssertionError, ValueError) as e:
            raise UserError(f"{path}: not a usable tiktoken encoding with the {name} pattern ({e})") from None
        self.vocab_size = int(self.enc.max_token_value) + 1
        eod = eod_token or ENDOFTEXT
        if eod not in specials:
            raise UserError(
                f"{path}: --eod-token {eod!r} is not one of this encoding's special tokens ({', '.join(specials)})"
            )
        self.eod_token, self.eod_id = eod, int(specials[eod])
        self.bos_id = None
        self.fingerprint = combined_fingerprint(self.file_sha256, self.pat_str, json.dumps(sorted(specials.items())))

    def extra_description(self) -> dict:
        return {"pattern": self.pattern, "special_tokens": self.special_tokens, "label": self.label}

    def _ids(self, text: str) -> np.ndarray:
        try:
            buf = self.enc.encode_to_numpy(text, disallowed_special=())
        except UnicodeEncodeError:  # lone surrogates: the same repair as tiktoken's encode_ordinary
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            buf = self.enc.encode_to_numpy(text, disallowed_special=())
        return buf.view(np.int32)

    def encode(self, units) -> list[np.ndarray]:
        """Ordinary encoding (special-token text is plain text), as ``encode_ordinary_batch``; each text's encode
        releases the GIL and returns its ids as a buffer (no Python ints)."""
        return [self._ids(u if isinstance(u, str) else u.decode("utf-8")) for u in units]

    def encode_one(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def decode(self, ids) -> str:
        return self.enc.decode([int(i) for i in ids])

    def id_to_piece(self, i: int) -> str:
        return self.enc.decode_single_token_bytes(int(i)).decode("utf-8", "replace")
