"""A trained run as an lm-evaluation-harness model, registered as ``leviathan``.

  python -m leviathan_pretrain.lm_eval --model leviathan --model_args run=RUN[,step=N,device=cuda] --tasks hellaswag

lm-eval 0.4.13 finds models only in its own registry (``lm_eval.api.registry.model_registry``, filled by
``lm_eval.models`` and by ``@register_model`` at import); it reads no entry points, so the stock ``lm_eval`` CLI
cannot see this one: :mod:`leviathan_pretrain.lm_eval` imports this module and then runs lm-eval's own CLI.

Tokens: the training data is SentencePiece ids without BOS and with EOS after every document, so every request
is conditioned on EOS (the document separator, the model's "start of text"). :func:`encode_pair` splits a
``(context, continuation)`` request the way lm-eval's causal models do (trailing context whitespace moves to the
continuation; the full text is encoded and the continuation's tokens are the tail after the context's tokens), with
one fix: where a piece spans the boundary (the full text's tokens do not start with the context's), the
continuation is encoded on its own, so the scored tokens are exactly the continuation's text (not with a
dummy-prefix tokenizer: that would add a space, so there lm-eval's tail is kept). Inputs are cut from the left to
the model's ``seq_length`` keeping the whole continuation; longer continuations are scored in disjoint windows.
``loglikelihood_rolling`` is :func:`~.scoring.score_streams` over ``[EOS] + tokens`` with windows of
``seq_length``, each token scored once (lm-eval's rolling windows); ``generate_until`` is greedy, the model seeing
the last ``seq_length`` tokens of prompt and output at each step, stopping at EOS, a stop string or
``max_gen_toks``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import threading

import lm_eval.models  # noqa: F401  lm-eval's own models first: get_model imports them only into an empty registry
import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import simple_parse_args_string
from tqdm import tqdm

from common.dtypes import ALIASES as _DT_ALIASES
from common.dtypes import DTYPES as _DT
from common.dtypes import torch_dtype
from leviathan_pretrain.evaluation.load import EvalError, eval_world, load_trained
from leviathan_pretrain.evaluation.scoring import logits_for, score_streams

log = logging.getLogger(__name__)

# lm-eval's names (``auto``: what it passes by default, fp32 here) and ours (common/dtypes.py)
DTYPES = {"auto": torch.float32} | {n: torch_dtype(n) for n in (*_DT, *_DT_ALIASES)}
DEFAULT_BATCH = 8


# ---------------------------------------------------------------- the process's evaluation world


class _World:
    """:func:`eval_world` shared by every adapter of the process: entered by the first, left when the last one
    closes (or at exit), entered again if something else tore it down in between."""

    lock = threading.Lock()
    stack: contextlib.ExitStack | None = None
    users = 0
    at_exit = False

    @classmethod
    def acquire(cls) -> None:
        from megatron.core import parallel_state as ps

        with cls.lock:
            alive = torch.distributed.is_initialized() and ps.model_parallel_is_initialized()
            if cls.stack is None or not alive:
                if int(os.environ.get("WORLD_SIZE", "1")) > 1:
                    raise EvalError("the leviathan lm-eval model runs in one process (WORLD_SIZE > 1 is set)")
                cls._leave()
                stack = contextlib.ExitStack()
                stack.enter_context(eval_world("cpu"))  # the groups are gloo's; the model's device is ours
                cls.stack = stack
                if not cls.at_exit:
                    cls.at_exit = True
                    atexit.register(cls.close)  # a live gloo group can abort the interpreter at exit
            cls.users += 1

    @classmethod
    def _leave(cls) -> None:
        stack, cls.stack = cls.stack, None
        if stack is not None:
            with contextlib.suppress(Exception):  # torn down by someone else already
                stack.close()

    @classmethod
    def release(cls) -> None:
        with cls.lock:
            cls.users = max(0, cls.users - 1)
            if cls.users == 0:
                cls._leave()

    @classmethod
    def close(cls) -> None:
        with cls.lock:
            cls.users = 0
            cls._leave()


# ---------------------------------------------------------------- tokenization


def encode_pair(tok, context: str, continuation: str, eos: int) -> tuple[list[int], list[int]]:
    """``([EOS] + context tokens, continuation tokens)`` of one request (see the module doc)."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    if not context:
        return [eos], tok.encode_one(continuation)
    ctx, whole = tok.encode_one(context), tok.encode_one(context + continuation)
    if whole[: len(ctx)] == ctx or tok.adds_prefix_space():
        return [eos, *ctx], whole[len(ctx) :]
    return [eos, *ctx], tok.encode_one(continuation)


def _batch_size(value) -> int:
    if value is None:
        return DEFAULT_BATCH
    if isinstance(value, str) and value.startswith("auto"):
        log.info("leviathan: batch_size=%s is not tuned automatically; using %d", value, DEFAULT_BATCH)
        return DEFAULT_BATCH
    size = int(value)
    if size < 1:
        raise ValueError(f"leviathan: batch_size must be >= 1, got {value}")
    return size


# ---------------------------------------------------------------- the model


@register_model("leviathan")
class LeviathanLM(LM):
    """lm-eval model of a Leviathan run: ``run`` (the run directory, or a checkpoint directory), ``step`` (default:
    ``latest``), ``checkpoint_dir``, ``tokenizer`` (default: the run's, checksum-checked), ``device``
    (cpu | cuda | cuda:N | auto), ``dtype`` (float32 | bfloat16 | float16), ``batch_size``, ``max_length`` (at most
    the run's ``seq_length``, its default) and ``max_gen_toks`` (default 256)."""

    def __init__(
        self,
        run: str,
        step: int | None = None,
        checkpoint_dir: str | None = None,
        tokenizer: str | None = None,
        device: str | None = None,
        dtype: str = "float32",
        batch_size: int | str | None = None,
        max_batch_size: int | None = None,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        trust_remote_code: bool = False,  # lm-eval passes it with --trust_remote_code; nothing remote here
    ):
        super().__init__()
        from leviathan_pretrain.model.settings import resolve_device

        if str(dtype) not in DTYPES:
            raise ValueError(f"leviathan: dtype must be one of {', '.join(DTYPES)}, got {dtype}")
        self._device = resolve_device(str(device or "auto"))
        self._batch = _batch_size(batch_size)
        if max_batch_size:
            self._batch = min(self._batch, int(max_batch_size))
        self._closed = False
        _World.acquire()
        try:
            self.trained = load_trained(
                run,
                step=None if step in (None, "") else int(step),
                checkpoint_dir=checkpoint_dir or None,
                tokenizer=tokenizer or None,
                device=self._device,
                dtype=DTYPES[str(dtype)],
            )
        except BaseException:
            _World.release()
            raise
        t = self.trained
        if t.tokenizer is None:
            self.close()
            raise EvalError(f"{run}: the run's tokenizer ({t.cfg.data.tokenizer}) is not there; pass tokenizer=PATH")
        self.tok = t.tokenizer
        self.vocab_size = t.vocab_size
        self.eos = self.tok.eod_id
        if self.tok.vocab_size > self.vocab_size:
            self.close()
            raise EvalError(f"{self.tok.path}: {self.tok.vocab_size} ids, more than the model's {self.vocab_size}")
        seq = int(t.cfg.model.seq_length)
        self._max_length = int(max_length or seq)
        if not 1 <= self._max_length <= seq:
            self.close()
            raise ValueError(f"leviathan: max_length must be in 1..{seq} (the run's seq_length), got {max_length}")
        self._max_gen_toks = int(max_gen_toks)
        log.info("leviathan: %s %s (%s) on %s", t.ckpt_dir, t.tag, t.variant, self._device)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> LeviathanLM:
        """``model_args`` win over the harness's own ``batch_size`` / ``device`` (the CLI always sends its defaults,
        ``1`` and ``cuda:0``); a harness ``cuda`` device without CUDA means the CPU."""
        args = dict(arg_dict)
        for key, value in (additional_config or {}).items():
            if value is None or key in args:
                continue
            if key == "device" and str(value).startswith("cuda") and not torch.cuda.is_available():
                log.info("leviathan: device %s is not available; using the CPU", value)
                continue
            args[key] = value
        return cls(**args)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> LeviathanLM:
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    def close(self) -> None:
        """Drop the model and release the shared evaluation world (the last adapter to close leaves it)."""
        if not self._closed:
            self._closed = True
            self.trained = None
            _World.release()

    # ------------------------------------------------------------ what lm-eval reads

    @property
    def eot_token_id(self) -> int:
        return self.eos

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch

    @property
    def tokenizer_name(self) -> str:
        return str(self.trained.tokenizer.path)

    def get_model_info(self) -> dict:
        t = self.trained
        return {
            "leviathan_run": str(t.run_dir),
            "leviathan_checkpoint": str(t.ckpt_dir / t.tag),
            "leviathan_step": t.step,
            "model_variant": t.variant,
            "model_dtype": str(next(t.model.parameters()).dtype),
            "model_num_parameters": sum(p.numel() for p in t.model.parameters()),
            "max_length": self._max_length,
        }

    def tok_encode(self, text: str) -> list[int]:
        return self.tok.encode_one(text)

    def tok_decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids))

    def _logits(self, rows: list[list[int]]) -> torch.Tensor:
        """fp32 logits ``[b, width, V]`` (CPU) of right-padded ``rows`` (the model is causal: padding never reaches
        a real position)."""
        ids = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
        for j, r in enumerate(rows):
            ids[j, : len(r)] = torch.tensor(r, dtype=torch.long)
        return logits_for(self.trained.model, ids.to(self._device), self.vocab_size).cpu()

    # ------------------------------------------------------------ loglikelihood

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [encode_pair(self.tok, *req.args[:2], self.eos) for req in requests]
        out = self._loglikelihood_tokens(pairs, disable_tqdm)
        for req, res in zip(requests, out, strict=True):
            self.cache_hook.add_partial("loglikelihood", req.args[:2], res)
        return out

    def _loglikelihood_tokens(self, pairs, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(sum of log-probabilities, all greedy) of each continuation given its context."""
        L = self._max_length
        out: list[tuple[float, bool] | None] = [None] * len(pairs)
        short = []
        for i, (ctx, cont) in enumerate(pairs):
            if not cont:
                out[i] = (0.0, True)
            elif len(cont) > L:  # no window holds the whole continuation: slide over it
                s = score_streams(self.trained.model, [ctx + cont], self.vocab_size, L, L, self._batch, self._device)
                out[i] = (float(-s[0].loss[-len(cont) :].sum()), bool(s[0].correct[-len(cont) :].all()))
            else:
                short.append(i)
        short.sort(key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))  # similar lengths together
        batches = [short[k : k + self._batch] for k in range(0, len(short), self._batch)]
        for batch in tqdm(batches, desc="leviathan loglikelihood", disable=disable_tqdm or not batches):
            rows = [(pairs[i][0] + pairs[i][1])[-(L + 1) : -1] for i in batch]
            logits = self._logits(rows)
            for j, i in enumerate(batch):
                cont, n = pairs[i][1], len(rows[j])
                logp = torch.log_softmax(logits[j, n - len(cont) : n], dim=-1)
                target = torch.tensor(cont, dtype=torch.long)
                ll = logp.gather(1, target[:, None])[:, 0].double().sum()
                out[i] = (float(ll), bool((logp.argmax(dim=-1) == target).all()))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-probability of each whole text given EOS, every token scored once with windows of ``max_length``."""
        streams = [[self.eos, *self.tok.encode_one(req.args[0])] for req in requests]
        bar = tqdm(total=sum(len(s) - 1 for s in streams), desc="leviathan rolling", disable=disable_tqdm)
        scores = score_streams(
            self.trained.model,
            streams,
            self.vocab_size,
            self._max_length,
            self._max_length,
            batch_size=self._batch,
            device=self._device,
            progress=bar.update,
        )
        bar.close()
        out = [float(-s.loss.sum()) for s in scores]
        for req, res in zip(requests, out, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args[:1], res)
        return out

    # ------------------------------------------------------------ generation

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        bar = tqdm(total=len(requests), desc="leviathan generate_until", disable=disable_tqdm)
        for members in groups.values():
            kwargs = normalize_gen_kwargs(dict(requests[members[0]].args[1]), self._max_gen_toks)
            if kwargs.get("do_sample"):
                raise ValueError(f"leviathan: only greedy decoding is implemented (got {requests[members[0]].args[1]})")
            until = [s for s in kwargs["until"] if s]
            prompts = {i: [self.eos, *self.tok.encode_one(requests[i].args[0])] for i in members}
            members.sort(key=lambda i: -len(prompts[i]))
            for k in range(0, len(members), self._batch):
                batch = members[k : k + self._batch]
                texts = self._greedy([prompts[i] for i in batch], until, kwargs["max_gen_toks"])
                for i, text in zip(batch, texts, strict=True):
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args[:2], text)
                bar.update(len(batch))
        bar.close()
        return out

    def _greedy(self, prompts: list[list[int]], until: list[str], max_new: int) -> list[str]:
        """Greedy continuations of ``prompts`` (batched; a row leaves the batch when it is done)."""
        gen: list[list[int]] = [[] for _ in prompts]
        active = list(range(len(prompts)))
        L = self._max_length
        for _ in range(max_new):
            if not active:
                break
            rows = [(prompts[i] + gen[i])[-L:] for i in active]
            logits = self._logits(rows)
            still = []
            for j, i in enumerate(active):
                token = int(logits[j, len(rows[j]) - 1].argmax())
                if token == self.eos:
                    continue
                gen[i].append(token)
                if not any(s in self.tok_decode(gen[i]) for s in until):
                    still.append(i)
            active = still
        return [postprocess_generated_text(self.tok_decode(g), until, None) for g in gen]
