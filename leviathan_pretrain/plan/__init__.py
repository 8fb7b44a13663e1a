"""The plan of a run before it is submitted (pure Python: no torch, megatron or DeepSpeed import): what the SLURM
launcher's checks print and refuse, and what the memory benchmarks compare with.

- :mod:`.planner`      ``make_plan``: the parallel grid, batch arithmetic and per-GPU memory estimate; ``format_plan``
- :mod:`.activations`  the saved activations of a stage (recompute and sequence parallelism included)
- :mod:`.layouts`      the layouts that fit, proposed when one does not
- :mod:`.stages`       how DeepSpeed's pipeline splits the model's pieces into stages
"""
