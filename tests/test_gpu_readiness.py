"""First-run readiness on a GPU node, checked on the CPU: what would break on a cluster image.

- ``model.attention_backend: auto`` is SDPA on CUDA too (no s x s fp32 scores), without touching CUDA;
- the final norm is the layers' torch RMSNorm, so the model builds where Apex is importable (its
  ``FusedLayerNorm`` refuses RMSNorm) — checked in a subprocess with a fake ``apex`` on ``sys.path``;
- RoPE follows the hidden states' device, never CUDA because CUDA exists;
- ``benchmarks/bench_train.py`` sets ``DS_ACCELERATOR=cpu`` only for a CPU run;
- a missing/broken TensorBoard fails the trainer at start, before the data checks and the model, naming the fix.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from leviathan_pretrain.config import load_config
from leviathan_pretrain.model.attention import CPUSafeRotaryEmbedding, SDPACoreAttention
from leviathan_pretrain.model.gpt import (
    BlockPiece,
    FinalNorm,
    attention_backend,
    build_layer_spec,
    build_transformer_config,
)
from leviathan_pretrain.model.settings import BuildSettings
from tests import benchmark_scripts
from tests.multiproc import RANK_VARS, REPO, base_env, no_cuda_touch, one_rank_world

TINY = "configs/tiny-cpu-lev.yaml"


def tiny(*extra):
    return load_config(TINY, ["parallel.precision=fp32", *extra])


@pytest.fixture(scope="module")
def world():
    with one_rank_world(tiny().parallel) as env:
        yield env


def run_python(*args, pythonpath: list, timeout: float = 240) -> subprocess.CompletedProcess:
    """``python ARGS`` in the repository as a single process: no rank variables (this module's own world group
    set them), ``pythonpath`` first on ``sys.path``."""
    env = base_env({"PYTHONPATH": os.pathsep.join(str(p) for p in [*pythonpath, REPO])})
    for k in RANK_VARS:
        env.pop(k, None)
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def settings(cfg):
    from megatron.core import parallel_state as ps

    return BuildSettings.from_parallel(cfg.parallel, tp_group=ps.get_tensor_model_parallel_group())


# ---------------------------------------------------------------- attention


def test_auto_attention_is_sdpa_on_cuda_without_touching_cuda(monkeypatch):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    no_cuda_touch(monkeypatch, available=False)
    m = load_config("configs/400m-lev.yaml", []).model
    assert m.attention_backend == "auto"
    cuda = BuildSettings(device="cuda", precision="bf16")
    assert attention_backend(m, cuda) == "sdpa"
    assert attention_backend(m, BuildSettings(device="cpu")) == "sdpa"
    core = build_layer_spec(m, cuda).submodules.self_attention.submodules.core_attention
    assert core is SDPACoreAttention
    explicit = load_config("configs/400m-lev.yaml", ["model.attention_backend=megatron"]).model
    assert attention_backend(explicit, cuda) == "megatron"  # still there as an explicit choice on CUDA
    core = build_layer_spec(explicit, cuda).submodules.self_attention.submodules.core_attention
    assert core is DotProductAttention


# ---------------------------------------------------------------- final norm


def test_final_norm_is_the_layers_torch_rmsnorm_with_the_same_numerics(world):
    cfg = tiny()
    build = settings(cfg)
    tconfig = build_transformer_config(cfg.model, build)
    norm = FinalNorm(cfg.model, build, tconfig)
    block = BlockPiece(cfg.model, build, tconfig, layer_number=1)
    assert type(norm.final_layernorm) is type(block.layer.input_layernorm) is torch.nn.RMSNorm
    assert list(norm.state_dict()) == ["final_layernorm.weight"]  # checkpoints keep loading
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        norm.final_layernorm.weight.copy_(torch.rand(cfg.model.hidden_size, generator=g) + 0.5)
    x = torch.randn(5, 2, cfg.model.hidden_size, generator=g) * 3
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.model.norm_epsilon) * norm.final_layernorm.weight
    assert norm.final_layernorm.eps == cfg.model.norm_epsilon
    torch.testing.assert_close(norm(x), ref, rtol=1e-6, atol=1e-6)


FAKE_APEX = {
    "apex/__init__.py": "",
    "apex/normalization/__init__.py": "from .fused_layer_norm import FusedLayerNorm, FusedLayerNormAffineFunction\n",
    "apex/normalization/fused_layer_norm.py": """
        import torch


        class FusedLayerNormAffineFunction(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *args):
                raise RuntimeError("fake apex: fused layer norm kernel called")


        class FusedLayerNorm(torch.nn.Module):  # Apex's LayerNorm: no RMSNorm
            def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, normalization="LayerNorm"):
                super().__init__()
                if normalization != "LayerNorm":
                    raise ValueError(f"fake apex: FusedLayerNorm does not support {normalization}")
        """,
}

BUILD_WITH_APEX = """
import os, sys
import apex  # the fake one, first on sys.path
assert apex.__file__.startswith(sys.argv[1]), apex.__file__
import torch
from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
from megatron.core.transformer import transformer_block
assert transformer_block.HAVE_APEX and transformer_block.LayerNormImpl is FusedLayerNorm  # the cluster case
from megatron.core import parallel_state as ps
from leviathan_pretrain.config import load_config
from leviathan_pretrain.model.settings import BuildSettings
from leviathan_pretrain.model.assembly import build_model
from leviathan_pretrain.parallel.groups import destroy_distributed, init_distributed

for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
    os.environ.pop(k, None)
cfg = load_config("configs/tiny-cpu-lev.yaml", ["parallel.precision=fp32"])
init_distributed(cfg.parallel)
build = BuildSettings.from_parallel(cfg.parallel, tp_group=ps.get_tensor_model_parallel_group())
model = build_model(cfg.model, build, 1)
ids = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
loss = model(ids, torch.arange(16)[None].expand(2, 16), None, labels=ids)
assert loss.shape == (2, 16) and torch.isfinite(loss).all()
from leviathan_pretrain.model.gpt import FinalNorm
print("BUILT", *(type(m.final_layernorm).__name__ for m in model.modules() if isinstance(m, FinalNorm)), flush=True)
destroy_distributed()
"""


@pytest.mark.multiproc
def test_model_builds_and_runs_where_apex_is_importable(tmp_path):
    """megatron-core's ``LayerNormImpl`` is Apex's ``FusedLayerNorm`` whenever ``import apex`` works, and that
    refuses RMSNorm: the final norm must not use it (the old ``FinalNorm`` failed here)."""
    for rel, text in FAKE_APEX.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(textwrap.dedent(text))
    (tmp_path / "build.py").write_text(BUILD_WITH_APEX)
    proc = run_python(str(tmp_path / "build.py"), str(tmp_path), pythonpath=[tmp_path])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "BUILT RMSNorm" in proc.stdout, proc.stdout[-2000:]


# ---------------------------------------------------------------- RoPE


def rope_reference(seq: int, dim: int, base: float) -> torch.Tensor:
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


def rope16() -> CPUSafeRotaryEmbedding:
    return CPUSafeRotaryEmbedding(kv_channels=16, rotary_percent=1.0, rotary_base=500, use_cpu_initialization=True)


def test_rope_stays_on_the_cpu_when_cuda_exists(monkeypatch):
    no_cuda_touch(monkeypatch, available=True)  # a GPU node running parallel.device=cpu / evaluate --device cpu
    for call in (lambda r: r(7, device=torch.device("cpu")), lambda r: r(7)):
        rotary = rope16()
        emb = call(rotary)
        assert emb.device.type == "cpu" and rotary.inv_freq.device.type == "cpu"
        torch.testing.assert_close(emb, rope_reference(7, 16, 500.0))
        assert call(rotary) is emb  # kept for the next micro-batch
    # it follows the device it is given, also after an embedding for another device was kept
    assert rotary(7, device=torch.device("meta")).device.type == "meta" and rotary.inv_freq.device.type == "meta"


def test_block_forward_on_cpu_does_not_touch_cuda_when_cuda_exists(world, monkeypatch):
    cfg = tiny()
    build = settings(cfg)
    tconfig = build_transformer_config(cfg.model, build)
    torch.manual_seed(3)
    ref_piece = BlockPiece(cfg.model, build, tconfig, layer_number=1)
    piece = BlockPiece(cfg.model, build, tconfig, layer_number=1)
    piece.load_state_dict(ref_piece.state_dict())
    x = torch.randn(cfg.model.seq_length, 2, cfg.model.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = ref_piece(x)
        no_cuda_touch(monkeypatch, available=True)
        out = piece(x)
    assert out.device.type == "cpu" and piece.rotary.inv_freq.device.type == "cpu"
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


# ---------------------------------------------------------------- benchmarks/bench_train.py


def load_bench():
    return benchmark_scripts.load("bench_train")


def test_bench_train_sets_the_cpu_accelerator_only_for_cpu_runs(monkeypatch):
    bench = load_bench()
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    gpu = load_config("configs/400m-lev.yaml", [])  # parallel.device: auto
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert bench.launch_env(gpu)["DS_ACCELERATOR"] == "cuda"
    assert bench.launch_env(load_config(TINY, []))["DS_ACCELERATOR"] == "cpu"  # tiny-cpu: parallel.device=cpu
    assert bench.launch_env(load_config("configs/400m-lev.yaml", ["parallel.device=cpu"]))["DS_ACCELERATOR"] == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.launch_env(gpu)["DS_ACCELERATOR"] == "cpu"  # auto on a CPU machine: as before
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")
    assert bench.launch_env(gpu)["DS_ACCELERATOR"] == "xpu"  # one already set wins
    assert bench.launch_env(gpu)["PYTHONPATH"] == str(REPO)


# ---------------------------------------------------------------- TensorBoard


@pytest.mark.multiproc
def test_missing_tensorboard_fails_at_start_naming_the_fix(tmp_path):
    fake = tmp_path / "site"
    (fake / "tensorboard").mkdir(parents=True)
    (fake / "tensorboard" / "__init__.py").write_text("raise ImportError(\"No module named 'tensorboard' (hidden)\")\n")
    missing = str(tmp_path / "no-such-shard")

    def train(*extra):
        return run_python(
            "-m",
            "leviathan_pretrain.train",
            "--config",
            TINY,
            f"data.prefixes=[{missing}]",
            f"train.out_dir={tmp_path / 'out'}",
            *extra,
            pythonpath=[fake],
        )

    proc = train()
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: logging.tensorboard: TensorBoard cannot be imported"), last
    assert "pip install tensorboard==2.21.0" in last and "logging.tensorboard=false" in last
    assert "data shard" not in proc.stderr  # checked before the data (and so before any model is built)
    off = train("logging.tensorboard=false")  # the way out it names: the run gets on to the next check
    assert off.returncode == 2 and off.stderr.strip().splitlines()[-1].startswith(f"error: data shard {missing}")


# ---------------------------------------------------------------- initial weights on a GPU


def test_each_piece_reseeds_megatrons_cuda_tracker_where_a_gpu_run_seeded_it(world, monkeypatch):
    """On a GPU without parallel.init_on_cpu megatron-core draws its layers' TP shards from its CUDA RNG
    tracker's model-parallel state. ``seed_everything`` seeds it per rank with ``train.seed + 100 * pp_rank``,
    so a stage's weights depended on the pipeline split; ``seed_piece`` now reseeds it with the piece's own seed
    (``train.seed + i``, as the PP = 1 model and DeepSpeed's PipelineModule both call it). The CUDA calls are
    recorded (no GPU here); a CPU run, whose tracker was never seeded, never calls them."""
    from megatron.core import tensor_parallel

    from leviathan_pretrain.model.assembly import build_model, seed_piece

    calls = []
    monkeypatch.setattr(tensor_parallel, "model_parallel_cuda_manual_seed", lambda s, **kw: calls.append(s))
    cfg = tiny()
    seed_piece(5)
    build_model(cfg.model, settings(cfg), seed=100)
    assert calls == []  # CPU: the tracker has no state
    tracker = tensor_parallel.get_cuda_rng_tracker()
    monkeypatch.setitem(tracker.states_, "model-parallel-rng", torch.ByteTensor(16))  # what a GPU run leaves
    model = build_model(cfg.model, settings(cfg), seed=100)
    pieces = len(model._funcs)
    assert pieces == cfg.model.num_layers + 3 and calls == [100 + i for i in range(pieces)]
