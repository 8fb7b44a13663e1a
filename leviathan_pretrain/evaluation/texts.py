"""Text benchmarks: zero-shot WikiText-103 (raw) and LAMBADA-style last-word prediction.

Tokenization is the run's SentencePiece model as data_prep applies it (``encode(text)``, no BOS, no EOS), and
every text starts after the EOD token: the document separator the model saw before each training document,
so the first token of a text is predicted from it and counted (a text's tokens are all scored once).

- **WikiText** (:func:`wikitext_articles`, :func:`score_wikitext`): the raw format's articles start at a
  top-level heading line `` = Title = `` (second-level ``= = ... = =`` headings stay inside the article); each
  article (heading included) is tokenized and scored with sliding windows (``context``, ``stride``: only the new
  tokens of each window are scored). Token ppl = exp(total nats / tokens); word ppl = exp(total nats / words),
  words = whitespace-separated words of the text scored (the number papers quote).
- **LAMBADA** (:func:`lambada_examples`, :func:`score_lambada`): a jsonl of ``{"text": ...}``; the target is the
  last whitespace-separated word, the context everything before it; the word's tokens are ``encode(word)`` (the
  dummy prefix gives its leading space, as in the running text). Accuracy: every token of the word is the
  greedy argmax; ppl: exp(mean over examples of the word's total nats).
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from leviathan_pretrain.evaluation.load import EvalError
from leviathan_pretrain.evaluation.scoring import score_streams

HEADING = re.compile(r"^ = [^=].* = $")


@dataclass
class Texts:
    """Texts to score plus what was left out, by reason."""

    items: list = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)


def wikitext_articles(path: str | Path) -> Texts:
    """Articles of a raw WikiText file: ``[(title, text), ...]``; empty articles are skipped (``empty``)."""
    p = Path(path)
    if not p.is_file():
        raise EvalError(f"{p}: WikiText file not found")
    out, title, lines = Texts(), None, []

    def flush():
        if title is None and not "".join(lines).strip():
            return  # blank lines before the first heading
        text = "".join(lines)
        if text.strip() and len(text.split()) > (1 if title else 0):
            out.items.append((title or "(before the first heading)", text))
        else:
            out.skipped["empty"] += 1

    with open(p, encoding="utf-8", errors="strict") as f:
        try:
            for line in f:
                if HEADING.match(line.rstrip("\n")):
                    flush()
                    title, lines = line.strip(" =\n"), [line]
                else:
                    lines.append(line)
        except UnicodeDecodeError as e:
            raise EvalError(f"{p}: not UTF-8 text ({e})") from None
    flush()
    if not out.items:
        raise EvalError(f"{p}: no article with text (expected the raw format: ' = Title = ' heading lines)")
    return out


def lambada_examples(path: str | Path) -> Texts:
    """``[(context, word), ...]`` from a jsonl of ``{"text": ...}``; bad lines are skipped by reason."""
    p = Path(path)
    if not p.is_file():
        raise EvalError(f"{p}: LAMBADA file not found")
    out = Texts()
    with open(p, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                out.skipped["invalid json"] += 1
                continue
            text = rec.get("text") if isinstance(rec, dict) else None
            if not isinstance(text, str):
                out.skipped["no text field"] += 1
                continue
            parts = text.strip().rsplit(None, 1)
            if len(parts) < 2:
                out.skipped["fewer than two words"] += 1
                continue
            out.items.append((parts[0], parts[1]))
    if not out.items:
        raise EvalError(f'{p}: no usable example (lines of {{"text": ...}} with at least two words)')
    return out


def wikitext_streams(tok, eod: int, texts: Texts) -> list[np.ndarray]:
    """Each article as ``[EOD] + encode(article)`` (int64)."""
    return [np.concatenate([[eod], tok.encode_one(text)]).astype(np.int64) for _, text in texts.items]


def score_wikitext(model, streams: list, vocab_size: int, texts: Texts, context: int, stride: int, **kw) -> dict:
    """The ``wikitext`` part of a report for :func:`wikitext_streams` of ``texts`` (``kw``: :func:`~.scoring.
    score_streams` options)."""
    scores = score_streams(model, streams, vocab_size, context, stride, **kw)
    nats = float(sum(np.nansum(s.loss) for s in scores))
    tokens = sum(s.tokens for s in scores)
    words = sum(len(text.split()) for _, text in texts.items)
    return {
        "articles": len(texts.items),
        "skipped": dict(texts.skipped),
        "tokens": tokens,
        "words": words,
        "context": context,
        "stride": stride,
        "nats": nats,
        "token_loss": nats / tokens,
        "token_ppl": math.exp(nats / tokens),
        "word_ppl": math.exp(nats / words),
    }


def score_lambada(model, tok, eod: int, vocab_size: int, texts: Texts, context: int, **kw) -> dict:
    """The ``lambada`` part of a report: one window per example, the context cut from the left to fit."""
    streams, word_lens = [], []
    for ctx, word in texts.items:
        w = tok.encode_one(word)
        c = [eod, *tok.encode_one(ctx)]
        keep = max(1, context + 1 - len(w))  # inputs = context tokens + all but the last word token
        streams.append(np.asarray(c[-keep:] + w, dtype=np.int64))
        word_lens.append(len(w))
    scores = score_streams(model, streams, vocab_size, context, context, **kw)
    nats, hits = [], []
    for s, n in zip(scores, word_lens):
        nats.append(float(np.nansum(s.loss[-n:])))
        hits.append(bool(s.correct[-n:].all()))
    return {
        "examples": len(streams),
        "skipped": dict(texts.skipped),
        "accuracy": float(np.mean(hits)),
        "ppl": math.exp(float(np.mean(nats))),
        "word_nats": nats,
    }
