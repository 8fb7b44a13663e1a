"""Leviathan-pretrain: LEV-embedding GPTs on megatron-core + DeepSpeed."""
