"""``PREFIX.manifest.json``: what a tokenize run wrote, from what, and how (format ``leviathan-data-prep-manifest/1``).

:class:`Manifest` holds the fields in file order; ``to_json()`` gives the JSON object (keys in that order,
as written), ``from_json()`` reads one back. :func:`part_totals` sums the per-input ``part.json`` records
(data_prep/parts.py) into the manifest's totals. docs/data_prep.md lists what each key means.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

from data_prep import __version__

FORMAT = "leviathan-data-prep-manifest/1"
TOKENS_NOTE = "tokens include one EOD (eos) token per document"
U2581_NOTE = "SentencePiece decodes U+2581 as a space: these documents do not decode back exactly"
MAX_EXAMPLES = 20
INPUT_KEYS = (
    "path",
    "bytes",
    "sha256",
    "records",
    "documents",
    "tokens",
    "text_bytes",
    "skipped",
    "filtered_sets",
    "reused",
    "elapsed_s",
)


@dataclass(kw_only=True)
class Manifest:
    # the field order is the key order of the file
    format: str = FORMAT
    data_prep_version: str = __version__
    command: list
    created_utc: str
    tokenizer: dict  # Tokenizer.describe(): path, sha256, vocab_size, eod_id, eod_piece, ...
    dtype: str
    eod_id: int
    options: dict
    documents: int
    tokens: int
    tokens_note: str = TOKENS_NOTE
    text_bytes: int
    records: int
    sets: dict  # pile_set_name -> {documents, tokens, text_bytes}
    skipped: dict  # reason -> records
    filtered_sets: dict  # set -> documents dropped by the set filter
    skipped_examples: list
    documents_with_u2581: int
    u2581_note: str = U2581_NOTE
    inputs: list  # one dict of INPUT_KEYS per input file, in input order
    outputs: list  # one output_entry() per shard pair
    counts: str
    manifest: str
    workers: int
    encode_chunk_bytes: int
    ranks: int
    elapsed_s: float

    def to_json(self) -> dict:
        """The JSON object of the manifest file (a deep copy; keys in file order)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, obj: dict) -> Manifest:
        """The manifest in a JSON object read from a manifest file; ValueError if it is not one."""
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} manifest")
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in obj]
        if missing:
            raise ValueError(f"manifest without {', '.join(missing)}")
        return cls(**{n: obj[n] for n in names})


def output_entry(set_name: str | None, prefix: str, documents: int, tokens: int) -> dict:
    """One ``outputs`` entry: a shard pair (``set`` None unless split by set) and its files."""
    return {
        "set": set_name,
        "prefix": prefix,
        "documents": documents,
        "tokens": tokens,
        "bin": prefix + ".bin",
        "idx": prefix + ".idx",
        "counts": prefix + ".counts.npy",
    }


def sum_counts(dicts) -> dict:
    """Key-wise sum of {name: count} dicts, sorted by key."""
    tot: Counter = Counter()
    for d in dicts:
        tot.update(d)
    return dict(sorted(tot.items()))


def part_totals(metas: list) -> dict:
    """The manifest fields summed over the parts' records (``metas``, in input order)."""
    sets: dict = {}
    for m in metas:
        for name, s in m["sets"].items():
            t = sets.setdefault(name, {"documents": 0, "tokens": 0, "text_bytes": 0})
            for k in t:
                t[k] += s[k]
    return {
        "text_bytes": sum(m["text_bytes"] for m in metas),
        "records": sum(m["records"] for m in metas),
        "sets": dict(sorted(sets.items())),
        "skipped": sum_counts(m["skipped"] for m in metas),
        "filtered_sets": sum_counts(m["filtered_sets"] for m in metas),
        "skipped_examples": [e for m in metas for e in m["skipped_examples"]][:MAX_EXAMPLES],
        "documents_with_u2581": sum(m.get("u2581_docs", 0) for m in metas),
        "inputs": [{k: m[k] for k in INPUT_KEYS} for m in metas],
    }
