"""``model.compile`` against eager on one device, losses and every gradient: ``python benchmarks/check_compile.py``.

``model.compile`` stays off by default until this check passes on a GPU (benchmarks/gpu_check.sh runs
it). Two parts, one process, ``--config`` (default ``configs/400m-lev.yaml``) plus ``key=value`` overrides:

1. **Gradients.** The model (``build_model``, no DeepSpeed) built from one seed four times: eager and compiled in
   fp32 (TF32 off) and in bf16, the bf16 ones holding the fp32 model's weights rounded; one micro-batch of Zipf ids
   (``--micro``), the training mean loss, ``backward``. fp32: the compiled loss within ``--fp32-tol`` relative of
   eager's and every parameter's gradient within ``--fp32-tol`` of the largest element of eager's. bf16: both
   measured against the fp32 eager gradients, and the compiled model's error of every parameter may be at most
   ``--bf16-factor`` times eager's own bf16 error plus one bf16 ulp of the largest element (``2**-8``): compiled
   bf16 must be no worse than bf16 already is.
2. **Training.** ``--steps`` optimizer steps through the trainer's own engine (``build_engine`` + ``train_step``,
   the run's precision and ZeRO stage), eager and compiled from one seed on the same global batches at a constant
   LR: the logged losses within ``--loss-tol`` of each other at every step.

Prints one line per part (``compile check: gradients ... ok`` / ``FAILED``) and exits 1 when a part fails.
``--json PATH`` writes every figure. ``--dry``: the CPU, a tiny LEV model (fp32 and bf16 on the CPU; slow: the
CPU's inductor compiles C++), to check the script.

    python benchmarks/check_compile.py parallel.device=cuda parallel.precision=bf16 parallel.zero_stage=1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DRY = [
    "parallel.device=cpu",
    "parallel.backend=gloo",
    "model.vocab_size=512",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.num_layers=2",
    "model.seq_length=64",
    "model.lev.seed_dim=16",
    "model.lev.rank=8",
]


def _rel(a, b) -> float:
    """max |a - b| over max |b| (0 when both are zero)."""
    scale = float(b.float().abs().max())
    return float((a.float() - b.float()).abs().max()) / scale if scale else float((a.float() - b.float()).abs().max())


def _is_float(v) -> bool:
    import torch

    return isinstance(v, torch.Tensor) and v.is_floating_point()


def _batch(cfg, micro: int, device, seed: int = 0):
    import torch

    from benchmarks.bench_lev import zipf_ids

    s = cfg.model.seq_length
    ids = zipf_ids((micro, s + 1), cfg.model.vocab_size, seed)
    pos = torch.arange(s)[None].expand(micro, s)
    return [t.to(device) for t in (ids[:, :-1], pos, ids[:, 1:], torch.ones(micro, s))]


def gradients(cfg, args, device) -> dict:
    """Part 1: eager vs compiled, fp32 and bf16 (see the module doc)."""
    import torch
    from megatron.core import parallel_state as ps
    from torch._dynamo.utils import counters

    from leviathan_pretrain.config import load_config
    from leviathan_pretrain.model.assembly import build_model
    from leviathan_pretrain.model.settings import BuildSettings

    tokens, pos, labels, mask = _batch(cfg, args.micro, device)
    grads, losses, weights, graphs = {}, {}, None, {}
    for precision in ("fp32", "bf16"):
        for compiled in (False, True):
            flags = [f"parallel.precision={precision}", f"model.compile={'true' if compiled else 'false'}"]
            c = load_config(args.config, [*args.cfg_overrides, *flags])
            group = ps.get_tensor_model_parallel_group()
            build = BuildSettings.from_parallel(c.parallel, tp_group=group, device=device)
            model = build_model(c.model, build, seed=c.train.seed)
            model = model.to(device)
            state = model.state_dict()
            if weights is None:
                weights = {k: v.detach().float().clone() for k, v in state.items() if _is_float(v)}
            else:  # every model holds the first one's weights (rounded to its dtype)
                model.load_state_dict({k: v.to(state[k].dtype) for k, v in weights.items()}, strict=False)
            counters.clear()
            loss = model(tokens, pos, labels=labels, loss_mask=mask)
            loss.backward()
            key = f"{precision}-{'compiled' if compiled else 'eager'}"
            graphs[key] = int(counters["stats"]["unique_graphs"])
            losses[key] = float(loss)
            grads[key] = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
            del model, loss
            if device.type == "cuda":
                torch.cuda.empty_cache()
    ref = grads["fp32-eager"]
    out = {"losses": losses, "graphs": graphs, "fp32": {}, "bf16": {}}
    bad = [f"{k}: dynamo compiled nothing" for k, n in graphs.items() if "compiled" in k and n < 1]
    loss_rel = abs(losses["fp32-compiled"] - losses["fp32-eager"]) / abs(losses["fp32-eager"])
    if loss_rel > args.fp32_tol:
        bad.append(f"fp32 loss {loss_rel:.2e}")
    for name, g in ref.items():
        e32 = _rel(grads["fp32-compiled"][name], g)
        eager16, comp16 = _rel(grads["bf16-eager"][name], g), _rel(grads["bf16-compiled"][name], g)
        out["fp32"][name], out["bf16"][name] = e32, (eager16, comp16)
        if e32 > args.fp32_tol:
            bad.append(f"fp32 {name} {e32:.2e}")
        if comp16 > args.bf16_factor * eager16 + 2**-8:
            bad.append(f"bf16 {name} compiled {comp16:.2e} vs eager {eager16:.2e}")
    missing = set(ref) ^ set(grads["fp32-compiled"])
    if missing:
        bad.append(f"gradients only one model has: {sorted(missing)[:5]}")
    out["worst_fp32"] = max(out["fp32"].items(), key=lambda kv: kv[1])
    out["worst_bf16"] = max(out["bf16"].items(), key=lambda kv: kv[1][1] - kv[1][0])
    out["fp32_loss_rel"], out["failures"] = loss_rel, bad
    return out


def training(cfg, args, device) -> dict:
    """Part 2: ``--steps`` steps of the trainer's engine, eager and compiled, on the same batches."""
    from benchmarks.bench_step import Ours, zipf_batches
    from leviathan_pretrain.config import load_config

    batches = zipf_batches(cfg, args.steps, seed=1)
    losses = {}
    for compiled in (False, True):
        c = load_config(args.config, [*args.cfg_overrides, f"model.compile={'true' if compiled else 'false'}"])
        ours = Ours(c, device, name="compiled" if compiled else "eager")
        losses[ours.name] = [ours.step(mbs) for mbs in ours.prepare(batches)]
        ours.close()
    diff = max(abs(a - b) for a, b in zip(losses["eager"], losses["compiled"]))
    return {"losses": losses, "max_loss_diff": diff, "failures": [] if diff <= args.loss_tol else [f"{diff:.2e}"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python benchmarks/check_compile.py",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--config", default="configs/400m-lev.yaml", help="model config (default 400M LEV)")
    ap.add_argument("--micro", type=int, default=4, help="sequences in the gradient check's micro-batch (default 4)")
    ap.add_argument("--steps", type=int, default=5, help="trainer steps of part 2 (default 5)")
    ap.add_argument("--fp32-tol", type=float, default=1e-4, help="fp32: loss and gradients (default 1e-4)")
    ap.add_argument("--bf16-factor", type=float, default=2.0, help="bf16: compiled error <= factor x eager's + ulp")
    ap.add_argument("--loss-tol", type=float, default=2e-3, help="part 2: |loss difference| per step (default 2e-3)")
    ap.add_argument("--parts", nargs="+", choices=("gradients", "training"), default=["gradients", "training"])
    ap.add_argument("--dry", action="store_true", help="CPU, tiny shapes: check the script")
    ap.add_argument("--json", metavar="PATH", help="write every figure as JSON")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    args = ap.parse_args(argv)
    if args.dry:
        args.overrides = [*DRY, *args.overrides]
        args.micro = min(args.micro, 2)
    import warnings

    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed.*")
    from leviathan_pretrain.config import load_config
    from leviathan_pretrain.model.settings import resolve_device

    args.cfg_overrides = [*args.overrides, "train.micro_batch_size=2" if args.dry else "train.steps=100"]
    if args.dry:
        args.cfg_overrides += ["train.global_batch_size=4", "train.steps=100"]
    cfg = load_config(args.config, args.cfg_overrides)
    if cfg.parallel.tensor_parallel * cfg.parallel.pipeline_parallel != 1:
        sys.exit("error: check_compile.py runs one process: parallel.tensor_parallel=1 parallel.pipeline_parallel=1")
    accel = "cpu" if resolve_device(cfg.parallel.device).type == "cpu" else "cuda"
    os.environ.setdefault("DS_ACCELERATOR", accel)
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)
    import torch

    from leviathan_pretrain.parallel.groups import destroy_distributed, init_distributed

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 in part 1
    torch.backends.cudnn.allow_tf32 = False
    denv = init_distributed(cfg.parallel)
    parts = {"gradients": gradients, "training": training}
    out, failed = {}, False
    try:
        for name in args.parts:
            try:
                out[name] = res = parts[name](cfg, args, denv.device)
            except Exception as e:  # noqa: BLE001 -- reported; the other part still runs
                import traceback

                traceback.print_exc()
                out[name] = res = {"failures": [f"{type(e).__name__}: {e}"], "error": True}
            state = "ok" if not res["failures"] else "FAILED: " + "; ".join(res["failures"][:6])
            failed |= bool(res["failures"])
            if name == "gradients" and "worst_fp32" in res:
                (n32, e32), (n16, (e_eager, e_comp)) = res["worst_fp32"], res["worst_bf16"]
                detail = (
                    f"graphs {res['graphs']}, fp32 loss rel {res['fp32_loss_rel']:.1e}, worst fp32 gradient "
                    f"{e32:.1e} ({n32}); bf16 worst compiled {e_comp:.1e} vs eager {e_eager:.1e} ({n16})"
                )
            elif name == "training" and "max_loss_diff" in res:
                detail = f"{args.steps} steps, max |loss difference| {res['max_loss_diff']:.2e} (tol {args.loss_tol})"
            else:
                detail = "did not run to the end"
            print(f"compile check: {name}: {detail}: {state}", flush=True)
    finally:
        destroy_distributed()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
