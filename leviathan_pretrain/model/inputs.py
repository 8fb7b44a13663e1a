"""Input representations behind one interface: ``forward(input_ids [b, s], position_ids=None) -> [s, b, D]``.

- :class:`TableInput` (``tied`` / ``untied``): megatron-core's own ``LanguageModelEmbedding``
  (a ``VocabParallelEmbedding`` over the padded vocabulary) plus the token-id range check.
- :class:`UniqueIdInput`: the base of every layer whose row is a *function* of the token id (LEV, ALBERT,
  the MLP ablations). It computes the rows once per unique id of the micro-batch
  (``torch.unique(return_inverse=True)``), sums this rank's partial rows over the TP group
  (``reduce_from_tensor_model_parallel_region``; under sequence parallelism a reduce-scatter along the
  sequence after the indexing, model/sp.py) and indexes them back to ``[s, b, D]``. ``materialize()`` returns the
  full ``V x D`` table and ``enable_lookup()`` turns the layer into a plain table lookup (inference).
- :class:`AlbertInput`, :class:`FlatMLPInput`, :class:`FactoredMLPInput`: the paper's baselines/ablations.
  The MLPs shard their hidden layer over TP like LEV shards its heads. :class:`~.lev.LEVInput` lives in lev.py.

Token ids outside ``[0, vocab_size)`` raise :class:`TokenIdError` (never a silent wrap-around or the
zero row a vocab-parallel table would give); on an accelerator the layers check without a host
synchronisation (:func:`check_token_ids`). Host synchronisations per micro-batch: none for the tables, one for
the unique-id layers (``torch.unique``'s output size; docs/model.md, "LEV on a GPU"), none when the caller
passes the unique ids made on the host (:class:`UniqueIds`, ``forward(..., unique=...)``; the trainer's data
path does, ``data.unique_ids``, data/transfer.py).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from leviathan_pretrain.model import sizes
from leviathan_pretrain.model.settings import ModelConfigError, group_size
from leviathan_pretrain.model.sp import reduce_scatter_seq, split_seq
from leviathan_pretrain.model.tp import (
    const_init,
    copy_to_tp,
    normal_init,
    reduce_from_tp,
    replicated_param,
    sharded_param,
)


class TokenIdError(ValueError):
    """A token id is outside ``[0, model.vocab_size)``."""


class UniqueIds(NamedTuple):
    """A micro-batch's unique token ids, made before the forward (on the host, by the data path):
    ``torch.unique(input_ids, return_inverse=True)`` with ``ids`` padded at the end to a bucket by repeating its
    last id (rows computed, never indexed: zero gradient). ``ids [n_pad]`` and ``inverse`` (``input_ids``' shape,
    indices into ``ids``) are on the model's device; ``count`` (a host int) is the true number of unique ids."""

    ids: torch.Tensor
    inverse: torch.Tensor
    count: int


def reads_are_free(t: torch.Tensor) -> bool:
    """Whether reading ``t``'s values on the host costs no device synchronisation (it is in host memory)."""
    return t.device.type == "cpu"


def check_token_ids(input_ids: torch.Tensor, vocab_size: int) -> None:
    """Raise :class:`TokenIdError` naming the offending id unless every id is in ``[0, vocab_size)``.

    Host tensors (the data loader's, a CPU model's) are checked on the host. On an accelerator reading the
    range back would stop the host until the device's queue drains, every micro-batch: there the check is a
    ``torch._assert_async`` (no host synchronisation; an out-of-range id stops the run with a device-side
    assertion, never a silent wrong row, but CUDA reports no message). The trainer and evaluation check their
    ids while they are still host tensors (``trainer.data.Batches``, ``evaluation.scoring``), so a bad id in the
    data still raises the readable :class:`TokenIdError` first."""
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
    if input_ids.numel() == 0:
        return
    lo, hi = torch.aminmax(input_ids)
    why = (
        f"outside [0, {vocab_size}) (model.vocab_size={vocab_size}); the data's tokenizer and model.vocab_size disagree"
    )
    if not reads_are_free(input_ids):
        torch._assert_async((lo >= 0) & (hi < vocab_size), f"a token id is {why}")
        return
    lo, hi = int(lo), int(hi)
    if lo < 0 or hi >= vocab_size:
        raise TokenIdError(f"token id {lo if lo < 0 else hi} is {why}")


class TableInput(LanguageModelEmbedding):
    """TIED / UNTIED input: megatron-core's ``LanguageModelEmbedding`` (RoPE, so no position table).

    ``word_embeddings.weight`` is the ``[V_pad / tp, D]`` vocab-parallel table; TIED's output head is this
    table (model/assembly.py)."""

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        padded_vocab_size: int,
        max_sequence_length: int,
        tp_group=None,
    ):
        super().__init__(
            config=config,
            vocab_size=padded_vocab_size,
            max_sequence_length=max_sequence_length,
            position_embedding_type="rope",
            tp_group=tp_group,
        )
        self.token_vocab_size = vocab_size

    @classmethod
    def from_model(cls, config: TransformerConfig, model_cfg, padded_vocab_size: int, tp_group=None):
        """The registry's constructor (model/variants.py): every input layer is built from the same four."""
        return cls(config, model_cfg.vocab_size, padded_vocab_size, model_cfg.seq_length, tp_group)

    def forward(self, input_ids, position_ids=None, tokentype_ids=None, unique: UniqueIds | None = None):
        """``unique`` (the unique-id layers' input) is ignored: a table looks every token up."""
        check_token_ids(input_ids, self.token_vocab_size)
        if self.config.sequence_parallel and group_size(self.tp_group) > 1:
            return self._sequence_parallel_forward(input_ids)
        return super().forward(input_ids, position_ids, tokentype_ids)

    def _sequence_parallel_forward(self, input_ids):
        """megatron-core's vocab-parallel lookup (this rank's rows, zero elsewhere), then the sum over TP as a
        reduce-scatter along the sequence (model/sp.py: megatron's own allocates on CUDA) -> ``[s / tp, b, D]``."""
        emb = self.word_embeddings
        outside = (input_ids < emb.vocab_start_index) | (input_ids >= emb.vocab_end_index)
        local = input_ids - emb.vocab_start_index
        local[outside] = 0
        rows = F.embedding(local, emb.weight)
        rows[outside, :] = 0.0
        x = reduce_scatter_seq(rows.transpose(0, 1).contiguous(), self.tp_group)
        x = x.float() if self.config.fp32_residual_connection else x
        return self.embedding_dropout(x)  # dropout is 0 (gpt.py): no RNG fork


class UniqueIdInput(MegatronModule):
    """Rows computed once per unique token id, then indexed. Subclasses implement :meth:`compute_rows`.

    ``partial_over_tp``: True when ``compute_rows`` returns this TP rank's partial sum (sharded heads or
    hidden units) that must be summed over the TP group; False when it returns full, replicated rows.
    ``tp_group``: the tensor-parallel process group (``None``: no tensor parallelism)."""

    partial_over_tp = True

    def __init__(self, config: TransformerConfig, vocab_size: int, hidden_size: int, tp_group=None):
        super().__init__(config=config)
        self.tp_group = tp_group
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.embedding_dropout = torch.nn.Dropout(config.hidden_dropout)
        self.register_buffer("lookup_table", None, persistent=False)
        self.last_unique_ratio = 1.0  # unique ids / tokens of the last micro-batch (for FLOPs accounting)

    @classmethod
    def from_model(cls, config: TransformerConfig, model_cfg, padded_vocab_size: int, tp_group=None):
        """The registry's constructor (model/variants.py); layers without a table ignore ``padded_vocab_size``."""
        return cls(config, model_cfg, padded_vocab_size, tp_group)

    def compute_rows(self, ids: torch.Tensor, record: bool = False) -> torch.Tensor:
        """``ids [n]`` (unique, in range) -> ``[n, D]`` rows (partial over TP if ``partial_over_tp``)."""
        raise NotImplementedError

    # -- training / evaluation path --------------------------------------------------------------
    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, unique: UniqueIds | None = None
    ) -> torch.Tensor:
        """``[b, s]`` ids -> ``[s, b, D]``. ``unique``: the micro-batch's unique ids made beforehand (no host
        synchronisation here); without it they are made here with ``torch.unique``."""
        check_token_ids(input_ids, self.vocab_size)
        if self.lookup_table is not None:
            x = F.embedding(input_ids.t(), self.lookup_table)
            return self._finish(x, partial=False, indexed=True)
        if unique is None:
            # The one host synchronisation of the step's input path on an accelerator: the number of unique ids
            # (data-dependent) sizes the rows and the chunk loop. The trainer avoids it by making them on the
            # host (data.unique_ids); docs/performance.md, "LEV on a GPU".
            uniq, inverse = torch.unique(input_ids, return_inverse=True)
            count = uniq.numel()
        else:
            uniq, inverse, count = unique
            if tuple(inverse.shape) != tuple(input_ids.shape) or not 0 < count <= uniq.numel():
                raise ValueError(
                    f"unique: inverse {tuple(inverse.shape)} for input_ids {tuple(input_ids.shape)}, count {count} "
                    f"of {uniq.numel()} ids; make it with trainer.transfer.unique_ids(input_ids)"
                )
        self.last_unique_ratio = count / max(1, input_ids.numel())
        rows = self.compute_rows(uniq, record=True)
        if count < uniq.numel():
            self.trim_record(count)
        return self._finish(rows, partial=self.partial_over_tp, indexed=False, inverse=inverse)

    def trim_record(self, count: int) -> None:
        """After ``compute_rows(record=True)`` over padded ids: a layer that keeps a record of its last rows (LEV's
        health figures) keeps the ``count`` true ids' only. None here."""

    def _finish(self, x, partial: bool, indexed: bool, inverse=None):
        """Rows (``indexed``: already ``[s, b, D]``) -> the layer's output: summed over TP when ``partial``; under
        sequence parallelism this rank's ``[s / tp, b, D]`` (partial rows: reduce-scatter along the sequence, the
        LEV spec's TP sum; replicated ones: the rank's slice). Dropout is always 0 here (gpt.py): no RNG fork."""
        sp = self.config.sequence_parallel
        if not indexed:
            if partial and not sp:
                x = reduce_from_tp(x, self.tp_group)
            x = x[inverse.t()]  # [s, b, D]
            if sp:
                x = reduce_scatter_seq(x, self.tp_group) if partial else split_seq(x, self.tp_group)
        elif sp:
            x = split_seq(x, self.tp_group)
        x = x.float() if self.config.fp32_residual_connection else x.to(self.config.params_dtype)
        return self.embedding_dropout(x)

    # -- inference -----------------------------------------------------------------------------
    @torch.no_grad()
    def materialize(self, chunk: int = 8192, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The full ``[vocab_size, D]`` table ``G(0..V-1)`` (summed over TP; every TP rank must call it)."""
        device = next(self.parameters()).device
        parts = []
        for s in range(0, self.vocab_size, chunk):
            ids = torch.arange(s, min(self.vocab_size, s + chunk), device=device)
            rows = self.compute_rows(ids)
            if self.partial_over_tp:
                rows = reduce_from_tp(rows, self.tp_group)
            parts.append(rows.to(dtype or self.config.params_dtype))
        return torch.cat(parts)

    def enable_lookup(self, table: torch.Tensor | None = None) -> None:
        """Serve ``forward`` from a materialised table (no gradient reaches the layer's parameters):
        inference then costs one lookup, like an untied model."""
        table = self.materialize() if table is None else table
        if tuple(table.shape) != (self.vocab_size, self.hidden_size):
            raise ValueError(f"lookup table must be [{self.vocab_size}, {self.hidden_size}], got {tuple(table.shape)}")
        self.lookup_table = table.detach()

    def disable_lookup(self) -> None:
        self.lookup_table = None


def _mlp_shards(d_in: int, hidden: int, d_out: int, std: float, dtype, group, layer_norm: bool):
    """[LayerNorm(d_in)] -> fc1 [hidden, d_in] (LeCun init) -> GELU -> fc2 [d_out, hidden]; hidden sharded."""
    if hidden % group_size(group):
        raise ModelConfigError(
            f"model.mlp_hidden: {hidden} is not divisible by parallel.tensor_parallel={group_size(group)}"
        )
    out = {}
    if layer_norm:
        out["ln_weight"] = replicated_param([d_in], const_init(1.0), dtype)
        out["ln_bias"] = replicated_param([d_in], const_init(0.0), dtype)
    out["fc1"] = sharded_param([hidden, d_in], 0, normal_init(1.0 / math.sqrt(d_in)), dtype, group)
    out["fc2"] = sharded_param([d_out, hidden], 1, normal_init(std), dtype, group)
    return out


def _vocab_parallel_table(config, padded_vocab_size: int, dim: int, tp_group):
    """A vocab-parallel ``V x dim`` embedding table (rows sharded over TP), the first step of the ALBERT and
    flat-MLP inputs."""
    return tensor_parallel.VocabParallelEmbedding(
        num_embeddings=padded_vocab_size,
        embedding_dim=dim,
        init_method=config.embedding_init_method,
        config=config,
        tp_group=tp_group,
    )


def _mlp_partial(mod, x):
    """This rank's partial MLP output (``x`` replicated across TP)."""
    if "ln_weight" in mod._parameters:
        x = F.layer_norm(x, (x.shape[-1],), mod.ln_weight.to(x.dtype), mod.ln_bias.to(x.dtype), 1e-5)
    x = copy_to_tp(x, mod.tp_group)
    return F.linear(F.gelu(F.linear(x, mod.fc1.to(x.dtype))), mod.fc2.to(x.dtype))


class AlbertInput(UniqueIdInput):
    """ALBERT: ``E = A[i] @ P`` with ``A`` a vocab-parallel ``V x e`` table and ``P`` a replicated ``e x D``."""

    partial_over_tp = False

    def __init__(self, config, model_cfg, padded_vocab_size: int, tp_group=None):
        super().__init__(config, model_cfg.vocab_size, model_cfg.hidden_size, tp_group)
        self.dim = sizes.albert_dim(model_cfg)
        self.table = _vocab_parallel_table(config, padded_vocab_size, self.dim, tp_group)
        self.proj = replicated_param(
            [model_cfg.hidden_size, self.dim], normal_init(config.init_method_std), config.params_dtype
        )

    def compute_rows(self, ids, record=False):
        return F.linear(self.table(ids), self.proj)


class FlatMLPInput(UniqueIdInput):
    """Flat MLP ablation: a small vocab-parallel ``V x e`` table, then an MLP ``e -> m -> D`` (hidden sharded).

    No LayerNorm on the table's rows: at the parameter-matched widths (``e`` = 1 at the tiny scale, 3-5 at
    200M-1.2B) it would erase them: a normalised 1-vector is 0 for every token, a 3-vector keeps one angle."""

    def __init__(self, config, model_cfg, padded_vocab_size: int, tp_group=None):
        super().__init__(config, model_cfg.vocab_size, model_cfg.hidden_size, tp_group)
        self.dim, self.mlp_hidden = sizes.flat_mlp_dims(model_cfg)
        self.table = _vocab_parallel_table(config, padded_vocab_size, self.dim, tp_group)
        for name, p in _mlp_shards(
            self.dim,
            self.mlp_hidden,
            model_cfg.hidden_size,
            config.init_method_std,
            config.params_dtype,
            tp_group,
            layer_norm=False,
        ).items():
            self.register_parameter(name, p)

    def compute_rows(self, ids, record=False):
        return _mlp_partial(self, self.table(ids).float())


class DigitCodebooks(torch.nn.Module):
    """Spec steps 1-2: base-b digits (most significant first) and ``z(i) = sum_j C[j, i_j]``; replicated."""

    def __init__(self, vocab_size: int, lev_cfg, dtype):
        super().__init__()
        self.digits, self.base = lev_cfg.digits, lev_cfg.resolved_base(vocab_size)
        if self.base**self.digits < vocab_size:
            raise ModelConfigError(f"model.lev.base: b**k = {self.base}**{self.digits} < vocab_size {vocab_size}")
        self.weight = replicated_param([self.digits, self.base, lev_cfg.seed_dim], normal_init(lev_cfg.init_std), dtype)
        self.weight.lev_codebook = True  # weight-decay grouping (optim.decay_lev_codebooks)
        place = torch.tensor([self.base ** (self.digits - 1 - j) for j in range(self.digits)], dtype=torch.long)
        self.register_buffer("place", place, persistent=False)
        self.register_buffer("offset", torch.arange(self.digits, dtype=torch.long) * self.base, persistent=False)

    def digits_of(self, ids: torch.Tensor) -> torch.Tensor:
        """``[n] -> [n, k]`` base-b digits."""
        return (ids[:, None] // self.place) % self.base

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.digits_of(ids) + self.offset  # rows of C viewed as [k * b, d]
        return F.embedding(rows, self.weight.view(-1, self.weight.shape[-1])).sum(1)


class FactoredMLPInput(UniqueIdInput):
    """Factored MLP ablation: LEV's digit codebooks ``z(i)`` then an MLP ``d_seed -> m -> D`` (hidden sharded)."""

    @classmethod
    def from_model(cls, config, model_cfg, padded_vocab_size: int, tp_group=None):
        return cls(config, model_cfg, tp_group)

    def __init__(self, config, model_cfg, tp_group=None):
        super().__init__(config, model_cfg.vocab_size, model_cfg.hidden_size, tp_group)
        self.mlp_hidden = sizes.factored_mlp_hidden(model_cfg)
        self.codebooks = DigitCodebooks(model_cfg.vocab_size, model_cfg.lev, config.params_dtype)
        for name, p in _mlp_shards(
            model_cfg.lev.seed_dim,
            self.mlp_hidden,
            model_cfg.hidden_size,
            config.init_method_std,
            config.params_dtype,
            tp_group,
            layer_norm=True,
        ).items():
            self.register_parameter(name, p)

    def compute_rows(self, ids, record=False):
        return _mlp_partial(self, self.codebooks(ids).float())
