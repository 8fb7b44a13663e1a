"""The bottom layer: what every command and package shares, and nothing else (torch-free, imports no other
package of the project).

- :mod:`.exit_codes`    every command's exit codes (0, 1, 2 bad input, 3 diverged, 75 requeue, 76 lost a peer)
- :mod:`.cli`           the command-line vocabulary (``--run``, ``--out``, ``--overwrite``, ``--dtype``, ``--quiet``),
                        :class:`~.cli.UserError` and the one-line-error ``run_main``
- :mod:`.fileio`        atomic writes (temporary name, fsync, rename), ``sha256_file``, ``read_json``
- :mod:`.dtypes`        the one dtype table: ``fp32``/``bf16``/``fp16``, torch / Hugging Face names, bytes
- :mod:`.entry_points`  ``"package.module:name"`` -> the object, imported on first use (the command table, the
                        variant registry)
"""
