"""The checkpoint record ``<ckpt dir>/global_step<N>/leviathan.json``: :class:`CheckpointRecord`, its fields,
their defaults and its JSON, in one place. Torch-free, like :mod:`.ckpt_names`: the trainer writes it
(:func:`.checkpoint.save`, written last, it marks the checkpoint complete), and the trainer's resume checks,
evaluation, export, ``compare`` and the launchers' status read it through :meth:`CheckpointRecord.read`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from leviathan_pretrain.trainer.ckpt_names import META, CheckpointError

FIRST_MODEL_LAYOUT = 1  # records written before ``model_layout`` existed hold the first state-dict layout


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
    """What ``leviathan.json`` holds: the run's config (as :func:`~leviathan_pretrain.configlib.to_dict` wrote
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
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    @classmethod
    def from_json(cls, data: object, where: Path | str) -> CheckpointRecord:
        """Validate a parsed ``leviathan.json``; a wrong or missing field raises :class:`CheckpointError` naming
        ``where`` and the key."""
        if not isinstance(data, dict):
            raise CheckpointError(f"{where}: not a checkpoint record (a JSON object was expected)")

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
        )

    @classmethod
    def read(cls, path: Path | str) -> CheckpointRecord:
        """``path``: a ``leviathan.json`` file or the checkpoint folder holding one."""
        path = Path(path)
        if path.name != META:
            path = path / META
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: unreadable ({e})") from None
        return cls.from_json(data, path)
