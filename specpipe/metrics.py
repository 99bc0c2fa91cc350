"""Speculation metrics per request and across a run."""

from __future__ import annotations

from attrs import define, field


@define
class RowMetrics:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    generated: int = 0
    # per draft position i: how often a draft stood there / was accepted
    drafted_at: list[int] = field(factory=list)
    accepted_at: list[int] = field(factory=list)
    draft_errors: list[str] = field(factory=list)
    gated: int = 0  # rounds decoded plainly although a drafter was loaded

    def record(self, drafts: int, accepted: int, published: int) -> None:
        self.rounds += 1
        self.drafted += drafts
        self.accepted += accepted
        self.generated += published
        while len(self.drafted_at) < drafts:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(drafts):
            self.drafted_at[i] += 1
            if i < accepted:
                self.accepted_at[i] += 1

    @property
    def acceptance_length(self) -> float:
        """Tokens published per round (1.0 for plain decoding)."""
        return self.generated / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def per_position(self) -> list[float]:
        return [
            a / d if d else 0.0
            for a, d in zip(self.accepted_at, self.drafted_at, strict=True)
        ]


@define
class PhaseTimes:
    """Opt-in wall time per phase (ms), summed over rounds."""

    draft: float = 0.0
    verify: float = 0.0
    sample: float = 0.0
    commit: float = 0.0
