"""Leviathan models: a LLaMA-style GPT on megatron-core layers with a swappable input representation. Import the
module that owns a name (nothing is re-exported here, so the torch-free modules stay torch-free).

Torch-free: :mod:`.sizes` (closed forms: padded vocabulary, matched widths, LEV's parts, a layer), :mod:`.variants`
(the input-variant registry), :mod:`.counts` (a model's parameters by part), :mod:`.flops` (model FLOPs per token).

The model: :mod:`.settings` (``BuildSettings``: TP size/group, precision, device), :mod:`.assembly`
(``model_pieces``, ``build_model``, ``GPT``, the state-dict layout), :mod:`.gpt` (megatron-core's transformer config
and layer spec, the input layer the registry names), :mod:`.attention` (CPU-safe SDPA attention and rotary),
:mod:`.recompute`, :mod:`.sp` (sequence parallelism), :mod:`.tp` (tensor-parallel parameter helpers).

Input layers: :mod:`.lev` (LEV, docs/lev.md), :mod:`.spline` and :mod:`.spline_triton` (its spline product in torch
and as Triton kernels), :mod:`.inputs` (the baselines: TIED/UNTIED tables, ALBERT, the MLPs).

The output: :mod:`.head` (the head for every ``model.loss_impl``), :mod:`.loss` (fused chunked linear + cross
entropy), :mod:`.loss_liger` (Liger-Kernel's). The token vectors' geometry: :mod:`.geometry`.

Start-up: :mod:`.deferred_compile` (megatron-core's ``torch.compile`` decorations made at the first call, installed by
the package's ``__init__``).
"""
