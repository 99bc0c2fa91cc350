"""Draft policy: how a drafter samples its proposals.

Verification is exact token match and the target samples its own token with
the step key of each position, independent of the draft, so no policy can
change the output; it changes only how often drafts are accepted and what
they cost. The default draws each draft with the request's own sampler and the
step key of the position it predicts (a coupled draw). Every option is off by
default: `greedy` drafts argmax (drops the coupling at temperature > 0),
`temperature` samples the draft at its own temperature, `drop_filters` drops
top-k / top-p / min-p from the draft (cheaper, rarely different at low
temperature). The draft never applies a repetition penalty (it would need the
token history on the device for every draft step).
"""

from __future__ import annotations

from attrs import evolve, frozen

from schemas.request import SamplingParams


@frozen
class DraftPolicy:
    greedy: bool = False
    temperature: float | None = None
    drop_filters: bool = False

    def draft_params(self, params: SamplingParams) -> SamplingParams:
        out = evolve(params, repetition_penalty=1.0)
        if self.greedy:
            return evolve(out, temperature=0.0)
        if self.temperature is not None:
            out = evolve(out, temperature=self.temperature)
        if self.drop_filters:
            out = evolve(out, top_p=1.0, top_k=0, min_p=0.0)
        return out
