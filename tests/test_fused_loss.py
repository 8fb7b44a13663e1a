"""The fused, chunked linear + cross entropy (model/loss.py, model/head.py) against the unfused paths.

- In process, no torch.distributed: loss.py's three entry points against plain torch (``cross_entropy`` and
  ``log_softmax`` of the full logits), with chunks that do and do not divide the tokens.
- Two gloo ranks (tests/workers/fused_loss.py): whole models built from one seed with ``model.loss_impl=fused``
  and ``megatron`` (megatron-core's ``vocab_parallel_cross_entropy``) at TP = 1 and TP = 2, untied (LEV) and
  TIED heads, the training mean and per-token losses: loss, every parameter's gradient, the head weight's and the
  final hidden states' gradients. The same worker compares the fused SwiGLU (``model.activation_fusion``) with
  the unfused one at TP = 1 and TP = 2.
"""

import json

import pytest
import torch
import torch.nn.functional as F

from leviathan_pretrain.config import ConfigError, load_config
from leviathan_pretrain.model import loss as fused
from leviathan_pretrain.model import sizes
from tests.multiproc import run_ranks


def _problem(dtype=torch.float32, T=45, D=24, V=130, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, D, generator=g).to(dtype).requires_grad_()
    w = (0.3 * torch.randn(V, D, generator=g)).to(dtype).requires_grad_()
    y = torch.randint(0, V, (T,), generator=g)
    return h, w, y


def _rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.mark.parametrize("chunk", [1, 7, 45, 1000])
def test_mean_loss_matches_cross_entropy_and_its_gradients(chunk):
    h, w, y = _problem()
    mask = (torch.arange(45) % 4 != 0).float()
    ref = (F.cross_entropy(h @ w.t(), y, reduction="none") * mask).sum() / mask.sum()
    ref.backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    got = fused.mean_loss(h, w, y, mask / mask.sum(), chunk=chunk)
    (3.0 * got).backward()  # the incoming gradient scales the gradients formed in forward
    assert abs(float(got) - float(ref)) < 1e-6 * abs(float(ref))
    assert _rel(h.grad, 3.0 * gh) < 1e-5 and _rel(w.grad, 3.0 * gw) < 1e-5
    assert bool((h.grad[mask == 0] == 0).all())  # masked positions get no gradient


@pytest.mark.parametrize("chunk", [1, 8, 1000])
def test_token_loss_recompute_backward_matches_cross_entropy(chunk):
    h, w, y = _problem()
    g = torch.rand(45, generator=torch.Generator().manual_seed(3))
    ref = F.cross_entropy(h @ w.t(), y, reduction="none")
    (ref * g).sum().backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    got = fused.token_loss(h, w, y, chunk=chunk)
    assert got.shape == (45,) and got.dtype == torch.float32
    assert float((got - ref).abs().max()) < 1e-5
    (got * g).sum().backward()
    assert _rel(h.grad, gh) < 1e-5 and _rel(w.grad, gw) < 1e-5


def test_score_tokens_matches_log_softmax_and_argmax():
    h, w, y = _problem(T=60)
    h = h.detach().clone()
    h[5] = 0.0  # an all-tie row: argmax takes the first index, as torch's does
    logits = h @ w.detach().t()
    y[7] = int(logits[7].argmax())  # at least one hit
    y[5] = 0
    nll, hit = fused.score_tokens(h, w.detach(), y, chunk=11)
    ref = -torch.log_softmax(logits.float(), dim=-1).gather(1, y[:, None])[:, 0]
    assert float((nll - ref).abs().max()) < 1e-5
    assert torch.equal(hit, logits.argmax(dim=-1) == y) and bool(hit[7]) and bool(hit[5])


def test_mean_loss_without_grad_builds_no_gradients_and_gives_the_same_value():
    h, w, y = _problem()
    m = torch.full((45,), 1 / 45)
    with torch.no_grad():
        a = fused.mean_loss(h, w, y, m, chunk=7)
    assert not a.requires_grad
    b = fused.mean_loss(h.detach(), w.detach(), y, m, chunk=7)
    assert float(a) == float(b)
    assert abs(float(a) - float(F.cross_entropy(h @ w.t(), y))) < 1e-5


def test_bf16_logits_are_the_model_dtype_gemm_then_fp32():
    h, w, y = _problem(torch.bfloat16)
    got = fused.token_loss(h, w, y, chunk=9)
    ref = F.cross_entropy((h @ w.t()).float(), y, reduction="none")  # megatron: logits.float()
    assert float((got - ref).abs().max()) < 1e-5


def test_chunk_size_follows_the_per_device_budget():
    assert sizes.loss_chunk_tokens(200_064, "cuda") == 2 * 2**30 // (4 * 200_064) == 2683
    assert sizes.loss_chunk_tokens(200_064, "cpu") == 167
    assert sizes.loss_chunk_tokens(100_032, "gpu") == 5366  # the planner's device name
    assert sizes.loss_chunk_tokens(10**9, "cuda") == sizes.LOSS_CHUNK_MIN
    assert sizes.loss_chunk_tokens(200_064, "cuda", override=96) == 96


@pytest.mark.parametrize("n,chunk", [(8192, 2683), (8192, 670), (10, 3), (45, 45), (45, 1000), (7, 1), (1, 64)])
def test_chunks_are_as_few_as_the_limit_allows_and_balanced(n, chunk):
    spans = fused._spans(n, chunk)
    lengths = [hi - lo for lo, hi in spans]
    assert spans[0][0] == 0 and spans[-1][1] == n and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert len(spans) == -(-n // chunk) and max(lengths) <= chunk and max(lengths) - min(lengths) <= 1
    assert max(lengths) == sizes.balanced_chunk(n, chunk)  # what the planner counts
    if (n, chunk) == (8192, 2683):
        assert lengths == [2048] * 4  # the H200 check's measured chunk at 400M, V = 200,064


@pytest.mark.parametrize(
    "override,key",
    [("model.loss_impl=triton", "model.loss_impl"), ("model.loss_chunk_tokens=0", "model.loss_chunk_tokens")],
)
def test_bad_loss_settings_are_refused_at_load(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


@pytest.fixture(scope="module")
def model_results():
    res = run_ranks(["tests/workers/fused_loss.py", "fp32,bf16"], nprocs=2, timeout=300)
    out = [json.loads(x[len("RESULT ") :]) for r in res for x in r.output.splitlines() if x.startswith("RESULT ")]
    assert sorted(o["rank"] for o in out) == [0, 1]
    return out


CASES = [
    f"tp{tp}-{v}-{p}-{m}" for tp in (1, 2) for v in ("lev", "tied") for p in ("fp32", "bf16") for m in ("mean", "token")
]


@pytest.mark.multiproc
@pytest.mark.parametrize("case", ["swiglu-tp1-lev-fp32-mean", "swiglu-tp2-lev-fp32-mean"])
def test_fused_swiglu_model_loss_and_gradients_equal_unfused(model_results, case):
    """model.activation_fusion (on by default for CUDA) against the unfused SwiGLU, whole models from one seed,
    fp32, at TP = 1 and TP = 2 (each rank's fc1 shard split into gate and up by the fused kernel as by the
    unfused path): the loss and every parameter's and the final hidden states' gradients."""
    for per_rank in model_results:
        r = per_rank[case]
        assert r["loss_rel"] < 1e-5, r
        assert r["grad_rel"] < 1e-5 and r["head_rel"] < 1e-5 and r["hidden_rel"] < 1e-5, r
        assert r["scale"] > 1e-5 and r["n"] >= 15, r


@pytest.mark.multiproc
@pytest.mark.parametrize("case", CASES)
def test_fused_model_loss_and_gradients_equal_megatron(model_results, case):
    # fp32: measured <= 1.6e-6 (loss <= 1.4e-7). bf16: the head weight's gradient differs by 1-2 bf16 ulps of its
    # largest element (measured 0.4-0.9%: ours sums the chunks in fp32, megatron's is one bf16 GEMM output).
    tol = 1e-5 if "fp32" in case else 2e-2
    for per_rank in model_results:
        r = per_rank[case]
        assert r["loss_rel"] < (1e-5 if "fp32" in case else 1e-3), r
        assert r["grad_rel"] < tol and r["head_rel"] < tol and r["hidden_rel"] < tol, r
        assert r["scale"] > 1e-5 and r["n"] >= 15, r  # every parameter compared, none all zero
