"""Worker: ``optim.lev_lr_mult`` through DeepSpeed's optimizers. For ZeRO 0 and 1, one AdamW step from fresh
weights: Adam's first update of an element is ``lr * g / (|g| + eps)``, so the median ``|delta| / lr`` is ~1 for
ordinary parameters and ~``lev_lr_mult`` for LEV's own. Prints ``RESULT {"zero", "lev", "other"}`` per stage."""

import json
import sys
import warnings

warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed.*")

import torch  # noqa: E402

from leviathan_pretrain.config import load_config  # noqa: E402
from leviathan_pretrain.model.lev import LEVInput  # noqa: E402
from leviathan_pretrain.parallel.groups import destroy_distributed, init_distributed  # noqa: E402
from leviathan_pretrain.trainer.engine import build_engine  # noqa: E402
from tests.workers.train_common import CONFIG, TINY  # noqa: E402

LR, MULT, V, S = 1e-3, 10.0, 512, 64


def main() -> None:
    for zero in (0, 1):
        over = [o for o in TINY if not o.startswith("optim.")] + [f"optim.lev_lr_mult={MULT}", "optim.warmup_steps=0"]
        cfg = load_config(CONFIG, [*over, f"parallel.zero_stage={zero}", "optim.weight_decay=0", "optim.clip_grad=0"])
        env = init_distributed(cfg.parallel)
        eng = build_engine(cfg, env.device)
        module = eng.ds.module
        lev = {id(p) for m in module.modules() if isinstance(m, LEVInput) for p in m.parameters()}
        before = {n: p.detach().clone() for n, p in module.named_parameters()}
        eng.set_lr(LR)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, V, (cfg.train.micro_batch_size, S + 1), generator=g)
        mb = {
            "tokens": ids[:, :-1],
            "labels": ids[:, 1:],
            "loss_mask": torch.ones(cfg.train.micro_batch_size, S),
            "position_ids": torch.arange(S)[None].expand(cfg.train.micro_batch_size, S),
        }
        eng.train_step([mb] * (cfg.train.global_batch_size // cfg.train.micro_batch_size))
        ratios = {"lev": [], "other": []}
        for n, p in module.named_parameters():
            d = (p.detach() - before[n]).abs().flatten()
            d = d[d > 0]
            if d.numel():
                ratios["lev" if id(p) in lev else "other"].append(float(d.median()) / LR)
        print("RESULT " + json.dumps({"zero": zero, **{k: sorted(v) for k, v in ratios.items()}}), flush=True)
        eng.ds.destroy()
    destroy_distributed()


if __name__ == "__main__":
    sys.exit(main())
