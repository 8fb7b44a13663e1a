"""Worker: every variant at TP = 1 and TP = 2 in one 2-rank launch; rank 0 prints the max differences.

Phase 1: world of 2 as TP = 1 (DP = 2): each rank builds every variant from the same seed and records
logits, per-token loss and every parameter's gradient. Phase 2: the same process group re-split as
TP = 2: same seed, same batch; logits are gathered over the vocab shards and sharded gradients over
their partition dim (respecting megatron's partition stride, e.g. SwiGLU's fc1). Output: one line
``RESULT {json}`` per rank with, per variant, max |TP2 - TP1| of logits / loss / gradients, and the TP
attribute checks of the layers' own parameters.
"""

import json
import sys

import torch
import torch.distributed as dist

from leviathan_pretrain.config import load_config
from leviathan_pretrain.config.parallel import ParallelConfig
from leviathan_pretrain.model.assembly import build_model
from leviathan_pretrain.model.settings import BuildSettings
from leviathan_pretrain.parallel.groups import destroy_distributed, init_distributed, seed_everything
from tests.small_model import small_model_overrides

VARIANTS = sys.argv[1].split(",")
B, S, V = 2, 32, 1000  # V pads to 1024 at TP = 1 and TP = 2: identical master weights
# option sets of a variant, run like one (name -> (variant, overrides))
OPTIONS = {
    "lev_center_match": ("lev", ["model.lev.center=true", "model.lev.out_init_std=match"]),
    "lev_triton": ("lev", ["model.lev.kernel=triton"]),  # the Triton kernels (Triton's interpreter on the CPU)
}


def small_cfg(variant, tp):
    variant, extra = OPTIONS.get(variant, (variant, []))
    over = [*small_model_overrides(variant, V, S), "model.lev.token_chunk=7", f"parallel.tensor_parallel={tp}"]
    return load_config(None, over + extra)


def gather_full(t, p, group, tp):
    """Full tensor from this rank's shard ``t`` of parameter ``p`` (megatron's partition dim and stride)."""
    if tp == 1 or not getattr(p, "tensor_model_parallel", False):
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    dim, stride = p.partition_dim, getattr(p, "partition_stride", 1)
    pieces = [q.chunk(stride, dim=dim) for q in parts]
    return torch.cat([pieces[r][j] for j in range(stride) for r in range(tp)], dim=dim)


def run(variant, tp, env, group):
    cfg = small_cfg(variant, tp)
    seed_everything(1234, env.device)
    model = build_model(cfg.model, BuildSettings.from_parallel(cfg.parallel, tp_group=group))
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, V, (B, S + 1), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]
    pos = torch.arange(S)[None].expand(B, S)
    loss = model(x, pos, None, labels=y)
    loss.mean().backward()
    with torch.no_grad():
        logits = model(x, pos, None)
    if tp > 1:
        parts = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(parts, logits.contiguous(), group=group)
        logits = torch.cat(parts, dim=-1)
    grads = {n: gather_full(p.grad, p, group, tp) for n, p in model.named_parameters()}
    attrs = {n: bool(getattr(p, "tensor_model_parallel", False)) for n, p in model.input_layer.named_parameters()}
    full = model.input_layer.full_parameters() if cfg.model.variant == "lev" else {}
    return {"logits": logits, "loss": loss.detach(), "grads": grads, "attrs": attrs, "full": full}


def main():
    results = {}
    for tp in (1, 2):
        env = init_distributed(ParallelConfig(tensor_parallel=tp, device="cpu"))
        from megatron.core import parallel_state as ps

        group = ps.get_tensor_model_parallel_group()
        for v in VARIANTS:
            results[(tp, v)] = run(v, tp, env, group)
        ps.destroy_model_parallel()
    out = {"rank": env.rank}
    for v in VARIANTS:
        a, b = results[(1, v)], results[(2, v)]
        assert a["grads"].keys() == b["grads"].keys(), (v, a["grads"].keys() ^ b["grads"].keys())
        gdiff = {n: float((a["grads"][n] - b["grads"][n]).abs().max()) for n in a["grads"]}
        worst = max(gdiff, key=gdiff.get)
        out[v] = {
            "logits": float((a["logits"] - b["logits"]).abs().max()),
            "loss": float((a["loss"] - b["loss"]).abs().max()),
            "grad": gdiff[worst],
            "grad_worst": worst,
            "n_params": len(gdiff),
            "grad_scale": max(float(t.abs().max()) for t in a["grads"].values()),
            "tp_attrs": b["attrs"],
            "full_params": max((float((a["full"][n] - b["full"][n]).abs().max()) for n in a["full"]), default=-1.0),
        }
    print("RESULT " + json.dumps(out), flush=True)
    destroy_distributed()


main()
