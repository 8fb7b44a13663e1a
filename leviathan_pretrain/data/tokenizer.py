"""The trainer's side of data_prep's tokenizer interface (data_prep/tokenizer/): ``data.tokenizer`` may be any kind
data_prep reads (a SentencePiece ``.model``, a Hugging Face ``tokenizer.json`` or its directory, a ``.tiktoken``
ranks file with ``data.tiktoken_pattern``, ``tiktoken:NAME``). Opened once per file version and process; errors
are ConfigErrors naming the key. Torch-free."""

from __future__ import annotations

import functools
import os
import re

from common.cli import UserError
from data_prep.tokenizer import Tokenizer, open_tokenizer, resolve
from leviathan_pretrain.config.loader import ConfigError

__all__ = ["Tokenizer", "config_spelling", "open_cached", "open_data_tokenizer"]

_FLAG = "--tiktoken-pattern"


def config_spelling(message: str) -> str:
    """data_prep's tokenizer message with its ``--tiktoken-pattern`` flag spelled as the config key
    (``data.tiktoken_pattern=NAME``), for the trainer's and evaluation's errors."""
    message = re.sub(re.escape(_FLAG) + r" (?=['\"]|[a-z0-9]+(?:_base)?(?:\||$))", "data.tiktoken_pattern=", message)
    return message.replace(_FLAG, "data.tiktoken_pattern")


@functools.lru_cache(maxsize=8)
def _open(spec: str, pattern: str | None, version: tuple) -> Tokenizer:
    return open_tokenizer(spec, pattern=pattern)


def open_cached(spec: str, pattern: str | None = None) -> Tokenizer:
    """:func:`open_tokenizer`, reused while the file it reads is unchanged (size and mtime); UserError otherwise."""
    path = resolve(str(spec))[0]
    st = os.stat(path)
    return _open(str(spec), pattern or None, (path, st.st_size, st.st_mtime_ns))


def open_data_tokenizer(data, key: str = "data.tokenizer") -> Tokenizer | None:
    """The tokenizer of a ``DataConfig`` (None when ``data.tokenizer`` is unset); ConfigError naming ``key``."""
    if not data.tokenizer:
        return None
    try:
        return open_cached(data.tokenizer, data.tiktoken_pattern)
    except UserError as e:
        raise ConfigError(f"{key}: {config_spelling(str(e))}") from None
    except OSError as e:
        raise ConfigError(f"{key}: {data.tokenizer}: {e.strerror}") from None
