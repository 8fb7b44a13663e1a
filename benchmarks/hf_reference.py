"""The plain Hugging Face loops ``benchmarks/bench_step.py`` times ours against (its contestants C and D).

- :class:`Reference` (C): ``LlamaForCausalLM`` of our shape (``hf/convert.llama_config``; SDPA, the
  vocabulary padded as ours unless ``vocab="exact"``), in the run's precision (pure bf16 weights for bf16: what a
  plain loop trains), logits -> fp32 ``cross_entropy``, gradient accumulation over the same micro-batches,
  ``clip_grad_norm_`` and torch AdamW with our hyper-parameters, weight-decay groups and kernel flags.
- :class:`LigerReference` (D): the same model with what a Hugging Face user who cares about speed adds:
  Liger-Kernel's RMSNorm, SwiGLU MLP and RoPE (``apply_liger_kernel_to_llama`` on this instance), its fused linear
  cross entropy (``liger_fused_linear_cross_entropy`` on the final hidden states and ``lm_head.weight``, the logits
  never made) cut into as many chunks as our loss uses (``chunk_mem_const``, :func:`liger_chunk_mem_const`), and
  ``torch.compile`` of each decoder layer (torchtitan's per-block compile; one graph serves every layer).

Liger patches module-level names of ``transformers.models.llama.modeling_llama``; both classes live in one
process, so :class:`LigerReference` restores the names it does not need patched after building its instance, and
swaps the RoPE function in for the duration of its own steps only (``_liger_rope``): the reference (C) keeps the
plain Hugging Face functions. Liger needs triton (a CUDA torch brings it); on the CPU only under
``TRITON_INTERPRET=1`` (slow; the ``--dry`` check).
"""

from __future__ import annotations

import contextlib
import math


def _llama(cfg, device, vocab: str, dtype):
    import torch
    from transformers import LlamaForCausalLM

    from leviathan_pretrain.hf.convert import llama_config
    from leviathan_pretrain.model import sizes

    hf = llama_config(cfg, {"bos": 1, "eos": 2, "pad": 0}, "float32")
    if vocab == "padded":
        hf.vocab_size = sizes.padded_vocab_size(cfg.model.vocab_size, cfg.model.make_vocab_size_divisible_by, 1)
    hf._attn_implementation = "sdpa"
    torch.manual_seed(cfg.train.seed)
    with torch.device(device):
        model = LlamaForCausalLM(hf).to(dtype)
    model.train()
    return model


class Reference:
    """(C) Hugging Face ``LlamaForCausalLM`` + torch AdamW in a plain loop."""

    name = "ref"

    def __init__(self, cfg, device, vocab: str = "padded"):
        import torch

        from leviathan_pretrain.trainer.engine import adamw_kernel
        from leviathan_pretrain.trainer.schedule import weight_decay_groups

        o = cfg.optim
        self.dtype = torch.bfloat16 if cfg.parallel.precision == "bf16" else torch.float32
        self.model = _llama(cfg, device, vocab, self.dtype)
        self.vocab_size, self.device, self.clip = self.model.config.vocab_size, device, o.clip_grad
        groups = weight_decay_groups(self.model, o.weight_decay)
        kernel = adamw_kernel(cfg, device.type == "cuda")
        self.opt = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, **kernel)
        self.params = [p for g in groups for p in g["params"]]

    def _inputs(self, mb: dict):
        return (mb[k].to(self.device) for k in ("tokens", "position_ids", "labels"))

    def _loss(self, mb: dict):
        import torch.nn.functional as F

        x, pos, y = self._inputs(mb)
        logits = self.model(input_ids=x, position_ids=pos).logits
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    def _update(self) -> None:
        import torch

        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def step(self, mbs: list[dict]) -> float:
        total = 0.0
        with self.context():
            for mb in mbs:
                loss = self._loss(mb)
                (loss / len(mbs)).backward()
                total = total + loss.detach()
            self._update()
        return float(total / len(mbs))

    def context(self):
        """What this loop's forward and backward run under (nothing here; Liger's RoPE for D)."""
        return contextlib.nullcontext()

    def phases(self, mbs: list[dict], clock) -> dict:
        t = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        with self.context():
            for mb in mbs:
                c = clock()
                loss = self._loss(mb)
                t["forward"] += clock() - c
                c = clock()
                (loss / len(mbs)).backward()
                t["backward"] += clock() - c
            c = clock()
            self._update()
            float(loss.item())
            t["step"] += clock() - c
        return t

    def describe(self) -> str:
        return "HF LlamaForCausalLM, SDPA, fp32 cross entropy of the logits, torch AdamW"


def liger_chunk_mem_const(tokens: int, vocab: int, hidden: int, chunks: int) -> int:
    """Liger's ``chunk_mem_const`` that cuts ``tokens`` into ``chunks`` chunks: its chunk is
    ``next_power_of_2(ceil(tokens / ceil(vocab / (C * hidden))))`` tokens (liger 0.8.5,
    ``fused_linear_cross_entropy_forward``), so ``C = ceil(vocab / (chunks * hidden))`` gives ``ceil(vocab / (C *
    hidden)) <= chunks`` pieces (8,192 tokens at V 200,064, D 1,024 in 2 chunks: C = 98, chunks of 4,096)."""
    return max(1, math.ceil(vocab / (max(1, chunks) * hidden)))


def liger_chunk_tokens(tokens: int, vocab: int, hidden: int, mem_const: int) -> int:
    """The chunk Liger 0.8.5 takes for these sizes (its own formula, for the record)."""
    inc = max(1, math.ceil(vocab / (mem_const * hidden)))
    return min(tokens, 1 << max(0, math.ceil(math.log2(max(1, math.ceil(tokens / inc))))))


class LigerReference(Reference):
    """(D) Hugging Face Llama + Liger-Kernel (RMSNorm, SwiGLU, RoPE, fused linear cross entropy with ``chunks``
    chunks per micro-batch) + ``torch.compile`` of each decoder layer (``compile=False``: Liger alone)."""

    name = "liger"

    def __init__(self, cfg, device, vocab: str = "padded", chunks: int = 1, compile: bool = True):
        # On the CPU (Triton's interpreter: the --dry check) Liger's RMSNorm and SwiGLU kernels do not run
        # (liger 0.8.5, triton 3.9: "'float' object has no attribute 'to'"); they stay Hugging Face's there.
        self.norms_mlp = device.type != "cpu"
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
        from transformers.models.llama import modeling_llama

        super().__init__(cfg, device, vocab)
        saved = {k: getattr(modeling_llama, k) for k in ("LlamaRMSNorm", "LlamaMLP", "apply_rotary_pos_emb")}
        try:  # patches this instance's norms and MLPs (and module names, restored below)
            apply_liger_kernel_to_llama(
                rope=False, cross_entropy=False, fused_linear_cross_entropy=False, rms_norm=self.norms_mlp,
                swiglu=self.norms_mlp, model=self.model,
            )  # fmt: skip
        finally:
            for k, v in saved.items():
                setattr(modeling_llama, k, v)
        self._rope = liger_rotary_pos_emb
        tokens = cfg.train.micro_batch_size * cfg.model.seq_length
        self.chunks = max(1, chunks)
        self.mem_const = liger_chunk_mem_const(tokens, self.vocab_size, cfg.model.hidden_size, self.chunks)
        self.chunk_tokens = liger_chunk_tokens(tokens, self.vocab_size, cfg.model.hidden_size, self.mem_const)
        self.compiled = compile
        if compile:
            for layer in self.model.model.layers:
                layer.compile()

    @contextlib.contextmanager
    def context(self):
        from transformers.models.llama import modeling_llama

        plain = modeling_llama.apply_rotary_pos_emb
        modeling_llama.apply_rotary_pos_emb = self._rope  # read by LlamaAttention.forward at call time
        try:
            yield
        finally:
            modeling_llama.apply_rotary_pos_emb = plain

    def _loss(self, mb: dict):
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        x, pos, y = self._inputs(mb)
        hidden = self.model.model(input_ids=x, position_ids=pos).last_hidden_state
        return liger_fused_linear_cross_entropy(
            hidden.flatten(0, 1), self.model.lm_head.weight, y.flatten(), chunk_mem_const=self.mem_const
        )

    def describe(self) -> str:
        kernels = "RMSNorm, SwiGLU, RoPE" if self.norms_mlp else "RoPE (CPU: not RMSNorm, SwiGLU)"
        return (
            f"HF Llama + Liger ({kernels}, fused linear CE in chunks of {self.chunk_tokens} tokens, "
            f"chunk_mem_const {self.mem_const})" + (" + torch.compile per decoder layer" if self.compiled else "")
        )
