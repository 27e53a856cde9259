"""Per-generation statistics of speculative decoding."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LevelStats:
    """One drafter level of a hierarchy (hsd/hierarchy.py), over one generation."""

    name: str  # `ngram`, or the drafter's kind and directory
    buffer: int  # T: the tokens it gathers before handing them up
    requests: int = 0  # blocks the level above asked it for
    requested: int = 0  # tokens asked of the bottom level (it may draft fewer: prompt lookup)
    forward_passes: int = 0  # of its model: draft steps (bottom) or scoring passes (above it)
    proposed: int = 0  # tokens it handed to the level above
    accepted: int = 0  # of those, accepted by the level above
    rejections: int = 0  # verifications of its tokens that rejected one (the rest accepted all)
    time_s: float = 0.0  # in its own calls (drafting or scoring), lower levels excluded

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed (tokens after a rejection count as not accepted)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def alpha(self) -> float:
        """Per-token acceptance under the IID model (the planner's alpha): the accepted over the
        tokens actually tested, each verification testing tokens up to its first rejection."""
        tested = self.accepted + self.rejections
        return self.accepted / tested if tested else 0.0

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "buffer": self.buffer,
            "requests": self.requests,
            "requested": self.requested,
            "forward_passes": self.forward_passes,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "rejections": self.rejections,
            "acceptance_rate": self.acceptance_rate,
            "alpha": self.alpha,
            "time_s": self.time_s,
        }


@dataclass
class GenerationStats:
    num_speculative_tokens: int  # K (0 = plain decoding)
    num_generated_tokens: int = 0
    num_target_calls: int = 0  # prefill included
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    wall_time_s: float = 0.0
    # accepted_length_histogram[a] = cycles that accepted a drafts (a = 0..K)
    accepted_length_histogram: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)  # [K]
    accepted_per_position: list[int] = field(default_factory=list)  # [K]
    # draft_length_histogram[k] = cycles that drafted k tokens (adaptive speculation's choices)
    draft_length_histogram: list[int] = field(default_factory=list)
    # A hierarchy's drafter levels, bottom first (empty for one drafter or none)
    levels: list[LevelStats] = field(default_factory=list)

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        self.accepted_length_histogram = self.accepted_length_histogram or [0] * (k + 1)
        self.draft_length_histogram = self.draft_length_histogram or [0] * (k + 1)
        self.drafted_per_position = self.drafted_per_position or [0] * k
        self.accepted_per_position = self.accepted_per_position or [0] * k

    def record_cycle(self, num_drafted: int, num_accepted: int) -> None:
        """One verification pass of `num_drafted` drafts that accepted `num_accepted`."""
        self.num_target_calls += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        self.accepted_length_histogram[num_accepted] += 1
        self.draft_length_histogram[num_drafted] += 1
        for i in range(num_drafted):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += int(i < num_accepted)

    @property
    def num_cycles(self) -> int:
        return sum(self.accepted_length_histogram)

    @property
    def mean_accepted_length(self) -> float:
        """tau: tokens emitted per decoding target call (accepted drafts + 1), prefill excluded."""
        if not self.num_cycles:
            return 1.0
        return 1.0 + self.num_accepted_tokens / self.num_cycles

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        return [
            a / d if d else 0.0
            for a, d in zip(self.accepted_per_position, self.drafted_per_position, strict=True)
        ]

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    @property
    def target_calls_per_token(self) -> float:
        return self.num_target_calls / max(1, self.num_generated_tokens)

    def to_dict(self) -> dict[str, object]:
        out = self._target_dict()
        if self.levels:
            out["levels"] = [level.to_dict() for level in self.levels]
        return out

    def _target_dict(self) -> dict[str, object]:
        return {
            "num_speculative_tokens": self.num_speculative_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "target_calls": self.num_target_calls,
            "target_calls_per_token": self.target_calls_per_token,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "mean_accepted_length": self.mean_accepted_length,
            "accepted_length_histogram": list(self.accepted_length_histogram),
            "draft_length_histogram": list(self.draft_length_histogram),
            "acceptance_rate_per_position": self.acceptance_rate_per_position,
            "wall_time_s": self.wall_time_s,
            "tokens_per_second": self.tokens_per_second,
        }
