"""The DeepSpeed engine for either path, behind one small interface (:class:`TrainEngine`).

Both build the model from its one assembly (``leviathan_pretrain.model.model_pieces``), with
:func:`build_settings` (TP size and megatron-core's TP group, precision, device) and every piece seeded from
``train.seed + index``, so both paths start from the same weights:

- PP = 1: the pieces run in order (``leviathan_pretrain.model.build_model``) under
  ``deepspeed.initialize(mpu=DeepSpeedMPU())``, ZeRO stage 0-3; gradient accumulation is DeepSpeed's (the
  loop calls ``backward``/``step`` once per micro-batch, DeepSpeed updates at the boundary). Micro-batches
  reach the device through data/transfer.py (one packed copy, unique ids made on the host):
  :meth:`ModelEngine.prepare` is what the data loader calls ahead; plain dicts are prepared on the fly.
- PP > 1 (or ``parallel.pipeline_engine``): the same pieces as a DeepSpeed ``PipelineModule``
  (:mod:`.pipeline_parallel`) and its ``PipelineEngine`` (``train_batch`` runs the whole 1F1B schedule for one
  global batch), ZeRO <= 1.

Both report the global-batch loss (mean over micro-batches and data-parallel ranks, equal on every rank),
the global gradient norm, and whether the update was applied (False = skipped as non-finite).
"""

from __future__ import annotations

import deepspeed
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from leviathan_pretrain.config import Config, ConfigError
from leviathan_pretrain.config.parallel import accumulation_steps
from leviathan_pretrain.data.transfer import MicroBatch, Transfer
from leviathan_pretrain.model.assembly import build_model
from leviathan_pretrain.model.settings import BuildSettings, ModelConfigError
from leviathan_pretrain.parallel.groups import DeepSpeedMPU
from leviathan_pretrain.trainer.checkpoint.safe_io import install_safe_engine
from leviathan_pretrain.trainer.faults import AdamWSkipNonFinite
from leviathan_pretrain.trainer.pipeline_parallel import build_pipeline
from leviathan_pretrain.trainer.schedule import lr_at, param_groups


def zero_config(cfg: Config, cuda: bool) -> dict:
    """DeepSpeed's ``zero_optimization`` section: the stage, explicit bucket sizes (``parallel.*_bucket_elements``,
    DeepSpeed's 5e8 defaults unless set) and, for ZeRO 1/2, ``overlap_comm`` (``parallel.overlap_comm``; null:
    on CUDA only) with contiguous gradients. ZeRO 3 keeps DeepSpeed's own ``overlap_comm`` default unless set."""
    p = cfg.parallel
    zero = {
        "stage": p.zero_stage,
        "reduce_bucket_size": p.reduce_bucket_elements,
        "allgather_bucket_size": p.allgather_bucket_elements,
    }
    if p.zero_stage in (1, 2):
        zero.update(overlap_comm=p.resolved_overlap_comm(cuda), contiguous_gradients=True)
    elif p.zero_stage == 3 and p.overlap_comm is not None:
        zero["overlap_comm"] = p.overlap_comm
    return zero


def deepspeed_config(cfg: Config, dp: int, own_clipping: bool, cuda: bool = False) -> dict:
    """The DeepSpeed config of this run; ``cuda``: whether it runs on GPUs (``overlap_comm``'s default)."""
    t, o, p = cfg.train, cfg.optim, cfg.parallel
    gas = accumulation_steps(t.global_batch_size, t.micro_batch_size, dp)
    ds = {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0 if own_clipping else o.clip_grad,
        "zero_optimization": zero_config(cfg, cuda),
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
        # immediate_grad_update: BF16_Optimizer adds each bf16 gradient into the fp32 accumulator in a hook, then
        # frees it (parallel.immediate_grad_update; the same sums as DeepSpeed's after-backward pass, one pass less)
        "bf16": {"enabled": p.precision == "bf16", "immediate_grad_update": p.resolved_immediate_grad_update},
        "fp16": {
            "enabled": p.precision == "fp16",
            "loss_scale": o.loss_scale,
            "initial_scale_power": o.initial_loss_scale_power,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1,
        },
        "checkpoint": {"tag_validation": "FAIL"},
    }
    if p.precision == "bf16":  # fp32: BF16_Optimizer at ZeRO 1 (never the pipeline engine), fp32 partitions at 2/3
        ds["data_types"] = {"grad_accum_dtype": p.resolved_grad_accum_dtype}
    if p.sequence_parallel:
        # With TP > 1 the pipeline engine by default sends 1 / tp of each stage's output per TP rank and all-gathers
        # it on the next stage: right only when every TP rank holds the same tensor. Under SP each holds its own
        # slice of the sequence (the same bytes per rank): partitioning would mix the ranks' slices, silently.
        ds["pipeline"] = {"pipe_partitioned": False, "grad_partitioned": False}
    return ds


def adamw_kernel(cfg: Config, cuda: bool) -> dict:
    """torch AdamW's implementation flags: ``optim.fused`` (null: fused on CUDA, where it is one kernel per
    group instead of a dozen per tensor; single-tensor on CPU). DeepSpeed's ZeRO and BF16 wrappers step it on
    their flat fp32 partitions either way."""
    fused = cuda if cfg.optim.fused is None else cfg.optim.fused
    return {"fused": fused, "foreach": False}


def build_optimizer(module: torch.nn.Module, cfg: Config, own_clipping: bool, cuda: bool = False):
    o = cfg.optim
    kw = dict(lr=lr_at(0, o, cfg.train.steps), betas=(o.beta1, o.beta2), eps=o.eps, **adamw_kernel(cfg, cuda))
    groups = param_groups(module, cfg)
    for g in groups:
        if "lr_mult" in g:
            g["lr"] = kw["lr"] * g["lr_mult"]
    if own_clipping:
        return AdamWSkipNonFinite(groups, clip_grad=o.clip_grad, **kw)
    return torch.optim.AdamW(groups, **kw)


class TrainEngine:
    """Common part: DeepSpeed engine ``ds``, LR setting, skipped-step detection."""

    def __init__(self, ds, cfg: Config, dp_group):
        self.ds, self.cfg, self.dp_group = ds, cfg, dp_group
        self.kernel = adamw_kernel(cfg, ds.device.type == "cuda")

    def set_lr(self, lr: float) -> None:
        for g in self.ds.optimizer.param_groups:
            g["lr"] = lr * g.get("lr_mult", 1.0)  # optim.lev_lr_mult on LEV's own parameters
            g.update(self.kernel)  # loading a checkpoint restores its groups' own fused/foreach flags

    def grad_norm(self) -> float | None:
        n = self.ds.get_global_grad_norm()
        return None if n is None else float(n)

    def loss_scale(self) -> float:
        s = getattr(self.ds.optimizer, "loss_scale", None)
        if s is None:
            s = getattr(self.ds.optimizer, "cur_scale", 1.0)
        return float(s)

    def module(self) -> torch.nn.Module:
        return self.ds.module


class ModelEngine(TrainEngine):
    """PP = 1: the model (``leviathan_pretrain.model.GPT``) under ``deepspeed.initialize``. Its micro-batches are
    plain dicts of host tensors or micro-batches prepared ahead (:meth:`prepare`, data/transfer.py's ``MicroBatch``)."""

    needs_data = True

    def __init__(self, ds, cfg: Config, dp_group):
        super().__init__(ds, cfg, dp_group)
        self.transfer = Transfer.for_run(cfg, ds.device)

    def prepare(self, mb: dict) -> MicroBatch:
        """A micro-batch as this run sends it (data/transfer.py: packed, pinned on CUDA, the unique ids made on
        the host per ``data.*``); the data loader calls it ahead, a benchmark may too; a prepared one as it is."""
        return self.transfer.prepare(mb)

    def _loss(self, mb: dict) -> torch.Tensor:
        b = self.prepare(mb).to_device(self.ds.device)
        kw = {} if b.unique is None else {"unique": b.unique}
        # the mean over the mask
        return self.ds(b.tokens, b.position_ids, attention_mask=None, labels=b.labels, loss_mask=b.loss_mask, **kw)

    def _mean_over_dp(self, total: torch.Tensor, n: int) -> float:
        total = total.detach().float() / n
        if dist.get_world_size(self.dp_group) > 1:
            dist.all_reduce(total, group=self.dp_group)
            total /= dist.get_world_size(self.dp_group)
        return float(total.item())

    def train_step(self, micro_batches: list[dict]) -> tuple[float, bool]:
        skipped_before = self.ds.skipped_steps
        total = torch.zeros((), device=self.ds.device)
        for mb in micro_batches:
            loss = self._loss(mb)
            self.ds.backward(loss)
            self.ds.step()
            total += loss.detach().float()
        loss = self._mean_over_dp(total, len(micro_batches))
        return loss, self.ds.skipped_steps == skipped_before

    @torch.no_grad()
    def eval_loss(self, batches: list[list[dict]], n_batches: int) -> float:
        self.ds.eval()
        total = torch.zeros((), device=self.ds.device)
        n = 0
        for mbs in batches:
            for mb in mbs:
                total += self._loss(mb).float()
                n += 1
        self.ds.train()
        return self._mean_over_dp(total, n)


class PipeEngine(TrainEngine):
    """PP > 1: DeepSpeed's ``PipelineEngine`` over :func:`.pipeline_parallel.build_pipeline`."""

    def __init__(self, ds, cfg, dp_group, loss_fn):
        super().__init__(ds, cfg, dp_group)
        self.loss_fn = loss_fn
        self.needs_data = ds.is_first_stage() or ds.is_last_stage()

    @staticmethod
    def _pipe_batches(micro_batches):
        return iter(
            [((mb["tokens"], mb["position_ids"]), (mb["labels"], mb["loss_mask"])) for mb in micro_batches or []]
        )

    def train_step(self, micro_batches: list[dict] | None) -> tuple[float, bool]:
        skipped_before = self.ds.skipped_steps
        loss = self.ds.train_batch(self._pipe_batches(micro_batches))
        return float(loss.item()), self.ds.skipped_steps == skipped_before

    def eval_loss(self, batches: list[list[dict]] | None, n_batches: int) -> float:
        total = 0.0
        for i in range(n_batches):
            mbs = batches[i] if batches else None
            loss = self.ds.eval_batch(self._pipe_batches(mbs), num_micro_batches=self.ds.micro_batches)
            total += float(loss.item())
        return total / n_batches


def build_settings(cfg: Config, device: torch.device) -> BuildSettings:
    """What the model builders need of this run: ``cfg.parallel`` with this rank's device and megatron-core's
    tensor-parallel group (the one place the trainer hands process groups to the model)."""
    return BuildSettings.from_parallel(cfg.parallel, tp_group=ps.get_tensor_model_parallel_group(), device=device)


def build_module(cfg: Config, device: torch.device, data_parallel: int):
    """The PP = 1 model, or the ``(PipelineModule, PipeLoss)`` pair; a model that cannot be built as configured
    is a config error (exit code 2, like the checks at config load)."""
    try:
        build = build_settings(cfg, device)
        if cfg.parallel.uses_pipeline_engine:
            return build_pipeline(
                cfg.model,
                build,
                stages=cfg.parallel.pipeline_parallel,
                data_parallel=data_parallel,
                seed=cfg.train.seed,
            )
        return build_model(cfg.model, build, seed=cfg.train.seed)
    except ModelConfigError as e:
        raise ConfigError(str(e)) from e


def build_engine(cfg: Config, device: torch.device) -> TrainEngine:
    """Build the model (or pipeline), its AdamW and the DeepSpeed engine; collective."""
    dp = ps.get_data_parallel_world_size()
    own_clipping = cfg.parallel.zero_stage == 0 and cfg.parallel.precision == "fp32"
    cuda = device.type == "cuda"
    ds_config = deepspeed_config(cfg, dp, own_clipping, cuda)
    deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False)
    if cfg.parallel.uses_pipeline_engine:
        module, loss_fn = build_module(cfg, device, dp)
        opt = build_optimizer(module, cfg, own_clipping, cuda)
        ds, *_ = deepspeed.initialize(model=module, optimizer=opt, config=ds_config, dist_init_required=False)
        eng = PipeEngine(ds, cfg, ps.get_data_parallel_group(), loss_fn)
    else:
        module = build_module(cfg, device, dp)
        opt = build_optimizer(module, cfg, own_clipping, cuda)
        ds, *_ = deepspeed.initialize(
            model=module, optimizer=opt, config=ds_config, mpu=DeepSpeedMPU(), dist_init_required=False
        )
        eng = ModelEngine(ds, cfg, ps.get_data_parallel_group())
    install_safe_engine(ds)
    return eng
