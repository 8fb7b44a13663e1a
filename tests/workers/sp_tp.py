"""Worker: sequence parallelism at TP = 2 (2 ranks, gloo) against SP off, the same weights (same seed).

Rank r prints ``RESULT {json}``: per case (variant, loss implementation, extra overrides), the largest relative
difference of the mean loss, the per-token losses, the logits, the head's hidden states and of every gradient
(this rank's shard; the relative difference is max |a - b| / max(max |b|, 1e-30)), the number of gradients
compared, and whether the state dict has the same keys and shapes (a checkpoint is the same), and what SP
changed on this rank: the hidden states' length between the pieces (s / tp) and whether
every norm's weight was summed over TP (SPRMSNorm).
"""

import json
import sys

import torch

from leviathan_pretrain.config import load_config
from leviathan_pretrain.config.parallel import ParallelConfig
from leviathan_pretrain.model.assembly import build_model
from leviathan_pretrain.model.settings import BuildSettings
from leviathan_pretrain.model.sp import SPRMSNorm, gather_seq, reduce_scatter_seq, split_seq
from leviathan_pretrain.parallel.groups import destroy_distributed, init_distributed, seed_everything
from tests.small_model import small_model_overrides

B, S, V = 2, 32, 1000
CASES = [c.split("+") for c in sys.argv[1].split(";")]  # variant+loss_impl[+override...];...


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / max(float(b.double().abs().max()), 1e-30))


def run(variant, loss_impl, extra, sp, env, group):
    over = [*small_model_overrides(variant, V, S), "parallel.tensor_parallel=2", f"model.loss_impl={loss_impl}"]
    over += [*extra, f"parallel.sequence_parallel={str(sp).lower()}"]
    cfg = load_config(None, over)
    seed_everything(1234, env.device)
    model = build_model(cfg.model, BuildSettings.from_parallel(cfg.parallel, tp_group=group))
    model.train()
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, V, (B, S + 1), generator=gen)
    mask = (torch.rand(B, S, generator=gen) > 0.2).float()
    pos = torch.arange(S)[None].expand(B, S)
    shapes = []
    hook = model._funcs[1].register_forward_pre_hook(lambda m, a: shapes.append(tuple(a[0].shape)))
    loss = model(ids[:, :-1], pos, None, labels=ids[:, 1:], loss_mask=mask)
    hook.remove()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad():
        per_token = model(ids[:, :-1], pos, None, labels=ids[:, 1:])
        logits = model(ids[:, :-1], pos)
        hidden = model.head_input(ids[:, :-1], pos).hidden
    norms = [m for m in model.modules() if isinstance(m, SPRMSNorm)]
    layout = [(k, tuple(v.shape) if torch.is_tensor(v) else v) for k, v in model.state_dict().items()]  # checkpoints
    out = dict(loss=loss.detach(), per_token=per_token, logits=logits, hidden=hidden, grads=grads, layout=layout)
    return out, shapes, norms


def collectives(rank: int, group) -> dict:
    """model/sp.py's three collectives and their backwards against the dense computation: each rank holds
    ``full[rank]`` (its slice) of a [8, 3] tensor, or rank-specific partial sums."""
    gen = torch.Generator().manual_seed(3)
    full, parts, grads = (
        torch.randn(8, 3, generator=gen),
        torch.randn(2, 8, 3, generator=gen),
        torch.randn(2, 8, 3, generator=gen),
    )
    mine = slice(4 * rank, 4 * rank + 4)
    own_slices = torch.cat([grads[r][4 * r : 4 * r + 4] for r in (0, 1)])  # each rank's gradient of its slice
    out = {}
    x = full[mine].clone().requires_grad_(True)
    y = gather_seq(x, group)
    y.backward(grads[rank])
    out["gather"] = [rel(y, full), rel(x.grad, grads.sum(0)[mine])]
    x = parts[rank].clone().requires_grad_(True)
    y = reduce_scatter_seq(x, group)
    y.backward(grads[rank][mine])
    out["reduce_scatter"] = [rel(y, parts.sum(0)[mine]), rel(x.grad, own_slices)]
    x = full.clone().requires_grad_(True)
    y = split_seq(x, group)
    y.backward(grads[rank][mine])
    out["split"] = [rel(y, full[mine]), rel(x.grad, own_slices)]
    return out


def main():
    env = init_distributed(ParallelConfig(tensor_parallel=2, device="cpu"))
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    out = {"rank": env.rank, "collectives": collectives(env.rank, group)}
    for variant, loss_impl, *extra in CASES:
        ref, ref_shapes, ref_norms = run(variant, loss_impl, extra, False, env, group)
        got, shapes, norms = run(variant, loss_impl, extra, True, env, group)
        assert got["grads"].keys() == ref["grads"].keys(), got["grads"].keys() ^ ref["grads"].keys()
        out[" ".join([variant, loss_impl, *extra])] = {
            **{k: rel(got[k], ref[k]) for k in ("loss", "per_token", "logits", "hidden")},
            "grad": max(rel(got["grads"][n], ref["grads"][n]) for n in ref["grads"]),
            "worst_grad": max(ref["grads"], key=lambda n: rel(got["grads"][n], ref["grads"][n])),
            "n_grads": len(ref["grads"]),
            "seq_in_layer": [shapes[0][0], ref_shapes[0][0]],
            "sp_norms": [len(norms), len(ref_norms)],
            "same_state_dict": got["layout"] == ref["layout"],
        }
    print("RESULT " + json.dumps(out), flush=True)
    destroy_distributed()


main()
