"""Worker: model.recompute at TP = 2 (2 ranks, gloo): each mode and variant built from the same seed as without
recompute; rank r prints ``RESULT {json}``: per case, max |difference| of its loss and of every gradient (this rank's
shard) against no recompute, and the number of gradients compared."""

import json
import sys

import torch

from leviathan_pretrain.config import load_config
from leviathan_pretrain.config.parallel import ParallelConfig
from leviathan_pretrain.model.assembly import build_model
from leviathan_pretrain.model.settings import BuildSettings
from leviathan_pretrain.parallel.groups import destroy_distributed, init_distributed, seed_everything
from tests.small_model import small_model_overrides

B, S, V = 2, 32, 1000
MODES = [m.split("+") for m in sys.argv[1].split(",")]  # e.g. model.recompute=full+model.recompute_layers=1


def step(variant, extra, env, group):
    over = [*small_model_overrides(variant, V, S), "parallel.tensor_parallel=2", *extra]
    cfg = load_config(None, over)
    seed_everything(1234, env.device)
    model = build_model(cfg.model, BuildSettings.from_parallel(cfg.parallel, tp_group=group))
    model.train()
    ids = torch.randint(0, V, (B, S + 1), generator=torch.Generator().manual_seed(7))
    loss = model(ids[:, :-1], torch.arange(S)[None].expand(B, S), None, labels=ids[:, 1:]).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def main():
    env = init_distributed(ParallelConfig(tensor_parallel=2, device="cpu"))
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    out = {"rank": env.rank}
    for variant in ("lev", "tied"):
        loss0, grads0 = step(variant, [], env, group)
        for extra in MODES:
            loss, grads = step(variant, extra, env, group)
            assert grads.keys() == grads0.keys(), grads.keys() ^ grads0.keys()
            out[f"{variant} {' '.join(extra)}"] = {
                "loss": float((loss - loss0).abs()),
                "grad": max(float((grads[n] - grads0[n]).abs().max()) for n in grads),
                "n_grads": len(grads),
            }
    print("RESULT " + json.dumps(out), flush=True)
    destroy_distributed()


main()
