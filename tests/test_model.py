"""The GPT on megatron-core layers with every input variant, in-process on a world of 1 (gloo, TP = 1).

Training reduces the loss for every variant, the PP = 1 model and the DeepSpeed pipeline are one assembly
(same state dict, same loss), parameter counts equal the closed form (real and meta-device models), id
checks, weight-decay groups, FLOPs, model errors."""

import pytest
import torch

from leviathan_pretrain.config import VARIANTS, load_config
from leviathan_pretrain.model import counts
from leviathan_pretrain.model.assembly import build_model
from leviathan_pretrain.model.attention import SDPACoreAttention
from leviathan_pretrain.model.flops import model_flops_per_token
from leviathan_pretrain.model.gpt import build_transformer_config
from leviathan_pretrain.model.head import logits_of, masked_mean
from leviathan_pretrain.model.inputs import TokenIdError
from leviathan_pretrain.model.lev import LEVInput, lev_health, lev_layer
from leviathan_pretrain.model.settings import BuildSettings, ModelConfigError
from leviathan_pretrain.parallel.groups import seed_everything
from leviathan_pretrain.trainer.schedule import weight_decay_groups
from tests.multiproc import one_rank_world
from tests.small_model import small_model_overrides

B, S, V = 4, 32, 1000


def small(variant, *extra):
    return load_config(None, [*small_model_overrides(variant, V, S), "parallel.precision=fp32", *extra])


def settings(cfg, **over):
    """``cfg.parallel`` with this world's tensor-parallel group (what trainer/engine.py passes)."""
    from megatron.core import parallel_state as ps

    return BuildSettings.from_parallel(cfg.parallel, tp_group=ps.get_tensor_model_parallel_group(), **over)


def make(cfg, seed=None):
    return build_model(cfg.model, settings(cfg), seed)


@pytest.fixture(scope="module")
def world():
    with one_rank_world(small("lev").parallel) as env:
        yield env


def batch(seed=0, vocab=V):
    g = torch.Generator().manual_seed(seed)
    # a skewed, text-like id distribution: many repeats per batch
    ids = (torch.rand(B, S + 1, generator=g) ** 3 * vocab).long()
    return ids[:, :-1], ids[:, 1:], torch.arange(S)[None].expand(B, S)


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_builds_and_training_reduces_loss(world, variant):
    cfg = small(variant)
    seed_everything(1, world.device)
    model = make(cfg)
    x, y, pos = batch()
    logits = model(x, pos, None)
    assert logits.shape == (B, S, 1024)  # padded vocab, vocab-parallel shard
    opt = torch.optim.AdamW(weight_decay_groups(model, 0.01), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = model(x, pos, None, labels=y)
        assert loss.shape == (B, S)
        loss = loss.mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_tied_shares_the_input_table_with_the_head(world):
    model = make(small("tied"))
    table = model.input_layer.word_embeddings.weight
    names = dict(model.named_parameters())
    assert names["tied_modules.embed.embedding.word_embeddings.weight"] is table
    assert not any("output_layer" in n for n in names)  # no head weight of its own
    x, _, pos = batch()
    with torch.no_grad():  # logits = final hidden @ table^T
        h = (x, pos)
        for f in model._funcs[:-1]:
            h = f(h)
        assert torch.equal(model(x, pos), (h @ table.t()).transpose(0, 1))
    untied = make(small("untied"))
    head = dict(untied.named_parameters())["4.output_layer.weight"]
    assert head.data_ptr() != untied.input_layer.word_embeddings.weight.data_ptr()


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_input_gives_distinct_tokens_distinct_rows_at_the_tiny_shapes(world, variant):
    """At the tiny configs' sizes (V = 16k: ALBERT's e is 3, the flat MLP's table is 1 wide) no input layer may
    map two tokens to one row; a LayerNorm on the flat MLP's 1-wide rows once made every row the same."""
    cfg = load_config(f"configs/tiny-cpu-{variant}.yaml", ["model.vocab_size=16000", "parallel.precision=fp32"])
    seed_everything(1, world.device)
    model = make(cfg)
    ids = torch.tensor([[0, 1, 2, 100, 4000, 8000, 15998, 15999]])
    with torch.no_grad():
        rows = model.input_layer(ids, torch.arange(ids.shape[1])[None]).reshape(-1, cfg.model.hidden_size)
    dist = torch.cdist(rows.double(), rows.double())
    off = dist[~torch.eye(len(rows), dtype=torch.bool)]
    assert off.min() > 1e-4 * rows.norm(dim=1).mean(), (variant, off.min().item())


@pytest.mark.parametrize("variant", VARIANTS)
def test_out_of_range_ids_raise_for_every_variant(world, variant):
    model = make(small(variant))
    x, y, pos = batch()
    for bad in (-3, V, 1023):  # 1023 is a padded row: still invalid
        x2 = x.clone()
        x2[1, 5] = bad
        with pytest.raises(TokenIdError, match=str(bad)):
            model(x2, pos, None, labels=y)


@pytest.mark.integration  # deepspeed.initialize: its op-compatibility checks compile with gcc
@pytest.mark.parametrize("variant", ["lev", "tied", "albert"])
def test_pp1_model_and_pipeline_are_one_assembly(world, variant, tmp_path):
    """The PP = 1 model and the DeepSpeed PipelineModule (one stage) built from the same pieces and seed have
    the same state dict (names and values, bitwise) and compute the same loss; the pipeline's checkpoint files
    hold the same keys, piece by piece (TIED: the shared table with piece 0)."""
    import deepspeed

    from leviathan_pretrain.trainer.pipeline_parallel import build_pipeline

    deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)
    cfg = small(variant)
    model = make(cfg, seed=5)
    pipe, pipe_loss = build_pipeline(cfg.model, settings(cfg), stages=1, data_parallel=1, seed=5)
    ours, theirs = model.state_dict(), pipe.state_dict()
    assert list(ours) == list(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours if torch.is_tensor(ours[k]))
    tied_key = "tied_modules.embed.embedding.word_embeddings.weight"
    assert ("0.embedding.codebooks.weight" in ours) == (variant == "lev") and (tied_key in ours) == (variant == "tied")
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    pipe.checkpoint_parallel_write_pipeline = False  # (the pipeline engine sets it)
    pipe.save_state_dict(str(tmp_path), TorchCheckpointEngine())
    files = {
        f"{int(f.name[6:8])}.{k}": v
        for f in tmp_path.glob("layer_*-model_states.pt")
        for k, v in torch.load(f, weights_only=True).items()
    }
    assert set(files) == {k.replace("tied_modules.embed.", "0.") for k in ours}
    x, y, pos = batch(1)
    mask = (torch.arange(S) % 3 != 0).expand(B, S).long()
    with torch.no_grad():
        out = pipe((x, pos))  # the fused head's operands: the loss function makes the loss from them
        assert logits_of(out).shape == (S, B, 1024)
        assert torch.equal(logits_of(out).transpose(0, 1), model(x, pos))
        assert torch.equal(pipe_loss(out, (y, mask)), model(x, pos, labels=y, loss_mask=mask))
        per_token = masked_mean(model(x, pos, labels=y), mask)  # the per-token path: same loss, other sum order
        assert abs(float(per_token) - float(pipe_loss(out, (y, mask)))) < 1e-6


@pytest.mark.parametrize("variant", VARIANTS)
def test_param_count_closed_form_equals_real_model(world, variant):
    model = make(small(variant))
    parts = counts.param_breakdown(small(variant).model)
    real = sum(p.numel() for p in model.parameters())
    assert real == parts["total"]
    assert sum(p.numel() for p in model.input_layer.parameters()) == parts["input"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_param_count_at_paper_scale_on_meta_device(world, variant):
    cfg = load_config(
        "configs/1.2b-tied.yaml", [f"model.variant={variant}", "parallel.device=cpu", "parallel.precision=fp32"]
    )
    with torch.device("meta"):
        model = make(cfg)
    assert sum(p.numel() for p in model.parameters()) == counts.param_breakdown(cfg.model)["total"]


def test_a_variant_added_through_the_registry_alone(world):
    """A toy input layer (tests/toy_variant.py: one module) and its registry entry, nothing else: the config
    accepts it, the closed-form count equals the model's, the planner and the FLOPs use its entry, it trains."""
    from leviathan_pretrain.model import variants
    from leviathan_pretrain.plan.planner import make_plan
    from tests.toy_variant import TOY, WIDTH, ToyInput

    with pytest.raises(Exception, match="unknown variant 'toy'"):
        small("toy")
    variants.register(TOY)
    try:
        cfg = small("toy")
        seed_everything(1, world.device)
        model = make(cfg)
        assert isinstance(model.input_layer, ToyInput)
        assert sum(p.numel() for p in model.input_layer.parameters()) == counts.input_params(cfg.model)
        assert sum(p.numel() for p in model.parameters()) == counts.param_breakdown(cfg.model)["total"]
        tied_flops = model_flops_per_token(small("untied"))
        assert model_flops_per_token(cfg) == tied_flops + 3.0 * 2 * WIDTH * cfg.model.hidden_size
        plan = make_plan(cfg, 1, 1, device="cpu", mem_limit_gb=None)
        assert plan.params_per_rank == counts.param_breakdown(cfg.model)["total"]
        x, y, pos = batch()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for _ in range(4):
            loss = model(x, pos, None, labels=y).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[-1] < losses[0], losses
    finally:
        variants.REGISTRY.pop("toy")


def test_weight_decay_groups(world):
    model = make(small("lev"))
    decay, no_decay = weight_decay_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    skipped = {names[id(p)] for p in no_decay["params"]}
    assert "0.embedding.codebooks.weight" in skipped
    assert {"0.embedding.spline_delta", "0.embedding.ln_weight", "0.embedding.ln_bias"} <= skipped
    assert "3.final_layernorm.weight" in skipped  # pieces: input, 2 layers, norm, head
    assert {"0.embedding.proj", "0.embedding.out_proj", "4.output_layer.weight"} <= decayed
    assert any("linear_qkv.weight" in n for n in decayed)
    decay2, _ = weight_decay_groups(model, 0.1, decay_lev_codebooks=True)
    assert "0.embedding.codebooks.weight" in {names[id(p)] for p in decay2["params"]}
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_model_flops_per_token():
    cfg = load_config("configs/1.2b-tied.yaml")
    n = counts.param_breakdown(cfg.model)
    f = model_flops_per_token(cfg)
    m = cfg.model
    norms = m.num_layers * 2 * m.hidden_size + m.hidden_size
    # causal attention as Megatron-LM counts it: QK^T and AV over s/2 keys on average, x3 (fwd + bwd)
    assert f == 6 * (n["body"] - norms + n["input"]) + 6 * m.num_layers * m.hidden_size * m.seq_length
    lev = load_config("configs/1.2b-lev.yaml")
    extra = model_flops_per_token(lev, unique_ratio=0.5) - f
    assert 0 < extra < 1e-3 * f  # LEV's own FLOPs are tiny at scale


def test_lev_health_through_the_model(world):
    model = make(small("lev"))
    assert isinstance(lev_layer(model), LEVInput) and lev_layer(model) is model.input_layer
    assert lev_layer(make(small("tied"))) is None
    x, y, pos = batch()
    model(x, pos, None, labels=y)
    stats = lev_health(model)
    assert stats["lev/unique_ids"] == x.unique().numel()
    assert set(f"lev/head{i}/out_norm" for i in range(4)) <= stats.keys()


def test_sdpa_core_attention_matches_causal_softmax_with_gqa(world):
    from megatron.core.transformer.enums import AttnMaskType

    tconfig = build_transformer_config(small("lev").model, BuildSettings(device="cpu"))
    attn = SDPACoreAttention(tconfig, layer_number=1, attn_mask_type=AttnMaskType.causal)
    g = torch.Generator().manual_seed(0)
    s, b, heads, groups, dim = 6, 2, 4, 2, 16
    q, k, v = (torch.randn(s, b, n, dim, generator=g) for n in (heads, groups, groups))
    out = attn(q, k, v, None)
    kk, vv = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, kk) / dim**0.5
    scores = scores.masked_fill(torch.triu(torch.ones(s, s, dtype=torch.bool), 1), float("-inf"))
    ref = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), vv).reshape(s, b, heads * dim)
    assert out.shape == (s, b, heads * dim)
    assert torch.allclose(out, ref, atol=1e-5)


def test_model_errors(world):
    """Settings that do not match the process group, or a model this device cannot run, raise
    ModelConfigError (a ValueError naming the setting); the trainer reports it as a config error."""
    from leviathan_pretrain.config import ConfigError
    from leviathan_pretrain.trainer.engine import build_module

    with pytest.raises(ModelConfigError, match="parallel.tensor_parallel=2 but the tensor-parallel group"):
        settings(small("lev", "parallel.tensor_parallel=2"))
    bad = small("lev", "model.attention_backend=megatron")
    with pytest.raises(ModelConfigError, match="model.attention_backend"):
        make(bad)
    with pytest.raises(ConfigError, match="model.attention_backend"):
        build_module(bad, torch.device("cpu"), 1)
    assert issubclass(ModelConfigError, ValueError) and not issubclass(ModelConfigError, ConfigError)


def test_gpu_initialises_megatron_layers_on_the_device():
    """On a GPU megatron-core must not build full V x D master tables on every rank's CPU (1.6 GB twice at
    V=200k): use_cpu_initialization is on only for CPU runs or parallel.init_on_cpu (TP=N == TP=1 weights)."""

    def tconfig(cfg, device):
        return build_transformer_config(cfg.model, BuildSettings.from_parallel(cfg.parallel, device=device))

    cfg = load_config("configs/400m-lev.yaml", ["parallel.precision=bf16"])
    assert tconfig(cfg, "cuda").use_cpu_initialization is False
    assert tconfig(cfg, "cpu").use_cpu_initialization is True
    on_cpu = load_config("configs/400m-lev.yaml", ["parallel.init_on_cpu=true"])
    assert tconfig(on_cpu, "cuda").use_cpu_initialization is True
