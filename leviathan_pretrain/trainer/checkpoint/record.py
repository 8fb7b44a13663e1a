"""The checkpoint record ``<ckpt dir>/global_step<N>/leviathan.json``: :class:`CheckpointRecord`, its fields,
their defaults and its JSON, in one place. Torch-free, like :mod:`.names`: the trainer writes it
(:func:`.checkpoint.save`, written last, it marks the checkpoint complete), and the trainer's resume checks,
evaluation, export, ``compare`` and the launchers' status read it through :meth:`CheckpointRecord.read`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from leviathan_pretrain.trainer.checkpoint.names import META, CheckpointError

FIRST_MODEL_LAYOUT = 1  # records written before ``model_layout`` existed hold the first state-dict layout
# The keys every trainer version wrote into leviathan.json (git log --follow -p of trainer/loop.py and
# trainer/checkpoint/store.py), and the ones added since, in the order they came: a record the trainer wrote has the
# first and a prefix of the second.
ALWAYS_WRITTEN = ("config", "tokenizer_sha256", "layout", "step", "consumed_samples", "skipped_steps", "tag")
ADDED = ("model_layout", "tokenizer_fingerprint")


def incomplete(data: dict) -> str | None:
    """Why ``data`` is no record a trainer wrote (keys every version wrote missing; a key without one added before
    it), or None. Such a record's defaults (``model_layout`` 1, ...) would be guesses."""
    missing = [k for k in ALWAYS_WRITTEN if k not in data]
    if missing:
        return f"no {', '.join(map(repr, missing))} (every version of the trainer wrote them)"
    for i, key in enumerate(ADDED):
        absent = [k for k in ADDED[:i] if k not in data]
        if key in data and absent:
            return f"{key!r} without {', '.join(map(repr, absent))} (the trainer wrote {key!r} only after them)"
    return None


def _files(raw: dict | None, where) -> dict[str, int] | None:
    if raw is None:
        return None
    bad = [k for k, v in raw.items() if not isinstance(v, int) or isinstance(v, bool) or v < 0]
    if bad:
        raise CheckpointError(f"{where}: 'files.{bad[0]}' is {raw[bad[0]]!r}, not a size in bytes")
    return dict(raw)


@dataclass(frozen=True)
class ParallelLayout:
    """How the checkpoint's files are split: tensor, pipeline and data parallel sizes and the ZeRO stage."""

    tp: int = 1
    pp: int = 1
    dp: int | None = None
    zero_stage: int | None = None

    def to_json(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "zero_stage": self.zero_stage}


@dataclass
class CheckpointRecord:
    """What ``leviathan.json`` holds: the run's config (as :func:`~leviathan_pretrain.config.loader.to_dict` wrote
    it), the tokenizer's checksums, the state-dict and parallel layouts, and the :class:`~.state.TrainState`
    fields (``step``, ``consumed_samples``, ``skipped_steps``)."""

    config: dict
    step: int
    consumed_samples: int
    skipped_steps: int = 0
    tag: str | None = None
    tokenizer_sha256: str | None = None
    tokenizer_fingerprint: str | None = None
    model_layout: int = FIRST_MODEL_LAYOUT
    layout: ParallelLayout = field(default_factory=ParallelLayout)
    # every file of the checkpoint folder (relative name -> size in bytes), listed by rank 0 once every rank has
    # written and flushed its files: a resume checks them before loading (None: a record from before the list)
    files: dict[str, int] | None = None

    @property
    def tokenizer_fp(self) -> str | None:
        """The tokenizer fingerprint recorded (older records: the file sha256, a SentencePiece model's
        fingerprint)."""
        return self.tokenizer_fingerprint or self.tokenizer_sha256

    def state_fields(self) -> dict:
        return {"step": self.step, "consumed_samples": self.consumed_samples, "skipped_steps": self.skipped_steps}

    def to_json(self) -> dict:
        """The JSON object, keys in the order the trainer has always written them."""
        return {
            "config": self.config,
            "tokenizer_sha256": self.tokenizer_sha256,
            "tokenizer_fingerprint": self.tokenizer_fingerprint,
            "model_layout": self.model_layout,
            "layout": self.layout.to_json(),
            **self.state_fields(),
            "tag": self.tag,
            **({"files": self.files} if self.files is not None else {}),
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    @classmethod
    def from_json(cls, data: object, where: Path | str, complete: bool = False) -> CheckpointRecord:
        """Validate a parsed ``leviathan.json``; a wrong or missing field raises :class:`CheckpointError` naming
        ``where`` and the key. ``complete`` (:meth:`read`: a resume, an evaluation): also a record no trainer
        wrote (:func:`incomplete`), instead of filling in defaults."""
        if not isinstance(data, dict):
            raise CheckpointError(f"{where}: not a checkpoint record (a JSON object was expected)")
        why = incomplete(data) if complete else None
        if why:
            raise CheckpointError(
                f"{where}: an incomplete or hand-edited record: {why}; restore the file, or resume from an older "
                "complete checkpoint"
            )

        def get(key: str, kind: type | tuple, default=None, required: bool = False):
            if key not in data or data[key] is None:
                if required:
                    raise CheckpointError(f"{where}: no {key!r} recorded")
                return default
            v = data[key]
            if not isinstance(v, kind) or isinstance(v, bool):
                raise CheckpointError(f"{where}: {key!r} is {v!r}, not a {getattr(kind, '__name__', kind)}")
            return v

        raw_layout = get("layout", dict, {})
        layout = {}
        for k in ("tp", "pp", "dp", "zero_stage"):
            v = raw_layout.get(k)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                raise CheckpointError(f"{where}: 'layout.{k}' is {v!r}, not an int")
            if v is not None:
                layout[k] = v
        return cls(
            config=get("config", dict, required=True),
            step=get("step", int, required=True),
            consumed_samples=get("consumed_samples", int, required=True),
            skipped_steps=get("skipped_steps", int, 0),
            tag=get("tag", str),
            tokenizer_sha256=get("tokenizer_sha256", str),
            tokenizer_fingerprint=get("tokenizer_fingerprint", str),
            model_layout=get("model_layout", int, FIRST_MODEL_LAYOUT),
            layout=ParallelLayout(**layout),
            files=_files(get("files", dict), where),
        )

    @classmethod
    def read(cls, path: Path | str) -> CheckpointRecord:
        """``path``: a ``leviathan.json`` file or the checkpoint folder holding one; a record no trainer wrote
        (:func:`incomplete`) is refused."""
        path = Path(path)
        if path.name != META:
            path = path / META
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: unreadable ({e})") from None
        return cls.from_json(data, path, complete=True)
