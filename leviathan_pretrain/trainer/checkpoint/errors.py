"""Checkpoint files that cannot be written or read, said in one line: the file, the cause, what to do.

Torch-free (errno and text only): :mod:`.safe_io` and :mod:`.checkpoint` raise what is built here, and
:func:`.faults.abort_rank` prints a :class:`CheckpointSaveError` whole.

- Writing: :func:`writing` turns an ``OSError`` carrying an errno (a full disk, a quota, permissions, a read-only
  mount, an I/O error) into a :class:`CheckpointSaveError` naming the file and the errno's text. ``torch.save`` to a
  *path* loses the errno in its C++ writer (``unexpected pos``, ``basic_ios::clear``); into a Python file object
  (:func:`.safe_io.safe_save`) the ``OSError`` comes through, possibly behind the writer's own ``RuntimeError``:
  the chain of exceptions is searched for it.
- Reading: :func:`load_error` turns what ``torch.load`` raises on a truncated, corrupt or unreadable file into a
  :class:`~.names.CheckpointError` naming it, with the loader's own first line.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import re
import struct

from leviathan_pretrain.trainer.checkpoint.names import CheckpointError

DOCS = "see docs/training.md 'What protects a run's checkpoints'"
OLDER = f"resume from an older complete checkpoint: {DOCS}"
INTACT = "then re-run the same command: the previous checkpoint and `latest` are intact"

_FULL = "free space on its file system (or raise the quota)"
_PERMS = "fix the permissions of checkpoint.dir"
SAVE_ADVICE = {
    errno.ENOSPC: _FULL,
    errno.EDQUOT: _FULL,
    errno.EACCES: _PERMS,
    errno.EPERM: _PERMS,
    errno.EROFS: "the file system is mounted read-only: remount it writable or set another checkpoint.dir",
    errno.EIO: "the storage reported an I/O error: check the file system",
}


class CheckpointSaveError(OSError):
    """A checkpoint file could not be written: raised on the writing rank alone, so it ends that rank through
    :func:`.faults.abort_rank` (an ``OSError``, not a :class:`CheckpointError`: those are the start-up checks
    every rank raises together). ``str()`` is the one line to print; ``errno`` and ``filename`` are the cause's."""

    def __init__(self, message: str, code: int | None, path: str):
        super().__init__(message)
        self.errno, self.filename, self.message = code, path, message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):
        return type(self), (self.message, self.errno, self.filename)


_WRITER = ("inline_container", "PytorchStreamWriter", "basic_ios", "unexpected pos")  # torch's writer's own errors


def _os_error(e: BaseException | None) -> OSError | None:
    """The ``OSError`` carrying an errno that ``e`` is, or that torch's writer's errors in front of it were raised
    while handling (their causes and contexts); no other error's (a lost peer stays a lost peer)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, CheckpointSaveError):
            return None  # already said
        if isinstance(e, OSError) and e.errno:
            return e
        if not (isinstance(e, RuntimeError) and any(w in str(e) for w in _WRITER)):
            return None
        e = e.__cause__ or e.__context__
    return None


def save_error(e: BaseException, path) -> CheckpointSaveError | None:
    """The one-line error for ``e`` raised while writing ``path`` (the error's own file name wins), or None when
    no ``OSError`` with an errno is behind it."""
    os_error = _os_error(e)
    if os_error is None:
        return None
    code = os_error.errno
    name = errno.errorcode.get(code, str(code))
    where = os.fsdecode(os_error.filename) if os_error.filename else os.fspath(path)
    advice = SAVE_ADVICE.get(code, "check the file system")
    return CheckpointSaveError(
        f"checkpoint not saved: {os.strerror(code)} ({name}) writing {where}; {advice}, {INTACT}", code, where
    )


@contextlib.contextmanager
def writing(path):
    """Writes of checkpoint file(s) ``path`` (a file, or the folder they go to): an ``OSError`` with an errno
    raised inside leaves as a :class:`CheckpointSaveError` (the traceback shows where; the chain of the writer's
    follow-up errors is dropped); anything else as it was."""
    try:
        yield
    except Exception as e:
        err = save_error(e, path)
        if err is None:
            raise
        raise err from None


def first_line(e: BaseException, limit: int = 200) -> str:
    """The loader's own words in one line: ``WeightsUnpickler error: X`` -> X; else the first non-empty line, up to
    its first sentence end (torch appends paragraphs of advice); the type name when there is no text."""
    text = str(e).strip()
    m = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", text)
    lines = [m.group(1)] if m else [s.strip() for s in text.splitlines() if s.strip()]
    if not lines:
        return type(e).__name__
    line = lines[0]
    cut = line.find(". ", 10)
    if cut > 0:
        line = line[:cut]
    return line.rstrip(".")[:limit]


_CORRUPT_TYPES = (EOFError, KeyError, IndexError, ValueError, AssertionError, struct.error)
_ZIP = ("PytorchStreamReader", "zip archive", "miniz")
_REFUSED = re.compile(r"GLOBAL|allowlisted|must be imported|unrecognized function|blocked")  # what it will not build


def load_error(e: BaseException, path) -> CheckpointError | None:
    """The one-line :class:`CheckpointError` for ``e`` raised by ``torch.load(path, weights_only=True)``, or None
    when ``e`` is not about the file (e.g. a CUDA tensor without CUDA): then it goes on as it is."""
    path = os.fspath(path)
    if isinstance(e, CheckpointError):
        return None
    if isinstance(e, OSError) and e.errno:
        code = e.errno
        if code in (errno.ENOENT, errno.ENOTDIR):
            advice = f"the file is missing: the checkpoint is incomplete; {OLDER}"
        elif code == errno.EISDIR:
            advice = f"a folder where a file was expected; {OLDER}"
        elif code in (errno.EACCES, errno.EPERM):
            advice = "fix its permissions, then re-run the same command"
        else:
            advice = f"check the file system, or {OLDER}"
        return CheckpointError(f"{path}: cannot be read ({os.strerror(code)}); {advice}")
    if isinstance(e, pickle.UnpicklingError):
        said = first_line(e)
        if _REFUSED.search(said):
            return CheckpointError(
                f"{path}: refused by weights_only loading ({said}); this file holds objects other than tensors and "
                "plain containers"
            )
        return CheckpointError(
            f"{path}: refused by weights_only loading ({said}): the file is corrupt, or holds objects other than "
            f"tensors and plain containers; {OLDER}"
        )
    if isinstance(e, RuntimeError) and any(z in str(e) for z in _ZIP):  # torch's zip reader
        said = first_line(e)
    elif isinstance(e, _CORRUPT_TYPES):  # the unpickler reading bytes that are no pickle
        said = f"{type(e).__name__}: {first_line(e)}" if str(e).strip() else type(e).__name__
    else:
        return None
    return CheckpointError(f"{path}: cannot be loaded ({said}): the file is truncated or corrupt; {OLDER}")
