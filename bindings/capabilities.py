"""What a target graph offers a drafter, and what a draft kind needs from it.

Both are frozen records. `bind` is a pure function of the two: every mismatch
(vocabulary, hidden size, missing tap layers, state that cannot roll back, an
invalid width) is refused before any forward runs, with a message naming it.
The round then uses only the binding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from attrs import field, frozen
from returns.result import Failure, Result, Success

from schemas.errors import BindingError
from schemas.hf import DecoderArgs
from schemas.hf_gemma4 import is_gemma4
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


@frozen
class LentKV:
    """Keys and values a target lends a KV-borrowing draft: those its last
    non-shared layer of `layer_type` stores (`[B, kv_heads, C, head_dim]`)."""

    layer_type: str
    kv_heads: int
    head_dim: int


@frozen
class BorrowedKV:
    """Keys and values a KV-borrowing draft's layers of `layer_type` attend
    over with `query_heads` heads of `head_dim`."""

    layer_type: str
    query_heads: int
    head_dim: int


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
    lent_kv: tuple[LentKV, ...] = ()

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
            lent_kv=lent_kv(args),
        )


def lent_kv(args: DecoderArgs) -> tuple[LentKV, ...]:
    """The keys and values a Gemma-4 target's graph lends a KV-borrowing
    draft: per layer type, its last non-shared layer's (none for others,
    Gemma-3 on the same decoder among them)."""
    if not is_gemma4(args):
        return ()
    return tuple(
        LentKV(kind, args.kv_heads_of(kind), args.head_dim_of(kind))
        for kind in sorted(set(args.layer_types))
        if args.producer(kind) is not None
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
    borrows_kv: tuple[BorrowedKV, ...] = ()  # a KV-borrowing draft's reads


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
    problems.extend(_borrowing_problems(target.lent_kv, needs.borrows_kv))
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


def _borrowing_problems(
    lent: Sequence[LentKV], borrowed: Sequence[BorrowedKV]
) -> list[str]:
    """What keeps a KV-borrowing draft's layers from attending over the
    target's stored keys and values."""
    offered = {kv.layer_type: kv for kv in lent}
    problems = []
    for want in borrowed:
        kv = offered.get(want.layer_type)
        if kv is None:
            kinds = ", ".join(sorted(offered)) or "none"
            problems.append(
                f"the draft reads the target's {want.layer_type} keys/values, which "
                f"the target does not lend (it lends: {kinds}); an assistant draft "
                "needs the Gemma-4 target it was trained with"
            )
        elif want.head_dim != kv.head_dim:
            problems.append(
                f"the draft's {want.layer_type} heads have {want.head_dim} dims, the "
                f"target's stored keys {kv.head_dim}"
            )
        elif want.query_heads % kv.kv_heads:
            problems.append(
                f"the draft's {want.query_heads} {want.layer_type} query heads do not "
                f"group over the target's {kv.kv_heads} key/value heads"
            )
    return problems
