"""The megatron-core GPT with every input variant, in-process on a world of 1 (gloo, TP = 1).

Training reduces the loss for every variant, stage blocks (pipe path) reproduce GPTModel, parameter
counts equal the closed form (real and meta-device models), id checks, weight-decay groups, FLOPs."""
import os

import pytest
import torch

from leviathan_pretrain.config import VARIANTS, load_config
from leviathan_pretrain.model import sizes
from leviathan_pretrain.model.accounting import model_flops_per_token, weight_decay_groups
from leviathan_pretrain.model.attention import SDPACoreAttention
from leviathan_pretrain.model.gpt import (build_input_layer, build_layer_spec, build_model, build_output_head,
                                          build_rotary, build_transformer_config)
from leviathan_pretrain.model.inputs import TokenIdError
from leviathan_pretrain.model.lev import lev_health
from leviathan_pretrain.parallel import destroy_distributed, init_distributed, seed_everything

B, S, V = 4, 32, 1000
RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def small(variant, *extra):
    return load_config(None, [
        f"model.variant={variant}", f"model.vocab_size={V}", "model.hidden_size=64", "model.num_layers=2",
        "model.num_attention_heads=4", "model.num_query_groups=2", f"model.seq_length={S}",
        "model.lev.seed_dim=16", "model.lev.heads=4", "model.lev.knots=6", "model.lev.rank=8",
        "parallel.device=cpu", "parallel.precision=fp32", *extra])


@pytest.fixture(scope="module")
def world():
    saved = {k: os.environ.get(k) for k in RANK_VARS}
    for k in RANK_VARS:
        os.environ.pop(k, None)
    env = init_distributed(small("lev").parallel)
    yield env
    destroy_distributed()
    for k, v in saved.items():
        os.environ.pop(k, None)
        if v is not None:
            os.environ[k] = v


def batch(seed=0, vocab=V):
    g = torch.Generator().manual_seed(seed)
    # a skewed, text-like id distribution: many repeats per batch
    ids = (torch.rand(B, S + 1, generator=g) ** 3 * vocab).long()
    return ids[:, :-1], ids[:, 1:], torch.arange(S)[None].expand(B, S)


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_builds_and_training_reduces_loss(world, variant):
    cfg = small(variant)
    seed_everything(1, world.device)
    model = build_model(cfg)
    x, y, pos = batch()
    logits = model(x, pos, None)
    assert logits.shape == (B, S, 1024)                               # padded vocab, vocab-parallel shard
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
    model = build_model(small("tied"))
    assert model.output_layer.weight is None
    assert model.shared_embedding_or_output_weight() is model.embedding.word_embeddings.weight
    assert getattr(model.embedding.word_embeddings.weight, "is_embedding_or_output_parameter", False)
    untied = build_model(small("untied"))
    assert untied.output_layer.weight is not None
    assert untied.output_layer.weight.data_ptr() != untied.embedding.word_embeddings.weight.data_ptr()


@pytest.mark.parametrize("variant", VARIANTS)
def test_out_of_range_ids_raise_for_every_variant(world, variant):
    model = build_model(small(variant))
    x, y, pos = batch()
    for bad in (-3, V, 1023):                                          # 1023 is a padded row: still invalid
        x2 = x.clone()
        x2[1, 5] = bad
        with pytest.raises(TokenIdError, match=str(bad)):
            model(x2, pos, None, labels=y)


@pytest.mark.parametrize("variant", ["lev", "tied", "albert"])
def test_pipeline_stage_blocks_reproduce_gptmodel(world, variant):
    """build_input_layer + TransformerLayers from build_layer_spec + build_output_head = GPTModel."""
    from megatron.core.transformer.spec_utils import build_module
    cfg = small(variant)
    seed_everything(2, world.device)
    model = build_model(cfg)
    tconfig = build_transformer_config(cfg)
    first = build_input_layer(cfg, tconfig)
    layers = [build_module(build_layer_spec(cfg), config=tconfig, layer_number=i + 1) for i in range(2)]
    head = build_output_head(cfg, tconfig)
    rotary = build_rotary(cfg, tconfig)
    first.load_state_dict(model.embedding.state_dict())
    for layer, ref in zip(layers, model.decoder.layers):
        layer.load_state_dict(ref.state_dict())
    head.final_layernorm.load_state_dict(model.decoder.final_layernorm.state_dict())
    if variant != "tied":
        head.output_layer.load_state_dict(model.output_layer.state_dict())
    x, y, pos = batch(1)
    with torch.no_grad():
        h = first(x)
        emb = rotary(S)
        for layer in layers:
            h, _ = layer(h, attention_mask=None, rotary_pos_emb=emb)
        weight = first.word_embeddings.weight if variant == "tied" else None
        logits = head(h, weight=weight)
        loss = head.loss(logits, y)
        ref = model(x, pos, None, labels=y)
    assert logits.shape == (S, B, 1024)
    assert torch.allclose(loss, ref, atol=1e-6)


@pytest.mark.parametrize("variant", VARIANTS)
def test_param_count_closed_form_equals_real_model(world, variant):
    model = build_model(small(variant))
    counts = sizes.param_breakdown(small(variant).model)
    real = sum(p.numel() for p in model.parameters())
    assert real == counts["total"]
    assert sum(p.numel() for p in model.embedding.parameters()) == counts["input"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_param_count_at_paper_scale_on_meta_device(world, variant):
    cfg = load_config("configs/1.2b-tied.yaml", [f"model.variant={variant}", "parallel.device=cpu",
                                                 "parallel.precision=fp32"])
    with torch.device("meta"):
        model = build_model(cfg)
    assert sum(p.numel() for p in model.parameters()) == sizes.param_breakdown(cfg.model)["total"]


def test_weight_decay_groups(world):
    model = build_model(small("lev"))
    decay, no_decay = weight_decay_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    skipped = {names[id(p)] for p in no_decay["params"]}
    assert "embedding.codebooks.weight" in skipped
    assert {"embedding.spline_delta", "embedding.ln_weight", "embedding.ln_bias"} <= skipped
    assert "decoder.final_layernorm.weight" in skipped
    assert {"embedding.proj", "embedding.out_proj", "output_layer.weight"} <= decayed
    assert any("linear_qkv.weight" in n for n in decayed)
    decay2, _ = weight_decay_groups(model, 0.1, decay_lev_codebooks=True)
    assert "embedding.codebooks.weight" in {names[id(p)] for p in decay2["params"]}
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_model_flops_per_token():
    cfg = load_config("configs/1.2b-tied.yaml")
    n = sizes.param_breakdown(cfg.model)
    f = model_flops_per_token(cfg)
    m = cfg.model
    norms = m.num_layers * 2 * m.hidden_size + m.hidden_size
    # causal attention as Megatron-LM counts it: QK^T and AV over s/2 keys on average, x3 (fwd + bwd)
    assert f == 6 * (n["body"] - norms + n["input"]) + 6 * m.num_layers * m.hidden_size * m.seq_length
    lev = load_config("configs/1.2b-lev.yaml")
    extra = model_flops_per_token(lev, unique_ratio=0.5) - f
    assert 0 < extra < 1e-3 * f                                       # LEV's own FLOPs are tiny at scale


def test_lev_health_through_the_model(world):
    model = build_model(small("lev"))
    x, y, pos = batch()
    model(x, pos, None, labels=y)
    stats = lev_health(model)
    assert stats["lev/unique_ids"] == x.unique().numel()
    assert set(f"lev/head{i}/out_norm" for i in range(4)) <= stats.keys()


def test_sdpa_core_attention_matches_causal_softmax_with_gqa(world):
    from megatron.core.transformer.enums import AttnMaskType
    tconfig = build_transformer_config(small("lev"))
    attn = SDPACoreAttention(tconfig, layer_number=1, attn_mask_type=AttnMaskType.causal)
    g = torch.Generator().manual_seed(0)
    s, b, heads, groups, dim = 6, 2, 4, 2, 16
    q, k, v = (torch.randn(s, b, n, dim, generator=g) for n in (heads, groups, groups))
    out = attn(q, k, v, None)
    kk, vv = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, kk) / dim ** 0.5
    scores = scores.masked_fill(torch.triu(torch.ones(s, s, dtype=torch.bool), 1), float("-inf"))
    ref = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), vv).reshape(s, b, heads * dim)
    assert out.shape == (s, b, heads * dim)
    assert torch.allclose(out, ref, atol=1e-5)


def test_build_model_refuses_mismatched_parallel_state(world):
    from leviathan_pretrain.config import ConfigError
    with pytest.raises(ConfigError, match="parallel.tensor_parallel"):
        build_model(small("lev", "parallel.tensor_parallel=2"))
    with pytest.raises(ConfigError, match="parallel.pipeline_parallel"):
        build_model(small("lev", "parallel.pipeline_parallel=2"))


def test_gpu_initialises_megatron_layers_on_the_device():
    """On a GPU megatron-core must not build full V x D master tables on every rank's CPU (1.6 GB twice at
    V=200k): use_cpu_initialization is on only for CPU runs or parallel.init_on_cpu (TP=N == TP=1 weights)."""
    from leviathan_pretrain.model import build_transformer_config
    cfg = load_config("configs/400m-lev.yaml", ["parallel.precision=bf16"])
    assert build_transformer_config(cfg, "cuda").use_cpu_initialization is False
    assert build_transformer_config(cfg, "cpu").use_cpu_initialization is True
    on_cpu = load_config("configs/400m-lev.yaml", ["parallel.init_on_cpu=true"])
    assert build_transformer_config(on_cpu, "cuda").use_cpu_initialization is True
