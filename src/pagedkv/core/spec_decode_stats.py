"""Speculative decoding counters (vLLM's ``spec_decode`` metrics, by the same names)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class SpecDecodeStats:
    """``num_drafts``: verification steps of a request with drafts; ``num_draft_tokens`` /
    ``num_accepted_tokens``: draft tokens verified / accepted; ``num_accepted_tokens_per_pos[i]``:
    drafts whose token ``i`` was accepted (so acceptance at position ``i`` is that over
    ``num_drafts`` reaching it)."""
    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_drafts_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        self.num_accepted_tokens_per_pos = self.num_accepted_tokens_per_pos or [0] * k
        self.num_drafts_per_pos = self.num_drafts_per_pos or [0] * k

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for i in range(drafted):
            self.num_drafts_per_pos[i] += 1
            self.num_accepted_tokens_per_pos[i] += int(i < accepted)

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens committed per verification step (accepted drafts + the one the target adds)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def to_dict(self) -> dict:
        per_pos = [a / n if n else None for a, n in zip(self.num_accepted_tokens_per_pos, self.num_drafts_per_pos)]
        return asdict(self) | {"acceptance_rate": self.acceptance_rate, "mean_acceptance_length":
                               self.mean_acceptance_length, "acceptance_rate_per_pos": per_pos}
