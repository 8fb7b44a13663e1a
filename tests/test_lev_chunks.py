"""LEV on a GPU, checked on the CPU: the spline product's chunk is sized by a per-device memory
budget that counts its real work buffers, a budget-sized chunk computes what small chunks compute, and the
input path makes no host synchronisation per micro-batch but ``torch.unique``'s (LEV and the other unique-id
layers; none for the tables, none with the unique ids made on the host), with out-of-range ids still caught,
readably where they are host tensors."""

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from leviathan_pretrain.config import ConfigError, load_config
from leviathan_pretrain.model import inputs, sizes
from leviathan_pretrain.model.inputs import TokenIdError, check_token_ids
from leviathan_pretrain.model.settings import BuildSettings
from tests.multiproc import no_cuda_touch, one_rank_world
from tests.test_lev import lev_input
from tests.test_model import batch, make, small

REPO = Path(__file__).resolve().parents[1]
SPEC = ["model.vocab_size=50257", "model.hidden_size=64", "model.num_attention_heads=4"]  # LEV at spec defaults
PER_ID = 8 * 128 * (8 * 64 + 8 * 16 + sizes.LEV_COORD_BYTES)  # h 8, d_seed 128, r 64, kappa 16


# ---------------------------------------------------------------- the chunk budget
def test_chunk_is_the_device_budget_without_touching_cuda(monkeypatch):
    no_cuda_touch(monkeypatch)
    layer = lev_input(load_config(None, SPEC))
    cuda = BuildSettings(device="cuda", precision="bf16").torch_device
    assert layer.chunk_for(cuda) == (512 * 2**20) // PER_ID == 682  # 512 MiB of work buffers on a GPU
    assert layer.chunk_for(torch.device("cpu")) == 64  # the CPU keeps its chunk (the old 2**22-element rule: 64)
    assert 682 * PER_ID <= sizes.LEV_CHUNK_BYTES["cuda"] < 683 * PER_ID
    lev = layer.lev
    assert sizes.lev_chunk_ids(lev, 4, "cuda") == 1365 and sizes.lev_chunk_ids(lev, 4, "cpu") == 128  # TP = 2
    # explicit settings: the budget, the chunk itself, the legacy element rule (unchanged on every device)
    over = lambda *o: lev_input(load_config(None, [*SPEC, *o]))  # noqa: E731
    assert over("model.lev.chunk_mib=1024").chunk_for(cuda) == 1365
    assert over("model.lev.chunk_mib=0.1").chunk_for("cpu") == 1
    assert over("model.lev.token_chunk=7").chunk_for(cuda) == 7
    legacy = over("model.lev.chunk_elements=4194304")
    assert legacy.chunk_for(cuda) == legacy.chunk_for("cpu") == 64


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["model.lev.chunk_mib=0"], "model.lev.chunk_mib"),
        (["model.lev.chunk_elements=0"], "model.lev.chunk_elements"),
        (["model.lev.chunk_mib=64", "model.lev.chunk_elements=4194304"], "model.lev.chunk_mib"),
    ],
)
def test_bad_chunk_settings_are_refused_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, overrides)


MEASURE = """
import json, os, sys
import torch
from leviathan_pretrain.model.spline import spline_product
torch.set_num_threads(1)
h, d, K, r, n = 8, 128, 16, 64, 128
u = torch.rand(n, h, d, requires_grad=True)
S = (1 + 0.1 * torch.randn(h, d, K, r)).requires_grad_()
g = torch.randn(n, h, r)
spline_product(u[:2], S, 1e-9, 2).backward(g[:2])  # first-call allocations out of the way
u.grad = S.grad = None
M = spline_product(u, S, 1e-9, n)  # one chunk of n ids
statm = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
before = statm()
M.backward(g)  # the peak: backward recomputes phi
status = open("/proc/self/status").read()  # VmHWM: this process's peak (ru_maxrss would keep the parent's)
peak = int(status.split("VmHWM:")[1].split()[0]) * 1024
outputs = (n * h * d + h * d * K * r + 2 * n * h * r) * 4  # grad_u, grad_S, grad_m * M (not chunk work)
print(json.dumps({"work": peak - before - outputs, "n": n}))
"""


def test_budget_counts_the_measured_work_buffers():
    """One chunk's backward at the spec's defaults, measured as the peak resident set (VmHWM) of a fresh process
    (glibc returns blocks above 64 KiB to the OS, so it follows live tensors): within the bytes the budget
    counts, and not far below them (measured 708 of 768 B per (id, head, coordinate))."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    proc = subprocess.run(
        [sys.executable, "-c", MEASURE], env=env, capture_output=True, text=True, timeout=240, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    counted = got["n"] * PER_ID
    assert 0.75 * counted < got["work"] <= counted, (got["work"] / 2**20, counted / 2**20)


def test_budget_sized_chunks_equal_small_chunks():
    """fp32, spec defaults: the GPU budget's chunk (682 ids: a full chunk and a tail of 118 here) and small chunks
    (29 ids, also with a tail) give the same output and the same gradient of every parameter."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randperm(50257, generator=g)[:800].view(4, 200)
    runs = {}
    for name, over in {"gpu": "model.lev.chunk_mib=512", "small": "model.lev.token_chunk=29"}.items():
        torch.manual_seed(0)
        layer = lev_input(load_config(None, [*SPEC, over]))
        runs[name] = (layer.chunk_for("cpu"), layer(ids), layer)
    assert [c for c, _, _ in runs.values()] == [682, 29]
    w = torch.randn(runs["gpu"][1].shape, generator=g)
    grads = {n: torch.autograd.grad((out * w).sum(), list(layer.parameters())) for n, (_, out, layer) in runs.items()}
    ref_out = runs["small"][1]
    assert (runs["gpu"][1] - ref_out).abs().max() <= 1e-6 * ref_out.abs().max()
    for a, b in zip(grads["gpu"], grads["small"]):
        assert (a - b).abs().max() <= 2e-6 * b.abs().max()  # measured 6e-7: grad_S sums chunk by chunk


# ---------------------------------------------------------------- host synchronisations
SYNC_OPS = {
    "_local_scalar_dense",  # .item(), int(), float(), bool() of a tensor
    "_unique2",
    "_unique",
    "unique_dim",
    "unique_consecutive",
    "unique_dim_consecutive",
    "nonzero",
    "masked_select",
    "is_nonzero",
    "equal",
}


class HostSyncs(TorchDispatchMode):
    """Counts the ops that make the host wait for a GPU: a value read back, or an output size that depends on
    the data (unique, nonzero, masked_select, boolean-mask indexing, repeat_interleave without output_size)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.total += 1
        name = func._schema.name.split("::")[-1]
        data_dependent = name in SYNC_OPS or (name == "repeat_interleave" and "output_size" not in (kwargs or {}))
        if name in ("index", "index_put", "index_put_"):
            data_dependent |= any(
                isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in args[1] if t is not None
            )
        if data_dependent:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def world():
    with one_rank_world(small("lev").parallel) as env:
        yield env


@pytest.mark.parametrize(
    "variant, host_unique, expected",
    [
        ("tied", False, {}),
        ("untied", False, {}),
        ("lev", False, {"_unique2": 1}),
        ("lev", True, {}),
        ("albert", True, {}),
        ("tied", True, {}),
    ],
)
def test_training_micro_batch_syncs_the_host_only_for_unique(world, monkeypatch, variant, host_unique, expected):
    """Forward + backward of a whole model as the trainer runs it (loss mask), with the input layers on their
    accelerator path (``reads_are_free`` False, as for a CUDA tensor): TIED/UNTIED never make the host wait,
    LEV once (``torch.unique``), and not at all with its unique ids made on the host beforehand (the trainer's
    ``data.unique_ids: host``: data/transfer.py, padded to the default bucket of 256; a table ignores them).
    The old range check read ``int(lo), int(hi)`` back: 2 more, in every variant."""
    from leviathan_pretrain.data.transfer import unique_ids
    from leviathan_pretrain.model.inputs import UniqueIds

    monkeypatch.setattr(inputs, "reads_are_free", lambda t: False, raising=False)
    model = make(small(variant))
    x, y, pos = batch()
    mask = torch.ones(x.shape)
    kw = {"unique": UniqueIds(*unique_ids(x, 256))} if host_unique else {}  # the data path's work, on the host
    with HostSyncs() as syncs:
        model(x, pos, None, labels=y, loss_mask=mask, **kw).backward()
    assert syncs.total > 100  # the mode saw the model's ops (forward and backward)
    assert dict(syncs.ops) == expected


def test_accelerator_check_catches_bad_ids_without_reading_them(monkeypatch):
    # a real non-host device: the check runs without reading a value back (the old int(lo) failed here)
    check_token_ids(torch.zeros(2, 3, dtype=torch.long, device="meta"), 10)
    monkeypatch.setattr(inputs, "reads_are_free", lambda t: False)
    check_token_ids(torch.tensor([[0, 9]]), 10)
    for bad in (-1, 10):  # caught by the device-side assertion (on the CPU it raises with the message)
        with pytest.raises(RuntimeError, match=r"a token id is outside \[0, 10\)"):
            check_token_ids(torch.tensor([[1, bad]]), 10)


class Samples:
    """A dataset of ``n`` samples of length 8 (megatron GPTDataset's keys), sample 3 holding ``bad`` if given."""

    def __init__(self, n, bad=None):
        self.n, self.bad = n, bad

    def __getitem__(self, i):
        tokens = np.arange(i, i + 9) % 50
        if i == 3 and self.bad is not None:
            tokens[4] = self.bad
        return {
            "tokens": tokens[:-1],
            "labels": tokens[1:],
            "loss_mask": np.ones(8, np.float32),
            "position_ids": np.arange(8),
        }


def test_trainer_batches_check_ids_on_the_host():
    from leviathan_pretrain.data.datasets import Batches

    assert len(Batches(Samples(8), 2, 1, 0, 8, vocab_size=50).global_batch(0)) == 4
    with pytest.raises(TokenIdError, match="token id 70 is outside"):
        Batches(Samples(8, bad=70), 2, 1, 0, 8, vocab_size=50).global_batch(0)
    assert len(Batches(Samples(8, bad=70), 2, 1, 0, 8).global_batch(0)) == 4  # no vocabulary given: no check


def test_evaluation_checks_ids_before_the_model_sees_them():
    from leviathan_pretrain.evaluation.scoring import score_streams

    class NoModel:
        def head_input(self, *a):
            raise AssertionError("the model was called")

    with pytest.raises(TokenIdError, match="token id 99 is outside"):
        score_streams(NoModel(), [np.array([1, 2, 99, 3])], vocab_size=50, context=4, stride=4)
