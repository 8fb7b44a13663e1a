"""model.recompute (model/recompute.py), in-process on a world of 1 (gloo, TP = 1): every mode gives the loss and
every gradient of no recompute, bit for bit; it recomputes what it says (the recomputed modules run twice in a
training step, once in evaluation) and keeps less (autograd's saved tensors, counted by a saved-tensors hook);
bad settings are refused at load. TP = 2 and the pipeline: tests/test_recompute_tp.py."""

import pytest
import torch

from leviathan_pretrain.config import ConfigError, load_config
from leviathan_pretrain.model.assembly import build_model
from leviathan_pretrain.model.gpt import BlockPiece
from leviathan_pretrain.model.settings import BuildSettings
from leviathan_pretrain.parallel.groups import seed_everything
from tests.multiproc import one_rank_world
from tests.small_model import small_model_overrides

B, S, V = 2, 32, 1000
MODES = {
    "selective core_attn": ["model.recompute=selective"],
    "selective mlp": ["model.recompute=selective", "model.recompute_modules=[mlp]"],
    "selective both": ["model.recompute=selective", "model.recompute_modules=[core_attn,mlp]"],
    "full": ["model.recompute=full"],
    "full, first layer": ["model.recompute=full", "model.recompute_layers=1"],
}


def small(variant, *extra):
    return load_config(None, [*small_model_overrides(variant, V, S), "parallel.precision=fp32", *extra])


@pytest.fixture(scope="module")
def world():
    with one_rank_world(small("lev").parallel) as env:
        yield env


def make(cfg):
    from megatron.core import parallel_state as ps

    seed_everything(1, torch.device("cpu"))
    return build_model(
        cfg.model, BuildSettings.from_parallel(cfg.parallel, tp_group=ps.get_tensor_model_parallel_group())
    )


def step(model):
    """Loss and every gradient of one training step, and the bytes autograd saved for backward."""
    g = torch.Generator().manual_seed(0)
    ids = (torch.rand(B, S + 1, generator=g) ** 3 * V).long()
    pos = torch.arange(S)[None].expand(B, S)
    saved = []

    def pack(t):
        saved.append(t.untyped_storage().nbytes() if t.device.type != "meta" else 0)
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids[:, :-1], pos, None, labels=ids[:, 1:]).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, sum(saved)


@pytest.mark.parametrize("variant", ["lev", "tied"])
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_gives_the_loss_and_gradients_of_no_recompute(world, variant, mode):
    loss0, grads0, saved0 = step(make(small(variant)))
    loss, grads, saved = step(make(small(variant, *MODES[mode])))
    assert torch.equal(loss, loss0)
    assert grads.keys() == grads0.keys() and len(grads) >= 14
    for name, g in grads.items():
        assert torch.equal(g, grads0[name]), name
    if mode != "selective core_attn":  # SDPA keeps no more than the core attention's inputs and output
        assert saved < saved0, (saved, saved0)


def test_full_keeps_least_and_recomputes_each_marked_layer_once_more(world):
    calls = {}

    def counting(model):
        for i, piece in enumerate(p for p in model._funcs if isinstance(p, BlockPiece)):
            piece.layer.mlp.register_forward_pre_hook(lambda *a, i=i: calls.__setitem__(i, calls.get(i, 0) + 1))
        return model

    saved = {m: step(make(small("lev", *MODES[m])))[2] for m in ("selective mlp", "full, first layer", "full")}
    assert saved["full"] < saved["full, first layer"] < step(make(small("lev")))[2]
    assert saved["full"] < saved["selective mlp"]
    model = counting(make(small("lev", *MODES["full, first layer"])))
    step(model)
    assert calls == {0: 2, 1: 1}  # layer 1 forward + its recompute; layer 2 once
    calls.clear()
    with torch.no_grad():
        model.eval()
        model(torch.zeros(B, S, dtype=torch.long), torch.arange(S)[None].expand(B, S), None)
    assert calls == {0: 1, 1: 1}  # evaluation: no recompute


def test_selective_swaps_the_class_and_keeps_the_state_dict(world):
    plain, sel = make(small("lev")), make(small("lev", *MODES["selective both"]))
    assert plain.state_dict().keys() == sel.state_dict().keys()
    block = next(p for p in sel._funcs if isinstance(p, BlockPiece))
    assert type(block.layer.mlp).__name__ == "RecomputedMLP"
    assert type(block.layer.self_attention.core_attention).__name__ == "RecomputedSDPACoreAttention"


@pytest.mark.parametrize(
    "over, key",
    [
        (["model.recompute=some"], "model.recompute"),
        (["model.recompute=selective", "model.recompute_modules=[attn]"], "model.recompute_modules"),
        (["model.recompute=selective", "model.recompute_modules=[]"], "model.recompute_modules"),
        (["model.recompute=selective", "model.recompute_layers=1"], "model.recompute_layers"),
        (["model.recompute=full", "model.recompute_layers=3"], "model.recompute_layers"),  # 2 layers
        (["model.recompute=full", "model.compile=true"], "model.recompute"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(over, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        small("lev", *over)
