"""A trained run's checkpoint as one model on one device: TP and PP shards merged, ZeRO-3 partitions gathered.

``load_trained(run_dir, step=None)`` finds ``RUN/checkpoints`` (or ``checkpoint.dir``), picks ``latest`` (or
``global_step<step>``), reads ``leviathan.json`` (the run's config, tokenizer checksum and parallel layout) and
returns a :class:`Trained` whose ``model`` is the PP = 1, TP = 1 :class:`~leviathan_pretrain.model.assembly.GPT`
of that config, in eval mode, fp32 unless asked otherwise. Call it inside :func:`eval_world` (megatron-core's
RoPE reads its global context-parallel group, so even one process needs megatron's groups).

Where the weights come from (every file read with weights-only ``torch.load``):

- PP = 1, ZeRO 0-2: ``mp_rank_<tp>_model_states.pt`` (``module``: the model's state dict on that TP rank);
- PP > 1: ``layer_<piece>-model_<tp>-model_states.pt`` (piece ``i``'s own keys; TIED's table in piece 0);
- ZeRO 3: DeepSpeed's ``zero_to_fp32`` over the ``zero_pp_rank_<dp>_mp_rank_<tp>_*`` files of each TP rank
  (the fp32 master weights; ZeRO 0-2 give the weights the model computed with, e.g. bf16).

Merging TP shards uses megatron-core's own parameter attributes on the TP = 1 model (``tensor_model_parallel``,
``partition_dim``): sharded parameters are concatenated along that dimension, replicated ones taken from TP rank
0. Two layouts need more than concatenation: SwiGLU's ``linear_fc1`` holds ``[gate; up]`` *per TP shard* (the
halves are regrouped), and the padded vocabulary depends on TP (``make_vocab_size_divisible_by x TP``), so the
TP = 1 model is built with ``make_vocab_size_divisible_by`` multiplied by the saved TP: its tables have exactly
the rows the shards have. QKV needs nothing: megatron-core interleaves it per query group and TP splits whole
groups. The padded rows are kept (the model is the trained one); evaluation scores the first
``model.vocab_size`` logits only (see :mod:`.scoring`).
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from leviathan_pretrain.config import Config, ConfigError
from leviathan_pretrain.config.loader import build, validate_tree
from leviathan_pretrain.rundir.layout import RunLayout, is_run_dir
from leviathan_pretrain.trainer.checkpoint.names import (
    META,
    TAG_PREFIX,
    CheckpointError,
    complete_tags,
    read_latest,
    tag_for,
)
from leviathan_pretrain.trainer.checkpoint.record import CheckpointRecord, ParallelLayout

if TYPE_CHECKING:
    from data_prep.tokenizer import Tokenizer


class EvalError(RuntimeError):
    """A run, checkpoint, tokenizer or evaluation input that cannot be used; the message names the file."""


@dataclass
class Trained:
    """A loaded checkpoint: ``cfg`` is the run's config as saved (its parallel layout included), ``model`` the
    merged TP = 1 model on ``device`` in eval mode, ``tokenizer`` the checked tokenizer (data_prep/tokenizer/'s
    interface, any kind), or None."""

    run_dir: Path
    ckpt_dir: Path
    tag: str
    step: int
    record: CheckpointRecord
    cfg: Config
    model: torch.nn.Module
    tokenizer: "Tokenizer | None"

    @property
    def variant(self) -> str:
        return self.cfg.model.variant

    @property
    def vocab_size(self) -> int:
        return self.cfg.model.vocab_size


# ---------------------------------------------------------------- where


def checkpoint_location(run_dir: str | os.PathLike, checkpoint_dir: str | os.PathLike | None = None) -> Path:
    """The checkpoint directory of a run: ``checkpoint_dir`` if given; else ``RUN/checkpoints``; else ``RUN`` itself
    when it holds ``latest`` or ``global_step*`` folders (a checkpoint directory passed as the run)."""
    if checkpoint_dir is not None:
        path = Path(checkpoint_dir)
    else:
        run = Path(run_dir)
        if not run.is_dir():
            raise EvalError(f"{run}: no such run directory")
        path = RunLayout(run).checkpoints
        if not path.is_dir() and ((run / "latest").is_file() or any(run.glob(f"{TAG_PREFIX}*"))):
            path = run
    if not path.is_dir():
        runs = [] if checkpoint_dir is not None else runs_below(Path(run_dir))
        raise EvalError(
            f"{path}: no checkpoint directory (give --checkpoint-dir if the run used checkpoint.dir)"
            + (f"; did you mean {' or '.join(f'--run {r}' for r in runs)}?" if runs else "")
        )
    return path


def runs_below(parent: Path, most: int = 3) -> list[Path]:
    """The run directories (``is_run_dir``) directly in ``parent``, when there are 1 to ``most`` of them."""
    try:
        found = sorted(e for e in parent.iterdir() if e.is_dir() and is_run_dir(e))
    except OSError:
        return []
    return found if len(found) <= most else []


def select_tag(ckpt_dir: Path, step: int | None = None) -> str:
    """``global_step<step>``, or the tag ``latest`` names; the checkpoint must be complete (``leviathan.json``)."""
    if step is not None:
        tag = tag_for(step)
        if not (ckpt_dir / tag / META).is_file():
            have = complete_tags(ckpt_dir)
            raise EvalError(
                f"{ckpt_dir / tag}: no complete checkpoint at step {step} (complete: {', '.join(have) or 'none'})"
            )
        return tag
    try:
        tag = read_latest(ckpt_dir)
    except CheckpointError as e:
        raise EvalError(str(e)) from None
    if tag is None:
        raise EvalError(f"{ckpt_dir}: no complete checkpoint ({ckpt_dir / 'latest'} is missing or empty)")
    return tag


def saved_config(record: CheckpointRecord, where: Path) -> Config:
    """The run's :class:`Config` from ``leviathan.json`` (validated without touching its data paths)."""
    data = copy.deepcopy(record.config)
    tokenizer = (data.get("data") or {}).pop("tokenizer", None)
    try:
        cfg = build(Config, data)
        validate_tree(cfg)  # the tokenizer check is done separately (check_tokenizer), with its own message
    except ConfigError as e:
        raise EvalError(f"{where}: the recorded config does not load with this version ({e})") from None
    cfg.data.tokenizer = tokenizer
    return cfg


def check_tokenizer(
    cfg: Config, record: CheckpointRecord, tokenizer: str | os.PathLike | None, where: Path
) -> "Tokenizer | None":
    """The tokenizer to use: ``tokenizer`` or the run's ``data.tokenizer`` (with its ``data.tiktoken_pattern``), any
    kind; its fingerprint must equal the one recorded at training. None when neither is there (then only shard
    evaluation is possible)."""
    from common.cli import UserError
    from leviathan_pretrain.data.tokenizer import config_spelling, open_cached

    spec = str(tokenizer) if tokenizer else cfg.data.tokenizer
    if not spec:
        return None
    if not tokenizer and not (spec.startswith("tiktoken:") or os.path.exists(spec)):
        return None
    try:
        tok = open_cached(spec, cfg.data.tiktoken_pattern)
    except (UserError, OSError) as e:
        raise EvalError(config_spelling(str(e))) from None
    want = record.tokenizer_fp
    if want and tok.fingerprint != want:
        raise EvalError(
            f"{tok.path}: fingerprint {tok.fingerprint[:16]}... differs from the tokenizer this run trained with "
            f"({want[:16]}..., {cfg.data.tokenizer}, recorded in {where}); give --tokenizer with the run's tokenizer"
        )
    return tok


# ---------------------------------------------------------------- weights


def _eval_model_config(cfg: Config, tp_saved: int):
    m = copy.deepcopy(cfg.model)
    m.make_vocab_size_divisible_by *= tp_saved  # the saved shards' padded vocabulary, at TP = 1
    if m.loss_impl == "liger":  # the training mean's kernel (CUDA): evaluation scores on model/loss.py's path
        m.loss_impl = "fused"
    return m


def _piece_of(key: str) -> tuple[str, str]:
    """``"3.layer.mlp..."`` -> ("3", "layer.mlp..."); TIED's shared piece -> ("tied", "embedding...")."""
    if key.startswith("tied_modules."):
        return "tied", key.split(".", 2)[2]
    index, _, rest = key.partition(".")
    return index, rest


@contextlib.contextmanager
def _weights_only():
    from leviathan_pretrain.trainer.checkpoint.reshard import weights_only_torch_load

    with weights_only_torch_load():
        yield


def _zero3_state(tag_dir: Path, tp_rank: int) -> dict:
    """The fp32 weights of one TP rank from ZeRO-3 partitions (DeepSpeed's zero_to_fp32 on that rank's files)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    files = sorted(tag_dir.glob(f"*mp_rank_{tp_rank:02d}_*.pt"))
    if not files:
        raise EvalError(f"{tag_dir}: no ZeRO-3 files of tensor-parallel rank {tp_rank}")
    tmp = Path(tempfile.mkdtemp(prefix="leviathan-zero3-"))  # ours: links to one TP rank's files
    try:
        (tmp / "t").mkdir()
        for f in files:
            os.symlink(f.resolve(), tmp / "t" / f.name)
        (tmp / "latest").write_text("t")
        with open(os.devnull, "w") as quiet, _weights_only(), contextlib.redirect_stdout(quiet):
            with contextlib.redirect_stderr(quiet):  # its progress bars
                return get_fp32_state_dict_from_zero_checkpoint(str(tmp), tag="t")
    except (CheckpointError, OSError, ValueError, KeyError) as e:
        raise EvalError(f"{tag_dir}: its ZeRO-3 files of tensor-parallel rank {tp_rank} do not load ({e})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def shard_states(tag_dir: Path, layout: ParallelLayout) -> list[dict]:
    """Per TP rank, the state dict of the whole model (keys as the PP = 1 model names them)."""
    from leviathan_pretrain.trainer.checkpoint.safe_io import safe_load

    tp, pp, zero = layout.tp, layout.pp, layout.zero_stage or 0
    states = []
    for t in range(tp):
        if zero == 3:
            states.append(_zero3_state(tag_dir, t))
        elif pp == 1:
            f = tag_dir / f"mp_rank_{t:02d}_model_states.pt"
            if not f.is_file():
                raise EvalError(f"{f}: missing (the checkpoint says TP={tp}, PP=1)")
            try:
                states.append(dict(safe_load(f)["module"]))
            except CheckpointError as e:
                raise EvalError(str(e)) from None
        else:
            files = sorted(tag_dir.glob(f"layer_*-model_{t:02d}-model_states.pt"))
            if not files:
                raise EvalError(f"{tag_dir}: no pipeline layer files of tensor-parallel rank {t} (PP={pp})")
            sd = {}
            for f in files:
                index = int(f.name.split("-", 1)[0][len("layer_") :])
                try:
                    sd.update({f"{index}.{k}": v for k, v in safe_load(f).items()})
                except CheckpointError as e:
                    raise EvalError(str(e)) from None
            states.append(sd)
    return states


def merge_tp(model: torch.nn.Module, states: list[dict]) -> dict:
    """The TP = 1 state dict of ``model`` from per-TP-rank ``states`` (see the module doc)."""
    params = dict(model.named_parameters())
    out = {}
    for key, target in model.state_dict().items():
        piece, rest = _piece_of(key)
        names = [key] if piece != "tied" else [key, f"0.{rest}"]  # pipeline files store TIED's table as piece 0
        found = next((n for n in names if n in states[0]), None)
        if found is None:
            if key.endswith("_extra_state"):
                out[key] = target
                continue
            raise EvalError(f"the checkpoint has no weights for {key} (another variant or configuration?)")
        shards = [s[found] for s in states]
        p = params.get(key)
        if len(shards) == 1 or p is None or not getattr(p, "tensor_model_parallel", False):
            value = shards[0]
        elif key.endswith("mlp.linear_fc1.weight"):  # SwiGLU: [gate; up] per shard
            halves = [s.chunk(2, dim=0) for s in shards]
            value = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        else:
            value = torch.cat(shards, dim=p.partition_dim)
        if torch.is_tensor(target) and tuple(value.shape) != tuple(target.shape):
            raise EvalError(
                f"{key}: merged shape {tuple(value.shape)} != the model's {tuple(target.shape)} "
                "(the checkpoint is of another configuration)"
            )
        out[key] = value
    return out


# ---------------------------------------------------------------- the world and the model


@contextlib.contextmanager
def eval_world(device: str = "cpu"):
    """torch.distributed + megatron-core's groups at TP = PP = 1 for in-process evaluation: a 1-process gloo group
    unless the process was launched with rank variables (then every rank joins; data-parallel evaluation)."""
    from megatron.core import parallel_state as ps

    from leviathan_pretrain.config import ParallelConfig
    from leviathan_pretrain.model.settings import resolve_device
    from leviathan_pretrain.parallel import groups

    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if launched:
        env = groups.init_distributed(ParallelConfig(device=device))
        try:
            yield env.device
        finally:
            groups.destroy_distributed()
        return
    with groups.one_process_group():
        made = not ps.model_parallel_is_initialized()
        if made:
            ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        try:
            yield torch.device(resolve_device(device))
        finally:
            if made:
                ps.destroy_model_parallel()


def load_trained(
    run_dir: str | os.PathLike,
    step: int | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    tokenizer: str | os.PathLike | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    lookup: bool = True,
) -> Trained:
    """Load a run's checkpoint as one model (see the module doc); inside :func:`eval_world`. ``lookup``: the input
    layers that are functions of the token id (LEV, ALBERT, the MLPs) are materialised into their ``V x D`` table
    once and serve every forward as one lookup, as an exported model does (``lookup=False``: the training-mode
    function)."""
    from megatron.core import parallel_state as ps

    from leviathan_pretrain.model.assembly import build_model
    from leviathan_pretrain.model.settings import BuildSettings

    ckpt_dir = checkpoint_location(run_dir, checkpoint_dir)
    tag = select_tag(ckpt_dir, step)
    where = ckpt_dir / tag / META
    try:
        record = CheckpointRecord.read(where)
    except CheckpointError as e:
        raise EvalError(str(e)) from None
    from leviathan_pretrain.model.assembly import LAYOUT_VERSION

    if record.model_layout != LAYOUT_VERSION:
        raise EvalError(f"{where}: model layout {record.model_layout} (this version reads layout {LAYOUT_VERSION})")
    cfg = saved_config(record, where)
    tok = check_tokenizer(cfg, record, tokenizer, where)
    model_cfg = _eval_model_config(cfg, record.layout.tp)
    build_settings = BuildSettings(
        tensor_parallel=1, tp_group=ps.get_tensor_model_parallel_group(), precision="fp32", device="cpu"
    )
    model = build_model(model_cfg, build_settings)
    states = shard_states(ckpt_dir / tag, record.layout)
    merged = merge_tp(model, states)
    del states
    model.load_state_dict(merged, strict=True)
    model = model.to(device=device, dtype=dtype).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    layer = model.input_layer
    if lookup and hasattr(layer, "enable_lookup"):
        layer.enable_lookup(layer.materialize(dtype=dtype))
    return Trained(
        run_dir=Path(run_dir),
        ckpt_dir=ckpt_dir,
        tag=tag,
        step=record.step,
        record=record,
        cfg=cfg,
        model=model,
        tokenizer=tok,
    )
