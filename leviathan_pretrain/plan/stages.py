"""Pipeline stages as DeepSpeed splits the model's pieces (pure Python; used by :mod:`.planner`).

``partition_balanced`` is DeepSpeed's linear-partition dynamic programme; ``stage_layout`` says which pieces
(input layer, transformer layers, final norm, head: model/assembly.py) each stage holds.
"""

from __future__ import annotations

import math


def partition_balanced(weights: list[int], parts: int) -> list[int]:
    """DeepSpeed's ``runtime.utils.partition_balanced`` (the linear-partition dynamic programme its
    ``PipelineModule`` uses for ``partition_method="type:..."``), in pure Python: stage boundaries ``[0, ..., n]``."""
    n, m = len(weights), parts
    if n <= m:
        return [min(p, n) for p in range(m + 1)]
    inf = math.inf
    dp_max = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_min = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_cost = [[inf] * (m + 1) for _ in range(n + 1)]
    position = [[0] * (m + 1) for _ in range(n + 1)]
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    dp_max[0][0] = dp_cost[0][0] = 0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                seg = prefix[i] - prefix[k]
                hi, lo = max(dp_max[k][j - 1], seg), min(dp_min[k][j - 1], seg)
                cost = hi - lo
                if dp_cost[i][j] >= cost:
                    dp_cost[i][j], dp_max[i][j], dp_min[i][j], position[i][j] = cost, hi, lo, k
    bounds = [n]
    for j in range(m, 0, -1):
        bounds.append(position[bounds[-1]][j])
    return bounds[::-1]


def stage_layout(num_layers: int, pp: int) -> list[dict]:
    """Per pipeline stage: ``{"blocks", "input", "final", "head"}`` for the pieces input, L blocks, final norm,
    head (model/assembly.py), split as DeepSpeed splits them (``type:BlockPiece``)."""
    n = num_layers + 3
    if pp == 1:
        bounds = [0, n]
    else:
        bounds = partition_balanced([0] + [1] * num_layers + [0, 0], pp)
    out = []
    for s in range(pp):
        lo, hi = bounds[s], bounds[s + 1]
        out.append(
            {
                "blocks": sum(1 for i in range(lo, hi) if 1 <= i <= num_layers),
                "input": lo <= 0 < hi,
                "final": lo <= num_layers + 1 < hi,
                "head": lo <= num_layers + 2 < hi,
            }
        )
    return out
