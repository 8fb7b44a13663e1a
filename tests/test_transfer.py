"""A micro-batch on its way to the device (data/transfer.py): one packed host buffer with 8-byte aligned
tensors, pinned only for CUDA runs, views on the other side; the unique-id layers' unique ids made on the host
(padded to a bucket) give the model's outputs and gradients of ``torch.unique`` in the forward, with the true
count in the FLOPs ratio and LEV's health record; the keys that choose it, and those that restore the old path."""

import pytest
import torch

from leviathan_pretrain.config import ConfigError, load_config
from leviathan_pretrain.data.transfer import ALIGN, KEYS, MicroBatch, Transfer, unique_ids, unique_ids_on_host
from leviathan_pretrain.model.inputs import TokenIdError, UniqueIds
from leviathan_pretrain.model.lev import lev_health
from leviathan_pretrain.parallel.groups import seed_everything
from tests.multiproc import one_rank_world
from tests.test_model import batch, make, small


def plain(b=3, s=5, seed=0, vocab=50) -> dict:
    """What ``bench_step.zipf_batches`` hands over: views of one id tensor (not contiguous), a float mask."""
    ids = torch.randint(0, vocab, (b, s + 1), generator=torch.Generator().manual_seed(seed))
    pos = torch.arange(s)[None].expand(b, s)
    return {"tokens": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": torch.rand(b, s), "position_ids": pos}


# ---------------------------------------------------------------- packing
@pytest.mark.parametrize("bucket", [None, 1, 8])
def test_packed_micro_batch_is_one_aligned_buffer_and_round_trips(bucket):
    mb = plain()
    got = Transfer(packed=True, pin=False, unique_bucket=bucket).prepare(mb)
    assert isinstance(got, MicroBatch) and sorted(got) == sorted(KEYS)
    assert got.buffer.dtype == torch.uint8 and got.buffer.dim() == 1 and not got.buffer.is_pinned()
    names = [name for name, *_ in got.layout]
    assert names == [*KEYS] + (["unique_ids", "inverse"] if bucket else [])
    assert all(off % ALIGN == 0 for *_, off in got.layout)
    for k in KEYS:  # the host tensors: the same values, as int64 / float32 views of the buffer
        assert torch.equal(got[k], mb[k].to(got[k].dtype))
        assert got[k].dtype == (torch.float32 if k == "loss_mask" else torch.int64)
        assert got[k].untyped_storage().data_ptr() == got.buffer.untyped_storage().data_ptr()
    dev = got.to_device("cpu")  # on the CPU: views of the same buffer, no copy
    for k in KEYS:
        assert torch.equal(getattr(dev, k), got[k])
    assert (dev.unique is None) == (bucket is None)
    got["tokens"][0, 0] = 49  # what is sent is the buffer: a change of the host view reaches the device side
    assert int(got.to_device("cpu").tokens[0, 0]) == 49
    assert Transfer().prepare(got) is got  # prepared once: handed on as it is


def test_unpacked_path_sends_each_tensor_as_it_is():
    """``data.packed_transfer=false``: the old path, each tensor ``.to(device)`` on its own, dtypes untouched."""
    mb = plain()
    got = Transfer(packed=False, unique_bucket=None).prepare(mb)
    assert got.buffer is None and got.unique is None
    dev = got.to_device("cpu")
    assert all(getattr(dev, k) is mb[k] for k in KEYS)  # .to(cpu) of a CPU tensor: itself, as before


def test_host_unique_ids_are_torch_unique_padded_with_the_last_id():
    x = plain(4, 64)["tokens"]
    ref_ids, ref_inv = torch.unique(x, return_inverse=True)
    for bucket in (1, 7, 256):
        ids, inv, count = unique_ids(x, bucket)
        assert count == ref_ids.numel() and ids.numel() % bucket == 0 and ids.numel() - count < bucket
        assert torch.equal(ids[:count], ref_ids) and torch.equal(inv, ref_inv) and torch.equal(ids[inv], x)
        assert (ids[count:] == ref_ids[-1]).all()  # padding: a valid id, computed and never indexed


# ---------------------------------------------------------------- the keys
def cfg(*over):
    return load_config(None, ["model.vocab_size=512", *over])


def test_transfer_for_run_follows_the_keys_and_the_device():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # naming a device touches no GPU
    t = Transfer.for_run(cfg("model.variant=lev"), cuda)
    assert (t.packed, t.pin, t.unique_bucket) == (True, True, 256)
    assert Transfer.for_run(cfg("model.variant=lev"), cpu).pin is False  # never pinned on the CPU
    assert Transfer.for_run(cfg("model.variant=albert", "data.unique_bucket=64"), cpu).unique_bucket == 64
    assert Transfer.for_run(cfg("model.variant=tied"), cuda).unique_bucket is None  # a table has no unique ids
    assert Transfer.for_run(cfg("model.variant=tied", "data.unique_ids=host"), cuda).unique_bucket is None
    assert Transfer.for_run(cfg("model.variant=lev", "data.unique_ids=device"), cuda).unique_bucket is None
    assert not unique_ids_on_host(cfg("model.variant=lev", "parallel.pipeline_engine=true"))  # auto: device there
    old = Transfer.for_run(cfg("data.packed_transfer=false", "data.unique_ids=device"), cuda)
    assert (old.packed, old.pin, old.unique_bucket) == (False, False, None)  # the old path, whole


def test_bad_unique_id_settings_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"data\.unique_ids: host needs the PP = 1 engine.*pipeline engine"):
        cfg("data.unique_ids=host", "parallel.pipeline_engine=true")
    with pytest.raises(ConfigError, match=r"data\.unique_ids: host needs the PP = 1 engine"):
        cfg("data.unique_ids=host", "parallel.pipeline_parallel=2", "model.num_layers=2")
    with pytest.raises(ConfigError, match=r"data\.unique_ids: must be auto, host or device"):
        cfg("data.unique_ids=gpu")
    with pytest.raises(ConfigError, match=r"data\.unique_bucket: must be >= 1"):
        cfg("data.unique_bucket=0")


def test_trainer_batches_check_ids_before_preparing():
    """The data loader checks the ids on the host (the readable ``TokenIdError``) before it packs them."""
    from leviathan_pretrain.data.datasets import Batches
    from tests.test_lev_chunks import Samples

    prep = Transfer(unique_bucket=4).prepare
    mbs = Batches(Samples(8), 2, 1, 0, 8, vocab_size=50, prepare=prep).global_batch(0)
    assert len(mbs) == 4 and all(isinstance(mb, MicroBatch) and mb.unique.count > 0 for mb in mbs)
    with pytest.raises(TokenIdError, match="token id 70 is outside"):
        Batches(Samples(8, bad=70), 2, 1, 0, 8, vocab_size=50, prepare=prep).global_batch(0)


# ---------------------------------------------------------------- the model with host unique ids
@pytest.fixture(scope="module")
def world():
    with one_rank_world(small("lev").parallel) as env:
        yield env


def forward_backward(variant, unique=None, *extra):
    seed_everything(1, torch.device("cpu"))
    model = make(small(variant, *extra), seed=3)
    x, y, pos = batch()
    kw = {} if unique is None else {"unique": UniqueIds(*unique_ids(x, unique))}
    loss = model(x, pos, None, labels=y, loss_mask=torch.ones(x.shape), **kw)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, model


@pytest.mark.parametrize("variant", ["lev", "albert"])
def test_host_unique_ids_give_the_forwards_outputs_and_gradients(world, variant):
    """Against ``torch.unique`` in the forward: unpadded (bucket 1), the same computation, bitwise; padded to
    256 ids (94 true ones here), the loss bitwise and every gradient within 1e-6 of its largest element: the
    spline product and the GEMMs over a longer id axis sum in another order (measured on this CPU: LEV 5.0e-7,
    its rows 6.8e-8 relative; ALBERT's projection 3.4e-8; in bf16 both bitwise). Every parameter gets a
    gradient either way; the FLOPs ratio and LEV's health figures (ids, rows, saturation) count the true ids."""
    ref_loss, ref, ref_model = forward_backward(variant)
    for bucket in (1, 256):
        loss, grads, model = forward_backward(variant, bucket)
        assert torch.equal(loss, ref_loss) and sorted(grads) == sorted(ref)
        for n, g in ref.items():
            if bucket == 1:
                assert torch.equal(grads[n], g), n
            else:
                assert (grads[n] - g).abs().max() <= 1e-6 * g.abs().max(), n
        assert model.input_layer.last_unique_ratio == ref_model.input_layer.last_unique_ratio == 94 / 128
        if variant == "lev":
            got, want = lev_health(model), lev_health(ref_model)
            assert got["lev/unique_ids"] == want["lev/unique_ids"] == 94
            assert model.input_layer._health["m"].shape == ref_model.input_layer._health["m"].shape
            # the saturation of the spline inputs over the true ids only (the padding repeats the last id)
            assert abs(got["lev/u_edge_frac"] - want["lev/u_edge_frac"]) <= 1e-7


def test_host_unique_ids_that_do_not_fit_the_batch_are_refused(world):
    model = make(small("lev"))
    x, y, pos = batch()
    ids, inv, count = unique_ids(x)
    with pytest.raises(ValueError, match=r"unique: inverse \(4, 31\) for input_ids \(4, 32\)"):
        model(x, pos, None, labels=y, unique=UniqueIds(ids, inv[:, 1:], count))


# ---------------------------------------------------------------- through the trainer
@pytest.mark.multiproc
def test_training_with_host_unique_ids_logs_the_device_paths_losses():
    """LEV, 2 gloo ranks (DP 2), 10 steps with validation, through the trainer (``trainer.loop.run``): the unique
    ids made on the host unpadded (``data.unique_bucket=1``) and the old path whole (``data.unique_ids=device
    data.packed_transfer=false``) log ``data.unique_ids=device``'s training and validation losses and gradient
    norms exactly; padded to the default 256 ids within 1e-6 (the sums' order, see above); LEV's health record
    counts the same unique ids in every run (the true count, not the padded one). The same at TP = 2 (each TP rank
    gets the same host ids and computes its heads' partial rows from them): host unpadded and padded against
    device at TP = 2."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.workers.train_common import launch, records, spec, workdir

    common = ("train.steps=10", "train.eval_interval=5", "logging.log_interval=5", "parallel.zero_stage=1")
    runs = {
        "uid_device": ("data.unique_ids=device",),
        "uid_old": ("data.unique_ids=device", "data.packed_transfer=false"),
        "uid_host1": ("data.unique_ids=host", "data.unique_bucket=1"),
        "uid_host": ("data.unique_ids=host",),
    }
    tp2 = {
        "uid_device_tp2": ("parallel.tensor_parallel=2", "data.unique_ids=device"),
        "uid_host1_tp2": ("parallel.tensor_parallel=2", "data.unique_ids=host", "data.unique_bucket=1"),
        "uid_host_tp2": ("parallel.tensor_parallel=2", "data.unique_ids=host"),
    }
    out = launch("unique_ids", [spec(n, *common, *o) for n, o in {**runs, **tp2}.items()], nprocs=2)
    assert all(out["codes"][n] == {0: 0, 1: 0} for n in {**runs, **tp2})

    def logged(name, key):
        if key.startswith("lev/"):  # LEV's health: TensorBoard only, on log steps
            ea = EventAccumulator(str(workdir() / name / "tensorboard"), size_guidance={"scalars": 0})
            ea.Reload()
            return {e.step: e.value for e in ea.Scalars(key)}
        return {r["step"]: r[key] for r in records(name) if key in r}

    keys = ("loss", "grad_norm", "valid_loss", "lev/unique_ids", "lev/unique_ratio")
    ref = {k: logged("uid_device", k) for k in keys}
    assert sorted(ref["loss"]) == list(range(1, 11)) and sorted(ref["valid_loss"]) == [5, 10]
    assert sorted(ref["lev/unique_ids"]) == [5, 10] and all(v > 0 for v in ref["lev/unique_ids"].values())
    ref_tp2 = {k: logged("uid_device_tp2", k) for k in keys}
    assert sorted(ref_tp2["loss"]) == list(range(1, 11))
    for name, base in [("uid_old", ref), ("uid_host1", ref), ("uid_host", ref)] + [
        ("uid_host1_tp2", ref_tp2),
        ("uid_host_tp2", ref_tp2),
    ]:
        for key, want in base.items():
            got = logged(name, key)
            assert sorted(got) == sorted(want), (name, key)
            if name not in ("uid_host", "uid_host_tp2") or key.startswith("lev/"):  # padded: the sums' order
                assert got == want, (name, key, got, want)
            else:
                assert all(abs(got[s] - want[s]) <= 1e-6 * abs(want[s]) for s in want), (name, key, got, want)
