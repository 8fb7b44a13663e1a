"""Worker: the fused loss (model.loss_impl=fused) against megatron-core's unfused path, at TP = 1 and TP = 2; and
the fused SwiGLU (model.activation_fusion=true, the CUDA default) against the unfused one, the same way.

For each TP size (the 2-rank gloo world as TP = 1 x DP = 2, then as TP = 2), each head (``lev``: the untied
``OutputPiece``; ``tied``: the input table as head) and each precision in argv[1] (``fp32``, ``bf16``), two
models are built from one seed, one per ``loss_impl``, and given the same batch twice:

- ``mean``: the training loss, ``model(x, pos, labels=y, loss_mask=mask)`` (fused: gradients formed in forward);
- ``token``: per-token losses ``model(x, pos, labels=y)`` summed with random weights (fused: recompute backward).

The SwiGLU pair (``swiglu-tp{1,2}-lev-fp32-mean``): both models with the fused loss, one with megatron-core's
fused ``SwiGLUFunction``, one without. Chunks of 7 tokens (64 tokens a batch: 10 chunks, the last short).
Recorded per case: the loss difference and,
for every parameter and the final hidden states (the final norm's output), max |fused - megatron| / max
|megatron| of the gradient. Output: ``RESULT {json}`` per rank.
"""

import json
import sys

import torch

from leviathan_pretrain.config import load_config
from leviathan_pretrain.config.parallel import ParallelConfig
from leviathan_pretrain.model.assembly import build_model
from leviathan_pretrain.model.gpt import FinalNorm
from leviathan_pretrain.model.settings import BuildSettings
from leviathan_pretrain.parallel.groups import destroy_distributed, init_distributed
from tests.small_model import small_model_overrides

PRECISIONS = sys.argv[1].split(",")
B, S, V = 2, 32, 1000


# the two sides of each comparison: (the previous path, the new one)
PAIRS = {
    "loss": (["model.loss_impl=megatron"], ["model.loss_impl=fused"]),
    "swiglu": (["model.activation_fusion=false"], ["model.activation_fusion=true"]),
}


def build(variant, tp, extra, precision, group):
    over = [*small_model_overrides(variant, V, S), f"parallel.tensor_parallel={tp}", f"parallel.precision={precision}"]
    cfg = load_config(None, [*over, "model.loss_chunk_tokens=7", *extra])
    model = build_model(cfg.model, BuildSettings.from_parallel(cfg.parallel, tp_group=group), seed=1234)
    norm = next(m for m in model.modules() if isinstance(m, FinalNorm))
    seen = {}

    def keep(_m, _inp, out):
        out.retain_grad()
        seen["hidden"] = out

    norm.register_forward_hook(keep)
    return model, seen


def case(variant, tp, precision, mode, group, pair="loss"):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, V, (B, S + 1), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]
    pos = torch.arange(S)[None].expand(B, S)
    mask = (torch.rand(B, S, generator=g) > 0.25).float()
    weights = torch.rand(B, S, generator=g)
    out = {}
    for impl, extra in zip(("megatron", "fused"), PAIRS[pair]):  # the previous path, the new one
        model, seen = build(variant, tp, extra, precision, group)
        if mode == "mean":
            loss = model(x, pos, None, labels=y, loss_mask=mask)
        else:
            per_token = model(x, pos, None, labels=y)
            assert per_token.shape == (B, S), per_token.shape
            loss = (per_token * weights).sum()
        loss.backward()
        grads = {n: p.grad.float() for n, p in model.named_parameters()}
        grads["<final hidden>"] = seen["hidden"].grad.float()
        out[impl] = (float(loss), grads)
    (lm, gm), (lf, gf) = out["megatron"], out["fused"]
    rel = {n: float((gf[n] - gm[n]).abs().max() / gm[n].abs().max().clamp(min=1e-30)) for n in gm}
    worst = max(rel, key=rel.get)
    head = "tied_modules.embed.embedding.word_embeddings.weight" if variant == "tied" else f"{4}.output_layer.weight"
    return {
        "loss_rel": abs(lf - lm) / abs(lm),
        "grad_rel": rel[worst],
        "grad_worst": worst,
        "head_rel": rel[head],
        "hidden_rel": rel["<final hidden>"],
        "n": len(rel),
        "scale": min(float(t.abs().max()) for t in gm.values()),
    }


def main():
    results = {}
    for tp in (1, 2):
        env = init_distributed(ParallelConfig(tensor_parallel=tp, device="cpu"))
        from megatron.core import parallel_state as ps

        group = ps.get_tensor_model_parallel_group()
        for variant in ("lev", "tied"):
            for precision in PRECISIONS:
                for mode in ("mean", "token"):
                    results[f"tp{tp}-{variant}-{precision}-{mode}"] = case(variant, tp, precision, mode, group)
        results[f"swiglu-tp{tp}-lev-fp32-mean"] = case("lev", tp, "fp32", "mean", group, pair="swiglu")
        ps.destroy_model_parallel()
    print("RESULT " + json.dumps({"rank": env.rank, **results}), flush=True)
    destroy_distributed()


main()
