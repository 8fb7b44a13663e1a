"""Worker: the accumulated gradient of one global batch of 32 sequences through the real ``build_engine``, taken
as one micro-batch or as 32 accumulated ones, in fp32 and in bf16 with either ``parallel.grad_accum_dtype``.

``python tests/workers/grad_accum.py CASES.json OUT_DIR``. The batch makes the micro-batch gradients cancel,
as gradient noise does late in training: every sequence has the same tokens, sequences 0-15 predict token A
everywhere and 16-31 token B. First an fp32 model is trained on that batch (``TRAIN_STEPS`` AdamW steps) towards
its optimum p(A) = p(B) = 1/2, where the two halves' gradients are opposite and their sum is small; every case
then starts from those weights. Accumulated in micro-batch order (16 x A, then 16 x B), the running sum
peaks at half of one micro-batch's gradient before it cancels, so bf16 rounding of the running sum is large
against the small result. Writes ``OUT_DIR/NAME.pt`` (the gradient before the step, all parameters
flattened, fp32) and prints ``RESULT {"name", "norm", "wrapper"}`` (DeepSpeed's global gradient norm).
"""

import json
import sys
import warnings

warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed.*")

import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed.utils import safe_get_full_grad  # noqa: E402

from leviathan_pretrain.config import load_config  # noqa: E402
from leviathan_pretrain.parallel.groups import destroy_distributed, init_distributed  # noqa: E402
from leviathan_pretrain.trainer.engine import build_engine  # noqa: E402
from tests.workers.train_common import CONFIG, TINY  # noqa: E402

N, TRAIN_STEPS, LR, A, B = 32, 150, 3e-3, 7, 300


def batch(n: int, seq: int, vocab: int) -> dict:
    tokens = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(0)).expand(n, seq)
    labels = torch.full((n, seq), A)
    labels[n // 2 :] = B
    pos = torch.arange(seq)[None].expand(n, seq)
    return {"tokens": tokens, "labels": labels, "loss_mask": torch.ones(n, seq), "position_ids": pos}


def engine(over: list[str]):
    fixed = ["optim.clip_grad=0", "optim.weight_decay=0", f"train.global_batch_size={N}"]
    cfg = load_config(CONFIG, [*TINY, *fixed, *over])
    env = init_distributed(cfg.parallel)
    return cfg, build_engine(cfg, env.device)


def train(path: str) -> None:
    cfg, eng = engine(["parallel.precision=fp32", "parallel.zero_stage=1", f"train.micro_batch_size={N}"])
    full = batch(N, cfg.model.seq_length, cfg.model.vocab_size)
    for _ in range(TRAIN_STEPS):
        eng.set_lr(LR)
        eng.train_step([full])
    torch.save({n: p.detach().float().clone() for n, p in eng.ds.module.named_parameters()}, path)
    eng.ds.destroy()


def case(name: str, over: list[str], weights: dict, out_dir: str) -> dict:
    cfg, eng = engine(over)
    mod = eng.ds.module
    with torch.no_grad(), deepspeed.zero.GatheredParameters(list(mod.parameters()), modifier_rank=0):
        for n, p in mod.named_parameters():  # ZeRO 3: gathered, then partitioned again
            p.copy_(weights[n])
    full, mb = batch(N, cfg.model.seq_length, cfg.model.vocab_size), cfg.train.micro_batch_size
    mbs = [{k: v[i : i + mb] for k, v in full.items()} for i in range(0, N, mb)]
    if cfg.parallel.uses_pipeline_engine:  # one train_batch: only the norm
        eng.train_step(mbs)
    else:
        for i, x in enumerate(mbs):  # ModelEngine.train_step, reading the accumulated gradient before the step
            eng.ds.backward(eng._loss(x))
            if i == len(mbs) - 1:
                grad = torch.cat([safe_get_full_grad(p).float().flatten() for p in mod.parameters()])
            eng.ds.step()
        torch.save(grad, f"{out_dir}/{name}.pt")
    out = {"name": name, "norm": eng.grad_norm(), "wrapper": type(eng.ds.optimizer).__name__}
    eng.ds.destroy()
    return out


def main(cases: str, out_dir: str) -> None:
    train(f"{out_dir}/trained.pt")
    weights = torch.load(f"{out_dir}/trained.pt")
    for name, over in json.loads(open(cases).read()):
        print("RESULT " + json.dumps(case(name, over, weights, out_dir)), flush=True)
    destroy_distributed()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
