"""The small GPT of the model tests, shared by the in-process tests (tests/test_model.py) and the
tensor-parallel worker (tests/workers/model_tp.py): 2 layers, hidden 64, 4 heads in 2 query groups."""


def small_model_overrides(variant: str, vocab_size: int, seq_length: int) -> list[str]:
    """``load_config`` overrides for the small ``variant`` model on the CPU."""
    return [
        f"model.variant={variant}",
        f"model.vocab_size={vocab_size}",
        "model.hidden_size=64",
        "model.num_layers=2",
        "model.num_attention_heads=4",
        "model.num_query_groups=2",
        f"model.seq_length={seq_length}",
        "model.lev.seed_dim=16",
        "model.lev.heads=4",
        "model.lev.knots=6",
        "model.lev.rank=8",
        "parallel.device=cpu",
    ]
