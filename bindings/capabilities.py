"""What a target graph offers a drafter, and what a draft kind needs from it.

Both are frozen records. `bind` is a pure function of the two: every mismatch
(vocabulary, hidden size, missing tap layers, state that cannot roll back, an
invalid width) is refused before any forward runs, with a message naming it.
The round then uses only the binding.
"""

from __future__ import annotations

from typing import Literal

from attrs import field, frozen
from returns.result import Failure, Result, Success

from schemas.errors import BindingError
from schemas.hf import DecoderArgs
from schemas.hf_hybrid import HybridArgs

LayerKind = Literal["attention", "linear_recurrent"]
# position_overwrite: attention KV, rejected positions are simply overwritten;
# per_token_state: the verify window keeps a state per position, commit picks one;
# snapshot_replay: snapshot before the round, replay the accepted prefix;
# none: cannot be rolled back.
Rollback = Literal["position_overwrite", "per_token_state", "snapshot_replay", "none"]


@frozen
class LayerCapability:
    kind: LayerKind
    rollback: Rollback


@frozen
class NativeDraft:
    """A draft head the target's own checkpoint carries (e.g. MTP)."""

    kind: str
    width: int


@frozen(kw_only=True)
class GraphCapabilities:
    model_type: str
    vocab_size: int
    hidden_size: int
    layers: tuple[LayerCapability, ...]
    tap_layers: tuple[int, ...]
    quantized_head: bool = False
    native_draft: NativeDraft | None = None
    # kind -> measured best width on this graph
    adaptive_widths: tuple[tuple[str, int], ...] = ()

    @classmethod
    def for_decoder(
        cls, args: DecoderArgs, native_draft: NativeDraft | None = None
    ) -> GraphCapabilities:
        """Attention layers roll back by position; the recurrent layers of a
        hybrid graph commit the state of the accepted position."""
        n = args.num_hidden_layers
        recurrent = set(args.linear_layers) if isinstance(args, HybridArgs) else set()
        return cls(
            model_type=args.model_type,
            vocab_size=args.vocab_size,
            hidden_size=args.hidden_size,
            layers=tuple(
                LayerCapability("linear_recurrent", "per_token_state")
                if i in recurrent
                else LayerCapability("attention", "position_overwrite")
                for i in range(n)
            ),
            tap_layers=tuple(range(n)),
            quantized_head=args.quantization is not None,
            native_draft=native_draft,
        )


@frozen(kw_only=True)
class DraftNeeds:
    kind: str
    default_width: int
    max_width: int | None = None
    vocab_size: int | None = None  # the draft's own vocabulary (must fit the target's)
    hidden_size: int | None = (
        None  # set when the draft reads the target's hidden states
    )
    tap_layers: tuple[int, ...] = ()
    shares: frozenset[str] = field(factory=frozenset)  # "embedding", "lm_head"
    namespace: str = ""


@frozen
class Binding:
    target: GraphCapabilities
    draft: DraftNeeds
    width: int


def bind(
    target: GraphCapabilities, needs: DraftNeeds, width: int | None = None
) -> Result[Binding, BindingError]:
    problems: list[str] = []
    if needs.vocab_size is not None and needs.vocab_size > target.vocab_size:
        problems.append(
            f"the draft's vocabulary ({needs.vocab_size}) does not fit the target's "
            f"({target.vocab_size}); use a draft of the same model family"
        )
    if needs.hidden_size is not None and needs.hidden_size != target.hidden_size:
        problems.append(
            f"the draft reads hidden states of size {needs.hidden_size}, "
            f"the target's are {target.hidden_size}"
        )
    missing = sorted(set(needs.tap_layers) - set(target.tap_layers))
    if missing:
        problems.append(
            f"the draft taps layers {missing}, which the target does not expose"
        )
    stuck = [i for i, layer in enumerate(target.layers) if layer.rollback == "none"]
    if stuck:
        problems.append(f"target layers {stuck[:5]} cannot roll back rejected drafts")
    if width is not None and width <= 0:
        problems.append(f"num-draft-tokens must be >= 1, got {width}")
    if problems:
        return Failure(
            BindingError(f"cannot bind {needs.kind} draft: " + "; ".join(problems))
        )
    chosen = (
        width
        if width is not None
        else dict(target.adaptive_widths).get(needs.kind, needs.default_width)
    )
    if needs.max_width is not None:
        chosen = min(chosen, needs.max_width)
    return Success(Binding(target, needs, chosen))
