"""Checkpoint files that cannot be read or written are said in one line: the file, the cause, what to do
(leviathan_pretrain/trainer/checkpoint/errors.py through safe_io.safe_load / safe_save; the end-to-end full disk:
tests/test_ckpt_errors.py)."""

from __future__ import annotations

import errno
import io
import os
import random
import zipfile

import pytest
import torch

from leviathan_pretrain.trainer import faults
from leviathan_pretrain.trainer.checkpoint.errors import CheckpointSaveError, writing
from leviathan_pretrain.trainer.checkpoint.names import CheckpointError
from leviathan_pretrain.trainer.checkpoint.safe_io import SafeCheckpointEngine, safe_load, safe_save

DOCS = "see docs/training.md 'What protects a run's checkpoints'"


def _checkpoint(path) -> bytes:
    torch.save({"module": {"w": torch.randn(256), "b": torch.randn(8)}, "step": 3}, path)
    return path.read_bytes()


def _truncated(path):
    data = _checkpoint(path)
    path.write_bytes(data[: len(data) // 2])


def _garbage(path):
    path.write_bytes(random.Random(0).randbytes(len(_checkpoint(path))))


def _flipped(path):
    """Bytes flipped in the archive's central directory (a flip in the tensor data loads: torch's zip reader
    checks no CRC)."""
    data = bytearray(_checkpoint(path))
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as z:
        start = z.start_dir + 10
    for k in range(start, start + 64):
        data[k] ^= 0xFF
    path.write_bytes(bytes(data))


def _empty(path):
    path.write_bytes(b"")


@pytest.mark.parametrize(
    "make, said",
    [
        (_truncated, "(PytorchStreamReader failed reading zip archive: failed finding central directory)"),
        (_garbage, "the file is corrupt, or holds objects other than tensors and plain containers"),
        (_flipped, "(PytorchStreamReader failed reading"),
        (_empty, "(EOFError)"),
    ],
)
def test_a_truncated_or_corrupt_file_is_named_in_one_line(tmp_path, make, said):
    path = tmp_path / "global_step6" / "mp_rank_00_model_states.pt"
    path.parent.mkdir()
    make(path)
    with pytest.raises(CheckpointError) as e:
        safe_load(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and "\n" not in msg and said in msg, msg
    assert msg.endswith(f"resume from an older complete checkpoint: {DOCS}"), msg
    assert e.value.__cause__ is None and e.value.__suppress_context__  # the loader's chain is not repeated
    with pytest.raises(CheckpointError, match="truncated or corrupt|is corrupt"):
        SafeCheckpointEngine().load(str(path))  # DeepSpeed's files go the same way


@pytest.mark.parametrize(
    "where, said",
    [
        ("folder", "cannot be read (Is a directory); a folder where a file was expected"),
        ("missing", "cannot be read (No such file or directory); the file is missing"),
    ],
)
def test_an_unreadable_path_is_named_in_one_line(tmp_path, where, said):
    path = tmp_path / "rng_rank00000.pt"
    if where == "folder":
        path.mkdir()
    with pytest.raises(CheckpointError) as e:
        safe_load(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: {said}") and "\n" not in msg, msg


def test_the_weights_only_refusal_is_one_line_with_the_unpicklers_words(tmp_path):
    class Payload:
        def __reduce__(self):
            return (open, (str(tmp_path / "pwned"), "w"))

    torch.save({"module": Payload()}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError) as e:
        safe_load(tmp_path / "evil.pt")
    msg = str(e.value)
    assert msg == (
        f"{tmp_path / 'evil.pt'}: refused by weights_only loading (Unsupported global: GLOBAL io.open was not an "
        "allowed global by default); this file holds objects other than tensors and plain containers"
    ), msg
    assert not (tmp_path / "pwned").exists()


def test_a_full_device_says_so_naming_the_file():
    """torch.save to a path says '[enforce fail at inline_container.cc] unexpected pos'; safe_save (a file object of
    ours) keeps the errno: one line with the file, the errno's text and what to do."""
    with pytest.raises(CheckpointSaveError) as e:
        safe_save({"w": torch.ones(10_000)}, "/dev/full")
    msg = str(e.value)
    assert msg == (
        "checkpoint not saved: No space left on device (ENOSPC) writing /dev/full; free space on its file system (or "
        "raise the quota), then re-run the same command: the previous checkpoint and `latest` are intact"
    ), msg
    assert (e.value.errno, e.value.filename) == (errno.ENOSPC, "/dev/full")
    assert e.value.__suppress_context__  # the writer's follow-up errors (unexpected pos, ...) are not printed
    with pytest.raises(CheckpointSaveError, match="No space left on device"):
        SafeCheckpointEngine().save({"w": torch.ones(10_000)}, "/dev/full")  # DeepSpeed's files


@pytest.mark.parametrize(
    "code, advice",
    [
        (errno.EDQUOT, "free space on its file system (or raise the quota)"),
        (errno.EACCES, "fix the permissions of checkpoint.dir"),
        (errno.EPERM, "fix the permissions of checkpoint.dir"),
        (errno.EROFS, "the file system is mounted read-only: remount it writable or set another checkpoint.dir"),
        (errno.EIO, "the storage reported an I/O error: check the file system"),
    ],
)
def test_each_write_error_names_its_cause_and_what_to_do(tmp_path, code, advice):
    target = tmp_path / "global_step6" / "rng_rank00001.pt"
    with pytest.raises(CheckpointSaveError) as e, writing(target):
        try:
            raise OSError(code, os.strerror(code))  # no file name: the path written is named
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")  # noqa: B904
    name = errno.errorcode[code]
    assert str(e.value) == (
        f"checkpoint not saved: {os.strerror(code)} ({name}) writing {target}; {advice}, then re-run the same "
        "command: the previous checkpoint and `latest` are intact"
    )


def test_other_errors_leave_the_writer_as_they_are(tmp_path):
    with pytest.raises(RuntimeError, match="^not an OS error$"), writing(tmp_path):
        raise RuntimeError("not an OS error")
    with pytest.raises(RuntimeError, match="Connection closed by peer"), writing(tmp_path):  # a lost peer stays one
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:5000")  # noqa: B904
    with pytest.raises(CheckpointSaveError, match="inner"), writing(tmp_path / "outer"):  # said once, not again
        raise CheckpointSaveError("inner", errno.ENOSPC, "x")


def test_a_save_error_ends_its_rank_with_one_traceback_and_the_whole_line(monkeypatch, capsys):
    """faults.abort_rank: the traceback (the log), then '[rank R] error: ...' with nothing cut (the file's path may
    be long)."""
    path = "/lustre/" + "deep/" * 60 + "global_step6/mp_rank_00_model_states.pt"
    try:
        with writing(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except CheckpointSaveError as e:
        err = e

    def exit_(code):
        raise SystemExit(code)

    monkeypatch.setattr(faults.os, "_exit", exit_)
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(SystemExit) as done:
        faults.abort_rank(err)
    assert done.value.code == 1
    out = capsys.readouterr().err
    assert out.count("Traceback (most recent call last)") == 1, out
    last = out.strip().splitlines()[-1]
    assert last == f"[rank 3] error: {err}" and len(last) > 300 and last.endswith("`latest` are intact"), last


def test_a_save_whose_folder_was_taken_over_writes_nothing(tmp_path):
    """A trainer that stalled mid-save and lost its run directory (the run lock) to another, which re-created the
    same checkpoint folder: each file it then writes is refused (its in-progress mark is not the one it wrote)."""
    from leviathan_pretrain.trainer.checkpoint.safe_io import SafeCheckpointEngine

    eng = SafeCheckpointEngine()
    mark = tmp_path / "leviathan.saving"
    mark.write_text('{"token": "mine"}')
    eng.start_recording((mark, '{"token": "mine"}'))
    eng.save({"w": torch.ones(2)}, str(tmp_path / "a.pt"))
    assert eng.written == [str(tmp_path / "a.pt")]
    mark.write_text('{"token": "the new owner"}')
    with pytest.raises(CheckpointError, match=r"b\.pt: not written: .*leviathan\.saving is no longer this save's"):
        eng.save({"w": torch.ones(2)}, str(tmp_path / "b.pt"))
    assert not (tmp_path / "b.pt").exists()
    mark.unlink()
    with pytest.raises(CheckpointError, match="another trainer took the run directory over"):
        eng.save({"w": torch.ones(2)}, str(tmp_path / "c.pt"))
