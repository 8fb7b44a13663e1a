"""The next global batch built one ahead on a background thread (data/prefetch.py ``Prefetcher``, ``data.prefetch``):
the batches of direct calls, position by position; a prefetched batch for another position discarded and the
right one built; an error raised building a batch raised by the ``take`` of that batch, as it was; no thread left
after ``close``; and through the trainer (2 gloo ranks) the losses and gradient norms of ``data.prefetch=false``,
bit for bit, a resume included."""

import threading
import time
import traceback

import numpy as np
import pytest
import torch

from leviathan_pretrain.config import ConfigError, load_config
from leviathan_pretrain.data.datasets import Batches
from leviathan_pretrain.data.prefetch import Prefetcher
from leviathan_pretrain.data.transfer import Transfer
from leviathan_pretrain.model.inputs import TokenIdError

G = 8  # global batch


def workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "batch-prefetch"]


@pytest.fixture(autouse=True)
def no_thread_left():
    yield
    deadline = time.monotonic() + 5
    while workers() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not workers(), "a prefetch thread outlived its test"


class Recorder:
    """``build(pos)``: a batch naming its position; records which thread built which position; raises ``errors``
    at their positions; waits for ``hold[pos]`` (an event) before building a held position (``started`` then)."""

    def __init__(self, errors=None, hold=None):
        self.calls, self.started, self.errors, self.hold = [], [], errors or {}, hold or {}

    def __call__(self, pos):
        self.started.append(pos)
        if pos in self.hold:
            self.hold[pos].wait()
        self.calls.append((pos, threading.current_thread().name))
        if pos in self.errors:
            raise self.errors[pos]
        return ("batch", pos)


def wait_until(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert cond()


def test_takes_return_the_direct_batches_in_order_and_build_one_ahead():
    build = Recorder()
    pf = Prefetcher(build, G, end=5 * G)
    try:
        got = [pf.take(p) for p in range(0, 5 * G, G)]
    finally:
        pf.close()
    assert got == [("batch", p) for p in range(0, 5 * G, G)]
    # the first built here, each later one by the worker, once, and never at or past the run's end
    assert build.calls == [(0, threading.current_thread().name)] + [(p, "batch-prefetch") for p in range(G, 5 * G, G)]


def test_real_batches_prefetched_equal_direct_ones():
    """Batches over a small dataset, each micro-batch prepared (packed, host unique ids): every tensor equal."""

    class Samples:
        def __getitem__(self, i):
            ids = (np.arange(i, i + 17) * 7) % 50
            return {"tokens": ids[:-1], "labels": ids[1:], "loss_mask": np.ones(16, np.float32),
                    "position_ids": np.arange(16)}  # fmt: skip

    batches = Batches(Samples(), 2, 2, 1, G, vocab_size=50, prepare=Transfer(unique_bucket=4).prepare)
    pf = Prefetcher(batches.global_batch, G, end=6 * G, device=torch.device("cpu"))
    try:
        got = [pf.take(p) for p in (0, G, 2 * G, 5 * G, 3 * G)]  # a skip and a step back included
    finally:
        pf.close()
    for p, mbs in zip((0, G, 2 * G, 5 * G, 3 * G), got):
        want = batches.global_batch(p)
        assert len(mbs) == len(want) == 2
        for a, b in zip(mbs, want):
            assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in b)
            assert torch.equal(a.unique.ids, b.unique.ids) and a.unique.count == b.unique.count


def test_a_batch_prefetched_for_another_position_is_discarded():
    build = Recorder()
    pf = Prefetcher(build, G)
    try:
        assert pf.take(0) == ("batch", 0)
        wait_until(lambda: (G, "batch-prefetch") in build.calls)  # built for position 8 ...
        assert pf.take(3 * G) == ("batch", 3 * G)  # ... but 24 is asked for (a resume, a skip): built here
        assert build.calls[-1] == (3 * G, threading.current_thread().name)
        assert pf.take(4 * G) == ("batch", 4 * G)  # prefetched again from there
        assert pf.take(0) == ("batch", 0)  # back: rebuilt here
        assert pf.take(G) == ("batch", G)
    finally:
        pf.close()
    assert [c for c in build.calls if c[1] != "batch-prefetch"] == [
        (p, threading.current_thread().name) for p in (0, 3 * G, 0)
    ]


def test_a_batch_not_yet_started_is_dropped_unbuilt():
    """While the worker is busy, a batch asked for ahead waits in line; a take for another position drops it."""
    busy = threading.Event()
    build = Recorder(hold={G: busy})
    pf = Prefetcher(build, G)
    try:
        pf.take(0)  # asks for 8: the worker starts it and waits
        wait_until(lambda: G in build.started)
        assert pf.take(3 * G) == ("batch", 3 * G)  # 8 dropped (built, never handed over); 32 asked, in line
        assert pf.take(6 * G) == ("batch", 6 * G)  # 32 dropped before it started; 56 asked
        busy.set()
        assert pf.take(7 * G) == ("batch", 7 * G)
    finally:
        busy.set()
        pf.close()
    here = threading.current_thread().name
    assert build.calls == [(0, here), (3 * G, here), (6 * G, here), (G, "batch-prefetch"), (7 * G, "batch-prefetch")]


@pytest.mark.parametrize(
    "error", [TokenIdError("token id 1000000 is outside [0, 512)"), OSError(5, "Input/output error: shard.bin")]
)
def test_an_error_building_a_batch_is_raised_by_the_take_of_that_batch(error):
    build = Recorder(errors={2 * G: error})
    pf = Prefetcher(build, G)
    try:
        assert pf.take(0) == ("batch", 0)
        assert pf.take(G) == ("batch", G)  # the worker fails on 16 meanwhile: not raised here
        wait_until(lambda: (2 * G, "batch-prefetch") in build.calls)
        with pytest.raises(type(error)) as raised:
            pf.take(2 * G)
        assert raised.value is error and str(raised.value) == str(error)
        frames = [f.name for f in traceback.extract_tb(raised.value.__traceback__)]
        assert frames.index("take") < frames.index("__call__"), frames  # raised here, the worker's frames kept
    finally:
        pf.close()


def test_an_error_of_a_discarded_batch_is_never_raised():
    build = Recorder(errors={G: OSError("unreadable")})
    pf = Prefetcher(build, G)
    try:
        pf.take(0)
        wait_until(lambda: (G, "batch-prefetch") in build.calls)
        assert pf.take(4 * G) == ("batch", 4 * G)  # 8 failed but is not asked for
    finally:
        pf.close()


def test_close_ends_the_worker_and_never_waits_long_on_a_half_built_batch():
    build = Recorder()
    pf = Prefetcher(build, G)
    pf.take(0)
    assert len(workers()) == 1 and workers()[0].daemon
    pf.close()
    assert not workers()
    assert pf.take(G) == ("batch", G) and not workers()  # after close: built here, nothing ahead

    busy = threading.Event()
    stuck = Prefetcher(Recorder(hold={2 * G: busy}), G)
    try:
        stuck.take(0)
        stuck.take(G)  # asks for 16: the worker waits inside build(16)
        wait_until(lambda: 2 * G in stuck.build.started)
        t0 = time.monotonic()
        stuck.close(timeout=0.2)
        assert time.monotonic() - t0 < 2 and len(workers()) == 1  # given up on after the timeout: a daemon
    finally:
        busy.set()
    wait_until(lambda: not workers())  # it finishes that batch, then ends without building another
    assert [p for p, _ in stuck.build.calls] == [0, G, 2 * G]


def test_the_config_key():
    data = load_config(None, []).data
    assert data.prefetch is None and data.resolved_prefetch("cuda") and not data.resolved_prefetch("cpu")
    assert load_config(None, ["data.prefetch=true"]).data.resolved_prefetch("cpu") is True
    assert load_config(None, ["data.prefetch=false"]).data.prefetch is False
    with pytest.raises(ConfigError, match=r"data\.prefetch: expected true/false"):
        load_config(None, ["data.prefetch=sometimes"])


# ---------------------------------------------------------------- through the trainer
@pytest.mark.multiproc
def test_training_with_prefetch_logs_the_same_losses_and_resumes_exactly():
    """LEV, 2 gloo ranks (DP 2, ZeRO 1), 10 steps with validation at 5 and 10, through the trainer
    (``trainer.loop.run``): ``data.prefetch`` on (the default on CUDA; asked for here) and off log the same training
    and validation losses and gradient norms, bit for bit; a run with prefetch stopped at step 4 (exit 75, a
    checkpoint) and resumed (in the same processes: a fresh trainer, the first batch built in the loop) logs the
    uninterrupted run's."""
    from tests.workers.train_common import CONFIG, events, launch, overrides, records, spec

    common = ("train.steps=10", "train.eval_interval=5", "logging.log_interval=5", "parallel.zero_stage=1")
    out = launch(
        "prefetch",
        [
            spec("pf_on", *common, "data.prefetch=true"),
            spec("pf_off", *common, "data.prefetch=false"),
            spec("pf_part", *common, "data.prefetch=true", "train.exit_at_step=4"),
            {"name": "pf_resumed", "config": CONFIG, "overrides": overrides("pf_part", *common, "data.prefetch=true")},
        ],
        nprocs=2,
    )
    assert out["codes"]["pf_on"] == out["codes"]["pf_off"] == out["codes"]["pf_resumed"] == {0: 0, 1: 0}
    assert out["codes"]["pf_part"] == {0: 75, 1: 75}

    def logged(name, key):
        return {r["step"]: r[key] for r in records(name) if key in r}

    for key in ("loss", "grad_norm", "valid_loss"):
        on, off, resumed = logged("pf_on", key), logged("pf_off", key), logged("pf_part", key)
        assert sorted(on) == (list(range(1, 11)) if key != "valid_loss" else [5, 10]), (key, on)
        assert on == off, (key, on, off)  # exact float equality
        assert resumed == on, (key, resumed, on)
    assert events("pf_part", "resumed")[-1]["tag"] == "global_step4"
