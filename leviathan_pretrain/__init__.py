"""Leviathan-pretrain: LEV-embedding GPTs on megatron-core + DeepSpeed.

Importing the package defers megatron-core's compile decorations to their first call (model/deferred_compile.py:
1.4 CPU-s off the start of every process that imports megatron-core), before any of its modules imports it.
"""

from leviathan_pretrain.model import deferred_compile

deferred_compile.install()
