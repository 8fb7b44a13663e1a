"""Per-token scoring of token streams with a loaded model: sliding windows, every target scored exactly once.

- :func:`logits_for` — ``[b, s]`` ids -> ``[b, s, V]`` fp32 logits over the tokenizer's ``V = model.vocab_size``
  ids (the padded vocabulary rows of the tables are dropped: they are no tokens);
- :func:`windows` — the sliding-window plan for a stream of ``n`` tokens: windows of at most ``context`` inputs,
  advancing by ``stride`` new targets each; target ``t`` (1 <= t < n) is predicted from tokens ``[start, t)``
  of the one window that scores it (no overlap double counting; ``stride == context``: disjoint windows, as in
  training);
- :func:`score_stream` / :func:`score_streams` — natural-log loss and greedy correctness of every target of one
  or many streams, windows batched (right-padded: the model is causal, so padding never reaches a scored
  position). Scored from the model's final hidden states and head weight (``GPT.head_input``) with the fused
  loss's chunked scorer (model/loss.py ``score_tokens``): only the scored positions, a chunk of them at a time,
  over the real ``V`` rows; no ``[batch, context, V]`` tensor.

Inputs are int64 tensors or numpy arrays on any device; results are float64 / bool numpy arrays on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from leviathan_pretrain.model.inputs import check_token_ids
from leviathan_pretrain.model.loss import score_tokens


@dataclass(frozen=True)
class Window:
    """Inputs ``stream[start:end]``; the last ``new`` positions are scored (targets ``end - new + 1 .. end``)."""

    stream: int
    start: int
    end: int
    new: int


def logits_for(model, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``model``'s fp32 logits ``[b, s, vocab_size]`` for ``ids [b, s]`` (positions 0..s-1)."""
    b, s = ids.shape
    pos = torch.arange(s, device=ids.device)[None].expand(b, s)
    with torch.no_grad():
        out = model(ids, pos)
    return out[..., :vocab_size].float()


def windows(n: int, context: int, stride: int, stream: int = 0) -> list[Window]:
    """The windows that score targets ``1..n-1`` of an ``n``-token stream (see the module doc)."""
    if context < 1 or not 1 <= stride <= context:
        raise ValueError(f"need 1 <= stride <= context, got context={context}, stride={stride}")
    out, done = [], 0  # targets 1..done are scored
    while done < n - 1:
        end = min(done + stride, n - 1)
        out.append(Window(stream, max(0, end - context), end, end - done))
        done = end
    return out


@dataclass
class Scores:
    """Per target (stream order): ``loss`` (nats, float64), ``correct`` (greedy argmax == target), ``target`` ids."""

    loss: np.ndarray
    correct: np.ndarray
    target: np.ndarray

    @property
    def tokens(self) -> int:
        return int(self.loss.size)

    @property
    def mean_loss(self) -> float:
        return float(self.loss.mean()) if self.loss.size else float("nan")


def score_streams(
    model,
    streams: list,
    vocab_size: int,
    context: int,
    stride: int,
    batch_size: int = 8,
    device: torch.device | str = "cpu",
    shard: tuple[int, int] = (0, 1),
    progress=None,
) -> list[Scores]:
    """Score every target of each stream (see :func:`windows`). ``shard=(rank, world)``: this rank scores only
    every ``world``-th window and the results are summed over the world group (a collective: every rank calls
    it with the same streams), so every rank returns all scores; ``progress(n)`` is called with the number of
    targets this rank scored after each batch."""
    arrays = [torch.as_tensor(np.asarray(s), dtype=torch.long) for s in streams]
    for a in arrays:  # on the host: a readable TokenIdError (on a GPU the model's own check cannot name the id)
        check_token_ids(a, vocab_size)
    plan = [w for i, a in enumerate(arrays) for w in windows(len(a), context, stride, i)]
    plan = plan[shard[0] :: shard[1]]
    out = [
        Scores(np.full(max(0, len(a) - 1), np.nan), np.zeros(max(0, len(a) - 1), bool), a[1:].numpy().copy())
        for a in arrays
    ]
    plan.sort(key=lambda w: w.end - w.start, reverse=True)  # similar lengths together: little padding
    for i in range(0, len(plan), batch_size):
        batch = plan[i : i + batch_size]
        width = max(w.end - w.start for w in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        for j, w in enumerate(batch):
            ids[j, : w.end - w.start] = arrays[w.stream][w.start : w.end]
        nll, hit = _score_batch(model, ids.to(device), batch, arrays, vocab_size)
        lo = 0
        for w in batch:
            sl = slice(w.end - w.new, w.end)  # target t is at index t - 1
            out[w.stream].loss[sl] = nll[lo : lo + w.new]
            out[w.stream].correct[sl] = hit[lo : lo + w.new]
            lo += w.new
        if progress is not None:
            progress(sum(w.new for w in batch))
    if shard[1] > 1:
        _sum_over_ranks(out)
    return out


def _score_batch(model, ids: torch.Tensor, batch: list[Window], arrays, vocab_size: int):
    """``(nll float64, hit bool)`` numpy arrays of the scored targets of ``batch`` (window order)."""
    b, s = ids.shape
    pos = torch.arange(s, device=ids.device)[None].expand(b, s)
    with torch.no_grad():
        head = model.head_input(ids, pos)  # hidden [s, b, D], weight [V_pad, D]
    rows, targets = [], []
    for j, w in enumerate(batch):
        length = w.end - w.start
        rows.append(head.hidden[length - w.new : length, j])
        targets.append(arrays[w.stream][w.end - w.new + 1 : w.end + 1])
    tgt = torch.cat(targets).to(ids.device)
    nll, hit = score_tokens(torch.cat(rows), head.weight[:vocab_size], tgt, head.chunk)
    return nll.double().cpu().numpy(), hit.cpu().numpy()


def _sum_over_ranks(out: list[Scores]) -> None:
    """Every target was scored by exactly one rank: a sum over ranks (NaN counted as 0) completes each array."""
    import torch.distributed as dist

    loss = torch.from_numpy(np.nan_to_num(np.concatenate([s.loss for s in out]), nan=0.0))
    hit = torch.from_numpy(np.concatenate([s.correct for s in out]).astype(np.float64))
    both = torch.stack([loss, hit])
    if dist.get_backend() == "nccl":
        both = both.cuda()
    dist.all_reduce(both)
    both = both.cpu()
    lo = 0
    for s in out:
        hi = lo + s.loss.size
        s.loss[:] = both[0, lo:hi].numpy()
        s.correct[:] = both[1, lo:hi].numpy() > 0.5
        lo = hi


def score_stream(model, stream, vocab_size: int, context: int, stride: int, **kw) -> Scores:
    """:func:`score_streams` of one stream."""
    return score_streams(model, [stream], vocab_size, context, stride, **kw)[0]
