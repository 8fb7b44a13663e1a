"""Hugging Face Llama checkpoints of a run (``lev export-hf``).

- :mod:`.export`     the export: ``DIR`` checked, the checkpoint converted, cast and checked, the files written beside
                     ``DIR`` (with our ``leviathan_export.json``) and renamed into place
- :mod:`.convert`    a loaded run's tensors as a Llama state dict and config; greedy decoding
- :mod:`.tokenizer`  the export's tokenizer, one writer per tokenizer kind, kept only if it encodes the probes to the
                     run's ids
"""
