"""Test-only: ``python -m leviathan_pretrain.train`` with faults injected from outside the product code.

Run as ``python tests/workers/train_faults.py --config ... key=value ...`` (directly or under
``launchers/local.py``); environment variables pick the fault:

- ``LEV_TEST_KILL_IN_SAVE_STEP=N``: rank 0 SIGKILLs itself half-way through writing its first file of the
  step-N checkpoint (a crash during a save).
- ``LEV_TEST_BAD_TOKEN_RANK=R`` + ``LEV_TEST_BAD_TOKEN_STEP=S``: rank R's micro-batches of step S carry a
  token id outside the vocabulary (the model raises ``TokenIdError`` on that rank only).
- ``LEV_TEST_BAD_SAMPLE_RANK=R`` + ``LEV_TEST_BAD_SAMPLE_STEP=S``: the training samples of step S carry such an id
  in the data itself, on rank R: the data loader's host check raises ``TokenIdError`` while building that batch
  (with ``data.prefetch``: on the prefetch thread, during step S - 1), which must surface at step S.
- ``LEV_TEST_STALL_RANK=R`` + ``LEV_TEST_STALL_STEP=S``: rank R stops itself (SIGSTOP: its sockets stay open,
  nothing crashes) just before step S's stop vote, the per-step collective on the world group.
- ``LEV_TEST_FSYNC_LOG=DIR``: every ``os.fsync`` is recorded as the path of its file descriptor in
  ``DIR/fsync-rank<R>.txt`` (which rank flushes which checkpoint file).
- ``LEV_TEST_NAN_STEPS=3,4,5`` (+ ``LEV_TEST_NAN_RANK=R``): those steps' training loss is NaN
  (:func:`tests.workers.inject.nan_loss`).
- ``LEV_TEST_FILL_DISK_AT_SAVE_STEP=N`` + ``LEV_TEST_FILL_FILE=PATH``: rank 0 fills the file system of ``PATH`` (a
  small tmpfs the test mounted as the checkpoint directory) by writing ``PATH`` until ``ENOSPC``, right after it
  created step N's checkpoint folder (``checkpoint._begin``) and before any rank writes a file of it.
- ``LEV_TEST_KILL_BEFORE_LATEST_STEP=N``: rank 0 SIGKILLs itself when ``checkpoint._atomic_write`` is about to
  replace ``latest`` with step N's tag (``leviathan.json`` written); rank 1 waits in the save's last barrier.
"""

import io
import os
import signal
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from leviathan_pretrain.data import datasets as tdata  # noqa: E402
from leviathan_pretrain.trainer.checkpoint import names as ckpt_names  # noqa: E402
from leviathan_pretrain.trainer.checkpoint import safe_io  # noqa: E402
from leviathan_pretrain.trainer.checkpoint import store as ckpt  # noqa: E402
from tests.workers.inject import nan_loss  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))

kill_step = os.environ.get("LEV_TEST_KILL_IN_SAVE_STEP")
if kill_step:
    _save = safe_io.SafeCheckpointEngine.save

    def save(self, state_dict, path):
        if RANK == 0 and f"{ckpt_names.TAG_PREFIX}{kill_step}" in str(path):
            buf = io.BytesIO()
            torch.save(state_dict, buf)
            with open(path, "wb") as f:
                f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
                f.flush()
                os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        return _save(self, state_dict, path)

    safe_io.SafeCheckpointEngine.save = save

bad_rank = os.environ.get("LEV_TEST_BAD_TOKEN_RANK")
if bad_rank is not None and int(bad_rank) == RANK:
    bad_step = int(os.environ["LEV_TEST_BAD_TOKEN_STEP"])
    _global_batch = tdata.Batches.global_batch

    def global_batch(self, consumed):
        mbs = _global_batch(self, consumed)
        if consumed == (bad_step - 1) * self.g:
            for mb in mbs:
                mb["tokens"][0, 0] = 10**6  # far outside any test vocabulary
        return mbs

    tdata.Batches.global_batch = global_batch

bad_sample_rank = os.environ.get("LEV_TEST_BAD_SAMPLE_RANK")
if bad_sample_rank is not None and int(bad_sample_rank) == RANK:
    from leviathan_pretrain.trainer import loop  # noqa: E402

    _build_datasets, bad_sample_step = loop.build_datasets, int(os.environ["LEV_TEST_BAD_SAMPLE_STEP"])

    class BadSamples:
        """The training samples of step ``bad_sample_step`` with an id far outside any test vocabulary."""

        def __init__(self, ds, g):
            self.ds, self.lo, self.hi = ds, (bad_sample_step - 1) * g, bad_sample_step * g

        def __len__(self):
            return len(self.ds)

        def __getitem__(self, i):
            sample = self.ds[i]
            if self.lo <= i < self.hi:
                sample = {**sample, "tokens": torch.as_tensor(sample["tokens"]).clone()}
                sample["tokens"][0] = 10**6
            return sample

    def build_datasets(cfg, eod, needs_data):
        train, valid = _build_datasets(cfg, eod, needs_data)
        return (None if train is None else BadSamples(train, cfg.train.global_batch_size)), valid

    loop.build_datasets = build_datasets

stall_rank = os.environ.get("LEV_TEST_STALL_RANK")
if stall_rank is not None and int(stall_rank) == RANK:
    from leviathan_pretrain.trainer import loop  # noqa: E402

    _vote, stall_step = loop.stop_requested, int(os.environ["LEV_TEST_STALL_STEP"])

    def stop_requested(t, signals, step, t0, device, **kw):
        if step == stall_step:
            os.kill(os.getpid(), signal.SIGSTOP)
        return _vote(t, signals, step, t0, device, **kw)

    loop.stop_requested = stop_requested

fsync_dir = os.environ.get("LEV_TEST_FSYNC_LOG")
if fsync_dir:
    _fsync = os.fsync
    log = open(Path(fsync_dir) / f"fsync-rank{RANK}.txt", "a", buffering=1)

    def fsync(fd):
        try:
            log.write(os.readlink(f"/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}") + "\n")
        except OSError:
            pass
        return _fsync(fd)

    os.fsync = fsync

if os.environ.get("LEV_TEST_NAN_STEPS"):
    rank = os.environ.get("LEV_TEST_NAN_RANK")
    nan_loss(os.environ["LEV_TEST_NAN_STEPS"].split(","), None if rank is None else int(rank))

fill_step = os.environ.get("LEV_TEST_FILL_DISK_AT_SAVE_STEP")
if fill_step and RANK == 0:
    _begin, filler = ckpt._begin, Path(os.environ["LEV_TEST_FILL_FILE"])

    def begin(ckpt_dir, tag, step):
        mark = _begin(ckpt_dir, tag, step)
        if step == int(fill_step):
            chunk = b"\0" * (1 << 20)
            with open(filler, "ab", buffering=0) as f:
                while chunk:
                    try:
                        f.write(chunk)
                    except OSError:  # ENOSPC: the last pages in ever smaller pieces, then nothing is left
                        chunk = chunk[: len(chunk) // 2]
            print(f"[test] filled {filler.parent} before saving step {step}", flush=True)
        return mark

    ckpt._begin = begin

kill_latest_step = os.environ.get("LEV_TEST_KILL_BEFORE_LATEST_STEP")
if kill_latest_step and RANK == 0:
    _atomic_write = ckpt._atomic_write

    def atomic_write(path, text):
        if Path(path).name == ckpt_names.LATEST and text == ckpt_names.tag_for(int(kill_latest_step)):
            os.kill(os.getpid(), signal.SIGKILL)
        return _atomic_write(path, text)

    ckpt._atomic_write = atomic_write

from leviathan_pretrain.train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
