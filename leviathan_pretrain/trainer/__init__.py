"""The trainer behind ``python -m leviathan_pretrain.train``: one module per concern.

- :mod:`.data`        shard checks, megatron-core ``GPTDataset`` blends, deterministic micro-batches
- :mod:`.schedule`    learning-rate schedule and AdamW parameter groups
- :mod:`.engine`      the DeepSpeed engine (megatron-core model, or a DeepSpeed ``PipelineModule`` for PP > 1)
- :mod:`.pipe`        the pipeline-stage layers
- :mod:`.checkpoint`  DeepSpeed checkpoints, atomic ``latest``, keep-last-K, RNG/data state, safe loading
- :mod:`.metrics`     TensorBoard, console line, ``train_log.jsonl``, throughput/MFU/memory
- :mod:`.faults`      non-finite steps, SIGTERM/SIGUSR1, exit codes
- :mod:`.loop`        the training loop tying them together
"""
