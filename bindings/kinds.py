"""The library's draft kinds and the default registry.

`ngram` is model-free and chosen by name. `two-model` is the catch-all for an
artifact no other kind recognises: a full second model, which must tokenize
exactly as the target does (exact-match acceptance is meaningless otherwise).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from returns.result import Failure, Result, Success

from bindings.capabilities import DraftNeeds, GraphCapabilities, bind
from bindings.registry import (
    DraftArtifact,
    DraftKind,
    DraftLoadRequest,
    DraftRegistry,
    LoadedDraft,
    NativeDraftKind,
)
from schemas.errors import BindingError, succeeded

if TYPE_CHECKING:
    from models.mtp import DeclaredQuantization

PROBE = "The 3 quick brown foxes jumped över the lazy dog?! 🦊 def f(x):\n\treturn x"


def _load_ngram(request: DraftLoadRequest) -> Result[LoadedDraft, BindingError]:
    from specpipe.drafts.ngram import NgramDrafter

    if request.draft_vocab not in (None, "off"):
        return Failure(
            BindingError(
                "a draft vocabulary (--draft-vocab) narrows a draft's projection onto "
                "the target's vocabulary (mtp, or a draft model sharing it); prompt "
                "lookup (ngram) has none: drop the option or choose such a draft"
            )
        )
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
    from specpipe.load import gguf_ref, load

    assert request.source is not None
    target = request.target
    keep = request.gguf_quantized is not False and gguf_ref(request.source)
    loaded = load(request.source, request.dtype, gguf_quantized=keep)
    if not succeeded(loaded):
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
    if not succeeded(vocab):
        return Failure(BindingError(f"draft vocabulary: {vocab.failure().message}"))
    graph = GraphCapabilities.for_decoder(target.args)
    needs = DraftNeeds(
        kind="two-model", default_width=3, vocab_size=draft.args.vocab_size
    )
    drafter = TwoModelDrafter(draft.model, request.policy, vocab.unwrap())
    return bind(graph, needs, request.width).map(
        lambda b: LoadedDraft(drafter, b.width, "two-model", draft.model, draft.source)
    )


def _is_mtp_artifact(artifact: DraftArtifact) -> bool:
    config = artifact.config
    return config is not None and str(config.get("model_type", "")).endswith("_mtp")


def _mtp_drafter(
    target: Any,
    weights: dict[str, Any],
    config: dict[str, Any],
    request: DraftLoadRequest,
    companion: Path | None,
    where: str,
    declared: DeclaredQuantization | None = None,
) -> Result[LoadedDraft, BindingError]:
    """Bind an MTP head (its weights and config) to its target (a Qwen
    hybrid, GLM-4.5 MoE or GLM-5: `models.mtp.build_mtp`).
    `declared`: the quantization its own config declares
    (`models.mtp.DeclaredQuantization`), checked against the weights; None
    for a head bundled in the target's checkpoint, whose packed shapes alone
    say how it is quantized (as for the target's own layers)."""
    from models.mtp import DEFAULT_BLOCK_SIZE, build_mtp
    from schemas.hf_glm4_moe import Glm4MoeArgs
    from schemas.hf_glm_moe_dsa import GlmMoeDsaArgs
    from schemas.hf_hybrid import HybridArgs, text_settings
    from specpipe.draft_vocab import configured
    from specpipe.drafts.mtp import MtpDrafter

    args = target.args
    config = text_settings(config)  # a multimodal wrapper keeps them in text_config
    if not isinstance(args, HybridArgs | Glm4MoeArgs | GlmMoeDsaArgs):
        return Failure(
            BindingError(
                f"{where}: an MTP head drafts for the model it was trained with "
                f"(a Qwen3-Next / Qwen3.5, GLM-4.5 MoE or GLM-5 model); the target "
                f"is a {args.model_type} model"
            )
        )
    problems = [
        f"its {key} is {config.get(key)}, the target's is {getattr(args, key)}"
        for key in ("hidden_size", "vocab_size")
        if config.get(key, getattr(args, key)) != getattr(args, key)
    ]
    if problems:
        return Failure(_misfit(where, "MTP head", problems))
    head = build_mtp(args, weights, declared)
    if not succeeded(head):
        return Failure(BindingError(f"{where}: {head.failure().message}"))
    vocab = configured(request.draft_vocab, args.vocab_size, companion)
    if not succeeded(vocab):
        return Failure(BindingError(f"draft vocabulary: {vocab.failure().message}"))
    block = config.get("block_size", DEFAULT_BLOCK_SIZE)
    width = max(1, int(block) - 1) if isinstance(block, int) else DEFAULT_BLOCK_SIZE - 1
    graph = GraphCapabilities.for_decoder(args)
    needs = DraftNeeds(
        kind="mtp",
        default_width=width,
        vocab_size=args.vocab_size,
        hidden_size=int(config.get("hidden_size", args.hidden_size)),
        shares=frozenset({"embedding", "lm_head"}),
    )
    drafter = MtpDrafter(target.model, head.unwrap(), request.policy, vocab.unwrap())
    return bind(graph, needs, request.width).map(
        lambda b: LoadedDraft(drafter, b.width, "mtp", drafter, where)
    )


def _declared_quantization(
    config: dict[str, Any], where: str
) -> Result[DeclaredQuantization, BindingError]:
    """A companion config's MLX quantization block (`quantization`, else an
    affine `quantization_config`), or None where it declares none."""
    from models.mtp import DeclaredQuantization
    from schemas.hf_hybrid import text_settings

    flat = text_settings(config)
    block = flat.get("quantization")
    if block is None:
        fallback = flat.get("quantization_config")
        if isinstance(fallback, dict) and {"bits", "group_size"} <= fallback.keys():
            block = fallback
    if block is not None and not (
        isinstance(block, dict)
        and isinstance(block.get("bits"), int)
        and isinstance(block.get("group_size"), int)
    ):
        return Failure(
            BindingError(
                f"{where}: config.json's quantization block must be an object with "
                f"integer bits and group_size, got {block!r}; fix or remove it"
            )
        )
    return Success(DeclaredQuantization(block))


def _artifact_config(
    request: DraftLoadRequest, own_head: str | None = None
) -> Result[tuple[Path, dict[str, Any]], BindingError]:
    """The draft folder and its config.json. `own_head` names a draft that
    projects through its own head, for which an FR-Spec list (which narrows
    the target's head) is refused."""
    assert request.source is not None
    folder = Path(request.source)
    config = DraftArtifact(folder).config
    if config is None:
        return Failure(BindingError(f"{folder}: missing or unreadable config.json"))
    if own_head is not None and request.draft_vocab not in (None, "off"):
        return Failure(
            BindingError(
                "a draft vocabulary (--draft-vocab) narrows the target's head; "
                f"{own_head} draft projects through its own head: drop the option"
            )
        )
    return Success((folder, config))


def _misfit(where: str, draft: str, problems: list[str]) -> BindingError:
    """The refusal of a draft (`draft`: "MTP head", "DFlash draft", ...) whose checkpoint
    at `where` does not fit the target, naming every problem."""
    return BindingError(
        f"{where}: the {draft} does not fit the target: " + "; ".join(problems)
    )


def _read_weights(folder: Path, what: str) -> Result[dict[str, Any], BindingError]:
    """Every array of a draft folder's *.safetensors files."""
    import mlx.core as mx

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return Failure(BindingError(f"{folder}: no *.safetensors weight files"))
    weights: dict[str, Any] = {}
    try:
        for file in files:
            loaded = mx.load(str(file))
            assert isinstance(loaded, dict)
            weights.update(loaded)
    except Exception as exc:
        return Failure(
            BindingError(f"{folder}: cannot read the {what} weights ({exc})")
        )
    return Success(weights)


def _load_mtp(request: DraftLoadRequest) -> Result[LoadedDraft, BindingError]:

    opened = _artifact_config(request)
    if not succeeded(opened):
        return Failure(opened.failure())
    folder, config = opened.unwrap()
    read = _read_weights(folder, "MTP")
    if not succeeded(read):
        return Failure(read.failure())
    weights = read.unwrap()
    return _declared_quantization(config, str(folder)).bind(
        lambda declared: _mtp_drafter(
            request.target, weights, config, request, folder, str(folder), declared
        )
    )


def _native_mtp(
    target: Any, request: DraftLoadRequest
) -> Result[LoadedDraft, BindingError]:
    config = dict(target.raw_config)
    return _mtp_drafter(
        target, target.mtp, config, request, None, f"{target.source} (mtp.*)"
    )


def _dflash_generation(artifact: DraftArtifact) -> int:
    """2 for a DFlash2 drafter's config, 1 for a DFlash (v1) one, else 0."""
    config = artifact.config
    if config is None:
        return 0
    architectures = [str(a) for a in config.get("architectures") or []]
    inner = config.get("dflash_config")
    if any("DFlash2" in a for a in architectures) or (
        isinstance(inner, dict) and "selector_rank" in inner
    ):
        return 2
    return 1 if inner is not None or any("DFlash" in a for a in architectures) else 0


def _load_dflash(request: DraftLoadRequest) -> Result[LoadedDraft, BindingError]:
    from models.cache import on_gpu
    from models.dflash import DFlashSettings, bits_problem, build_dflash, default_bits
    from models.layers import model_dtype
    from schemas.converter import hf, structure
    from schemas.hf import DecoderArgs, normalize_hf_config
    from specpipe.draft_vocab import SubsetHead, configured
    from specpipe.drafts.dflash import DFlashDrafter

    asked = request.draft_bits
    if asked is not None and (problem := bits_problem(asked)) is not None:
        return Failure(BindingError(f"{problem} (--draft-bits)"))
    opened = _artifact_config(request)
    if not succeeded(opened):
        return Failure(opened.failure())
    folder, config = opened.unwrap()
    where = str(folder)
    settings = DFlashSettings.of(config)
    if not succeeded(settings):
        return Failure(BindingError(f"{where}: {settings.failure().message}"))
    dflash = settings.unwrap()
    named_second = any("DFlash2" in str(a) for a in config.get("architectures") or [])
    if named_second and not (dflash.conv and dflash.selector):
        return Failure(
            BindingError(
                f"{where}: a DFlash2 config needs dflash_config's conv_kernel_size, "
                "conv_group_size, selector_rank and selector_top_k"
            )
        )
    args = structure(hf, normalize_hf_config(config), DecoderArgs, where)
    if not succeeded(args):
        return Failure(BindingError(f"{where}: {args.failure().message}"))
    draft_args = args.unwrap()
    target = request.target
    model = target.model
    if not hasattr(model, "tap"):
        return Failure(
            BindingError(
                f"{where}: a DFlash draft reads the target's layer outputs, which the "
                f"{target.args.model_type} target does not expose yet (specpipe's "
                "llama, qwen2, qwen3, glm4_moe, qwen3_next, qwen3_5 and gemma4 "
                "models do)"
            )
        )
    # the hidden size and the tapped layers are the binding's checks (`bind`,
    # before any weight is read); the mask token and codebooks are DFlash's
    kind = "dflash2" if dflash.second else "dflash"
    width = dflash.block_size - 1  # a block-trained drafter: at most its block
    needs = DraftNeeds(
        kind=kind,
        default_width=width,
        max_width=width,
        hidden_size=draft_args.hidden_size,
        tap_layers=dflash.target_layers,
        shares=frozenset({"embedding", "lm_head"}),
    )
    binding = bind(GraphCapabilities.for_decoder(target.args), needs, request.width)
    if not succeeded(binding):
        return Failure(binding.failure())
    problems = []
    if dflash.selector is not None and draft_args.vocab_size != target.args.vocab_size:
        problems.append(
            f"its candidate codebooks cover {draft_args.vocab_size} tokens, the "
            f"target's vocabulary {target.args.vocab_size}"
        )
    if dflash.mask_token >= target.args.vocab_size:
        problems.append(
            f"its mask token {dflash.mask_token} is past the target's vocabulary "
            f"({target.args.vocab_size})"
        )
    if problems:
        return Failure(_misfit(where, "DFlash draft", problems))
    read = _read_weights(folder, "DFlash")
    if not succeeded(read):
        return Failure(read.failure())
    weights = read.unwrap()
    # a float checkpoint's projections load at the bits asked, else at its
    # generation's default on this device; a quantized one's as they are
    quantized = any(name.endswith(".scales") for name in weights)
    bits = default_bits(dflash, on_gpu()) if asked is None and not quantized else asked
    built = build_dflash(draft_args, dflash, weights, model_dtype(model), bits)
    if not succeeded(built):
        return Failure(BindingError(f"{where}: {built.failure().message}"))
    draft = built.unwrap()
    # FR-Spec: the draft projects through the target's head, so a list of
    # the target's rows applies as it does to an MTP head
    vocab = configured(request.draft_vocab, target.args.vocab_size, folder)
    if not succeeded(vocab):
        return Failure(BindingError(f"draft vocabulary: {vocab.failure().message}"))
    listed = vocab.unwrap()
    if (
        listed is not None
        and dflash.selector is not None
        and listed.size < dflash.selector[1]
    ):
        return Failure(
            BindingError(
                f"draft vocabulary: {listed.size} rows, fewer than the DFlash2 "
                f"selector's {dflash.selector[1]} candidates per position"
            )
        )
    # the target's forwards return them now (beside any other draft's)
    model.tap_also(dflash.target_layers)
    subset = SubsetHead.of(model, listed) if listed is not None else None
    drafter = DFlashDrafter(model, draft, request.policy, kind, subset)
    # (the drafter times its own rounds for calibration: `calibration_round`)
    return Success(LoadedDraft(drafter, binding.unwrap().width, kind, drafter, where))


def _dflash_kind(kind: str, generation: int) -> DraftKind:
    """DFlash (1) or DFlash2 (2: dynamic convolutions and a candidate
    selector): one loader, the config says which it builds."""
    return DraftKind(
        kind=kind,
        artifact=True,
        default_width=15,
        load=_load_dflash,
        detect=lambda artifact: _dflash_generation(artifact) == generation,
        quantizes=True,
    )


def _is_dspark(artifact: DraftArtifact) -> bool:
    """A DSpark drafter's config: its class name (DeepSpec's Qwen3 or
    Gemma-4 one, or the community's), else DSpark's top-level keys."""
    from models.dspark import ARCHITECTURES, GEMMA4_ARCHITECTURE

    config = artifact.config
    if config is None:
        return False
    architectures = [str(a) for a in config.get("architectures") or []]
    if architectures and architectures[0] in (*ARCHITECTURES, GEMMA4_ARCHITECTURE):
        return True
    return (
        "dflash_config" not in config
        and not any("DFlash" in a for a in architectures)
        and {"target_layer_ids", "block_size", "mask_token_id", "markov_rank"}
        <= config.keys()
    )


def _load_dspark(request: DraftLoadRequest) -> Result[LoadedDraft, BindingError]:
    from models.dspark import (
        GEMMA4_ARCHITECTURE,
        DSparkSettings,
        build_dspark,
        gemma4_draft_args,
    )
    from models.layers import model_dtype
    from schemas.converter import hf, structure
    from schemas.hf import DecoderArgs, normalize_hf_config
    from schemas.hf_gemma4 import is_gemma4
    from specpipe.drafts.dspark import DSparkDrafter

    opened = _artifact_config(request, own_head="a DSpark")
    if not succeeded(opened):
        return Failure(opened.failure())
    folder, config = opened.unwrap()
    where = str(folder)
    settings = DSparkSettings.of(config)
    if not succeeded(settings):
        return Failure(BindingError(f"{where}: {settings.failure().message}"))
    dspark = settings.unwrap()
    target = request.target
    model = target.model
    # DeepSpec's Gemma-4 drafter: Gemma-4 layers over a Gemma-4 target's
    # layer outputs (its config is the target's text config, model_type and all)
    architectures = [str(a) for a in config.get("architectures") or []]
    gemma = GEMMA4_ARCHITECTURE in architectures or str(
        config.get("model_type", "")
    ).startswith("gemma4")
    if gemma and not is_gemma4(target.args):
        return Failure(
            BindingError(
                f"{where}: a Gemma-4 DSpark draft ({GEMMA4_ARCHITECTURE}) reads a "
                f"Gemma-4 target's layer outputs; the target is "
                f"{target.args.model_type}: use the Gemma-4 model it was trained for"
            )
        )
    if gemma:
        parsed = gemma4_draft_args(config, where)
        if not succeeded(parsed):
            return Failure(BindingError(parsed.failure().message))
        draft_args: DecoderArgs = parsed.unwrap()
    else:
        args = structure(hf, normalize_hf_config(config), DecoderArgs, where)
        if not succeeded(args):
            return Failure(BindingError(f"{where}: {args.failure().message}"))
        draft_args = args.unwrap()
    if not hasattr(model, "tap"):
        return Failure(
            BindingError(
                f"{where}: a DSpark draft reads the target's layer outputs, which the "
                f"{target.args.model_type} target does not expose yet (specpipe's "
                "llama, qwen2, qwen3, glm4_moe, qwen3_next, qwen3_5 and gemma4 "
                "models do)"
            )
        )
    # the hidden size and the tapped layers are the binding's checks; a
    # block of block_size slots drafts block_size tokens
    needs = DraftNeeds(
        kind="dspark",
        default_width=dspark.block_size,
        max_width=dspark.block_size,
        hidden_size=draft_args.hidden_size,
        tap_layers=dspark.target_layers,
    )
    binding = bind(GraphCapabilities.for_decoder(target.args), needs, request.width)
    if not succeeded(binding):
        return Failure(binding.failure())
    problems = []
    if draft_args.vocab_size != target.args.vocab_size:
        problems.append(
            f"its vocabulary ({draft_args.vocab_size} tokens) is not the target's "
            f"({target.args.vocab_size})"
        )
    if dspark.mask_token >= draft_args.vocab_size:
        problems.append(
            f"its mask token {dspark.mask_token} is past its vocabulary "
            f"({draft_args.vocab_size})"
        )
    if problems:
        return Failure(_misfit(where, "DSpark draft", problems))
    read = _read_weights(folder, "DSpark")
    if not succeeded(read):
        return Failure(read.failure())
    built = build_dspark(draft_args, dspark, read.unwrap(), model_dtype(model))
    if not succeeded(built):
        return Failure(BindingError(f"{where}: {built.failure().message}"))
    # the target's forwards return them now (beside any other draft's)
    model.tap_also(dspark.target_layers)
    drafter = DSparkDrafter(model, built.unwrap(), request.policy)
    return Success(
        LoadedDraft(drafter, binding.unwrap().width, "dspark", drafter, where)
    )


def _is_assistant(artifact: DraftArtifact) -> bool:
    """A KV-borrowing assistant's config: a `*_assistant` model type."""
    config = artifact.config
    return config is not None and str(config.get("model_type", "")).endswith(
        "_assistant"
    )


def _load_assistant(request: DraftLoadRequest) -> Result[LoadedDraft, BindingError]:
    from bindings.capabilities import BorrowedKV
    from models.dflash import load_exact
    from models.gemma4_assistant import Assistant
    from models.layers import model_dtype
    from schemas.hf_gemma4_assistant import assistant_args
    from specpipe.drafts.assistant import AssistantDrafter

    opened = _artifact_config(request, own_head="an assistant")
    if not succeeded(opened):
        return Failure(opened.failure())
    folder, config = opened.unwrap()
    where = str(folder)
    parsed = assistant_args(config, where)
    if not succeeded(parsed):
        return Failure(BindingError(parsed.failure().message))
    args = parsed.unwrap()
    target = request.target
    model = target.model
    text = args.text
    # what its layers read of the target's stored keys/values, and the
    # target's hidden states its inputs carry: the binding's checks
    needs = DraftNeeds(
        kind="assistant",
        default_width=3,
        vocab_size=args.vocab_size,
        hidden_size=args.backbone_hidden_size,
        shares=frozenset({"embedding"}),
        borrows_kv=tuple(
            BorrowedKV(kind, text.num_attention_heads, text.head_dim_of(kind))
            for kind in sorted(set(text.layer_types))
        ),
    )
    binding = bind(GraphCapabilities.for_decoder(target.args), needs, request.width)
    if not succeeded(binding):
        return Failure(BindingError(f"{where}: {binding.failure().message}"))
    if args.vocab_size != target.args.vocab_size:
        return Failure(
            BindingError(
                f"{where}: the assistant's vocabulary ({args.vocab_size} tokens) is "
                f"not the target's ({target.args.vocab_size})"
            )
        )
    read = _read_weights(folder, "assistant")
    if not succeeded(read):
        return Failure(read.failure())
    draft = Assistant(args)
    loaded = load_exact(
        draft,
        draft.sanitize(read.unwrap()),
        "assistant",
        "use the assistant checkpoint its config.json came with",
        model_dtype(model),
    )
    if not succeeded(loaded):
        return Failure(BindingError(f"{where}: {loaded.failure().message}"))
    drafter = AssistantDrafter(
        model, loaded.unwrap(), target.args.hidden_size, request.policy
    )
    return Success(
        LoadedDraft(drafter, binding.unwrap().width, "assistant", drafter, where)
    )


ASSISTANT = DraftKind(
    kind="assistant",
    artifact=True,
    default_width=3,
    load=_load_assistant,
    detect=_is_assistant,
)

DSPARK = DraftKind(
    kind="dspark",
    artifact=True,
    default_width=7,
    load=_load_dspark,
    detect=_is_dspark,
)

DFLASH = _dflash_kind("dflash", 1)
DFLASH2 = _dflash_kind("dflash2", 2)

MTP = DraftKind(
    kind="mtp",
    artifact=True,
    default_width=2,
    load=_load_mtp,
    detect=_is_mtp_artifact,
    bundled_companion="mtp",
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
    return (
        DraftRegistry()
        .register(DSPARK)
        .register(DFLASH2)
        .register(DFLASH)
        .register(ASSISTANT)
        .register(MTP)
        .register(TWO_MODEL)
        .register(NGRAM)
        .register_native(NativeDraftKind("mtp", _native_mtp))
    )
