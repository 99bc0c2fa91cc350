"""The library's draft kinds and the default registry.

`ngram` is model-free and chosen by name. `two-model` is the catch-all for an
artifact no other kind recognises: a full second model, which must tokenize
exactly as the target does (exact-match acceptance is meaningless otherwise).
"""

from __future__ import annotations

from returns.result import Failure, Result, Success

from bindings.capabilities import DraftNeeds, GraphCapabilities, bind
from bindings.registry import DraftKind, DraftLoadRequest, DraftRegistry, LoadedDraft
from schemas.errors import BindingError

PROBE = "The 3 quick brown foxes jumped över the lazy dog?! 🦊 def f(x):\n\treturn x"


def _load_ngram(request: DraftLoadRequest) -> Result[LoadedDraft, BindingError]:
    from specpipe.drafts.ngram import NgramDrafter

    min_n = request.ngram_min if request.ngram_min is not None else 2
    max_n = request.ngram_max if request.ngram_max is not None else 4
    if not (1 <= min_n <= max_n):
        return Failure(
            BindingError(
                f"ngram sizes need 1 <= min <= max, got min={min_n} max={max_n}"
            )
        )
    graph = GraphCapabilities.for_decoder(request.target.args)
    needs = DraftNeeds(kind="ngram", default_width=10)
    return bind(graph, needs, request.width).map(
        lambda b: LoadedDraft(NgramDrafter(min_n, max_n), b.width, "ngram")
    )


def _load_two_model(request: DraftLoadRequest) -> Result[LoadedDraft, BindingError]:
    from specpipe.draft_vocab import configured
    from specpipe.drafts.two_model import TwoModelDrafter
    from specpipe.load import load

    assert request.source is not None
    target = request.target
    loaded = load(request.source)
    if not isinstance(loaded, Success):
        return Failure(BindingError(f"draft model: {loaded.failure().message}"))
    draft = loaded.unwrap()
    if target.tokenizer.encode(PROBE) != draft.tokenizer.encode(PROBE):
        return Failure(
            BindingError(
                "the draft model's tokenizer differs from the target's (a probe string "
                "encodes differently); speculation needs the same tokenizer family"
            )
        )
    if not draft.model.padding_safe:
        return Failure(
            BindingError(
                "a two-model draft must be an attention-only model (recurrent drafts are not supported)"
            )
        )
    vocab = configured(
        request.draft_vocab,
        min(target.args.vocab_size, draft.args.vocab_size),
        draft.folder,
    )
    if not isinstance(vocab, Success):
        return Failure(BindingError(f"draft vocabulary: {vocab.failure().message}"))
    graph = GraphCapabilities.for_decoder(target.args)
    needs = DraftNeeds(
        kind="two-model", default_width=3, vocab_size=draft.args.vocab_size
    )
    drafter = TwoModelDrafter(draft.model, request.policy, vocab.unwrap())
    return bind(graph, needs, request.width).map(
        lambda b: LoadedDraft(drafter, b.width, "two-model", draft.model, draft.source)
    )


NGRAM = DraftKind(kind="ngram", artifact=False, default_width=10, load=_load_ngram)
TWO_MODEL = DraftKind(
    kind="two-model",
    artifact=True,
    default_width=3,
    load=_load_two_model,
    detect=lambda artifact: True,
    fallback=True,
)


def default_registry() -> DraftRegistry:
    return DraftRegistry().register(TWO_MODEL).register(NGRAM)
