"""What every drafter's configuration shares: the target shape it is built for, validation
helpers and the config.json round trip. Each kind's own: vllm_moa/drafters/KIND/config.py."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from typing_extensions import Self

# Keys a Hugging Face style config.json may carry that are not config fields.
_HF_METADATA_KEYS = frozenset(
    {
        "architectures",
        "model_type",
        "torch_dtype",
        "dtype",
        "transformers_version",
        "vllm_moa_version",
        "training",  # facts of the drafter's training (save_drafter)
    }
)


@dataclass(frozen=True)
class TargetShape:
    """What a drafter needs to know about its target model."""

    num_layers: int  # L
    hidden_size: int  # E
    num_kv_heads: int  # n_kv
    head_dim: int  # d
    vocab_size: int
    # The target's RoPE scaling as model/rope.py's rope_scaling_of records it; None: plain RoPE.
    rope_scaling: dict[str, Any] | None = None

    @property
    def kv_width(self) -> int:
        """E_kv = n_kv * d, the width of one layer's K (or V) for one token."""
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class DrafterConfig:
    """The target shape a drafter is built for, plus the JSON round trip, validation helpers and
    target checks every drafter config shares.

    Subclasses are frozen dataclasses adding their own fields, and set MODEL_TYPE / ARCHITECTURE
    (the config.json `model_type` and `architectures[0]`).
    """

    MODEL_TYPE: ClassVar[str]
    ARCHITECTURE: ClassVar[str]
    target_num_layers: int
    target_hidden_size: int
    target_num_kv_heads: int
    target_head_dim: int
    vocab_size: int

    @staticmethod
    def target_fields(shape: TargetShape) -> dict[str, Any]:
        """The target-shape constructor arguments of any drafter config."""
        return {
            "target_num_layers": shape.num_layers,
            "target_hidden_size": shape.hidden_size,
            "target_num_kv_heads": shape.num_kv_heads,
            "target_head_dim": shape.head_dim,
            "vocab_size": shape.vocab_size,
        }

    def _check_numbers(self, allow_zero: tuple[str, ...] = ()) -> None:
        name = type(self).__name__
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (not isinstance(value, int) or isinstance(value, bool)):
                raise TypeError(f"{name}.{f.name} must be an int, got {value!r}")
            if f.type == "float" and not isinstance(value, (int, float)):
                raise TypeError(f"{name}.{f.name} must be a number, got {value!r}")
            if f.type in ("int", "float") and f.name not in allow_zero and value <= 0:
                raise ValueError(f"{name}.{f.name} must be > 0, got {value}")

    def _check_heads(self, prefix: str, width: int, heads: int, kv_heads: int) -> None:
        """prefix: the field prefix ("sa_" for sa_num_heads, "" for num_heads)."""
        cls = type(self).__name__
        what = prefix.rstrip("_").upper() or "hidden"
        if width % heads:
            raise ValueError(
                f"{cls}.{prefix}num_heads={heads} must divide the {what} width {width}"
            )
        if heads % kv_heads:
            raise ValueError(
                f"{cls}.{prefix}num_kv_heads={kv_heads} must divide {prefix}num_heads={heads}"
            )
        if (width // heads) % 2:
            raise ValueError(
                f"{cls}: {what} head size {width // heads} (= {width} / {heads} heads) "
                "must be even for rotary embeddings; choose another head count"
            )

    # How check_target names a RoPE-scaling mismatch: (what applies it, the config field, how to
    # make a drafter for the target). Kinds whose target_shape records a scaling set it.
    ROPE_SCALING_MESSAGE: ClassVar[tuple[str, str, str]] = (
        "attention",
        "rope_scaling",
        "`vllm-moa train --target ... --method ...`",
    )

    @property
    def target_shape(self) -> TargetShape:
        return TargetShape(
            num_layers=self.target_num_layers,
            hidden_size=self.target_hidden_size,
            num_kv_heads=self.target_num_kv_heads,
            head_dim=self.target_head_dim,
            vocab_size=self.vocab_size,
        )

    def check_target(self, target: TargetShape) -> None:
        """Raise if this drafter was built for a target of another shape."""
        mine = self.target_shape
        checks = [
            ("vocab size", mine.vocab_size, target.vocab_size),
            ("layer count", mine.num_layers, target.num_layers),
            ("KV width (num_kv_heads * head_dim)", mine.kv_width, target.kv_width),
            ("KV heads", mine.num_kv_heads, target.num_kv_heads),
            ("hidden size", mine.hidden_size, target.hidden_size),
        ]
        for what, drafter_value, target_value in checks:
            if drafter_value != target_value:
                raise ValueError(
                    f"drafter was built for a target with {what} {drafter_value}, but the target "
                    f"has {target_value}; use a drafter made for this target "
                    "(`vllm-moa init-drafter --target ...` or train one)"
                )
        # A drafter that records no RoPE scaling runs unscaled on any target, as it was trained
        # (drafters made before the field existed keep working); one that records a scaling
        # (its `target_shape`) must match the target's.
        if mine.rope_scaling is not None and mine.rope_scaling != target.rope_scaling:
            scaled, field, remake = self.ROPE_SCALING_MESSAGE
            raise ValueError(
                f"drafter's {scaled} applies RoPE scaling {mine.rope_scaling} ({field}), but the "
                f"target's is {target.rope_scaling}; use a drafter made for this target ({remake})"
            )

    def replace(self, **changes: Any) -> Self:
        return dataclasses.replace(self, **changes)

    # ---- JSON round trip (Hugging Face style config.json) ----
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"architectures": [self.ARCHITECTURE], "model_type": self.MODEL_TYPE}
        out.update(dataclasses.asdict(self))
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        model_type = data.get("model_type")
        if model_type != cls.MODEL_TYPE:
            raise ValueError(
                f"config model_type is {model_type!r}, expected {cls.MODEL_TYPE!r}: this is not a "
                "vllm-moa drafter config (for the authors' release use `vllm-moa convert-official`)"
            )
        fields = dataclasses.fields(cls)
        names = {f.name for f in fields}
        unknown = sorted(set(data) - names - _HF_METADATA_KEYS)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} keys {unknown}; known keys: {sorted(names)}")
        missing = sorted(
            f.name
            for f in fields
            if f.name not in data
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        )
        if missing:
            raise ValueError(f"{cls.__name__} config is missing required keys {missing}")
        return cls(**{k: v for k, v in data.items() if k in names})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Self:
        return cls.from_dict(read_config_json(path))


def read_config_json(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"no drafter config at {path}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data
