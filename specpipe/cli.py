"""The `specpipe` command line: generate, convert."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from models.build import AFFINE_GROUPS, float_other_groups
from models.dflash import DRAFT_BITS
from models.parallel import cpu_threads, set_cpu_threads
from schemas.errors import succeeded
from schemas.request import (
    DraftPolicy,
    GenerationLimits,
    SamplingParams,
    logit_bias_entries,
)
from specpipe.api import (
    KV_BITS,
    KV_GROUP_SIZES,
    Conversation,
    Pipeline,
    Prompt,
    load,
)
from specpipe.load import DEFAULT_MODEL, checkpoint, save_folder
from specpipe.load import load as load_model
from specpipe.precision import prefer_exact_float32
from specpipe.server import Defaults, Server

# An auto/on/off option's value: None leaves the choice to the device.
_SWITCH: dict[str, bool | None] = {"auto": None, "on": True, "off": False}


def _fail(message: str, code: int = 2) -> NoReturn:
    print(f"specpipe: error: {message}", file=sys.stderr)
    sys.exit(code)


def _unwrap(result: Any) -> Any:
    if not succeeded(result):
        _fail(str(result.failure()))
    return result.unwrap()


def _read_prompts(path: str) -> list[dict[str, Any]]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        _fail(f"{path}: cannot read the prompts file ({exc.strerror})")
    prompts: list[dict[str, Any]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            _fail(f"{path}:{number}: not valid JSON ({exc.msg})")
        if isinstance(item, str):
            item = {"prompt": item}
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
            _fail(f'{path}:{number}: expected an object with a "prompt" string')
        prompts.append(item)
    if not prompts:
        _fail(f"{path}: no prompts in the file")
    return prompts


def _sampling(args: argparse.Namespace) -> SamplingParams:
    sampling: SamplingParams = _unwrap(
        SamplingParams.create(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            repetition_context=args.repetition_context_size,
            presence_penalty=args.presence_penalty,
            presence_context=args.presence_context_size,
            frequency_penalty=args.frequency_penalty,
            frequency_context=args.frequency_context_size,
            logit_bias=args.logit_bias,
            seed=args.seed,
        )
    )
    return sampling


def _limits(
    args: argparse.Namespace, logprobs: bool = False, top_logprobs: int = 0
) -> GenerationLimits:
    limits: GenerationLimits = _unwrap(
        GenerationLimits.create(
            max_tokens=args.max_tokens,
            stop=tuple(args.stop or ()),
            logprobs=logprobs,
            top_logprobs=top_logprobs,
        )
    )
    return limits


def _pipeline(args: argparse.Namespace, prompt_cache: bool | int = False) -> Pipeline:
    policy = DraftPolicy(
        greedy=args.greedy_draft,
        temperature=args.draft_temperature,
        drop_filters=args.draft_drop_filters,
        staged=_SWITCH[args.staged_draft],
        compiled=_SWITCH[args.compiled_draft],
    )
    pipeline: Pipeline = _unwrap(
        load(
            args.model,
            draft=args.draft,
            num_draft_tokens=args.num_draft_tokens,
            dtype=args.dtype,
            draft_dtype=args.draft_dtype,
            ngram_min=args.ngram_min,
            ngram_max=args.ngram_max,
            policy=policy,
            device_round=args.device_round,
            draft_vocab=args.draft_vocab,
            adaptive=args.adaptive,
            phase_timing=args.phase_timing,
            draft_ahead=_SWITCH[args.draft_ahead],
            prompt_cache=prompt_cache,
            draft_bits=args.draft_bits,
            gguf_quantized=args.gguf_quantized,
            kv_bits=args.kv_bits,
            kv_group_size=args.kv_group_size,
        )
    )
    if args.extra_eos_token:
        pipeline = _unwrap(pipeline.with_end_tokens(args.extra_eos_token))
    if args.chat_template_config is not None:
        pipeline = _unwrap(pipeline.with_template_args(args.chat_template_config))
    return pipeline


def _logit_bias(text: str) -> tuple[tuple[int, float], ...]:
    """--logit-bias's JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from exc
    entries = logit_bias_entries(value)
    if not succeeded(entries):
        raise argparse.ArgumentTypeError(entries.failure().message)
    pairs: tuple[tuple[int, float], ...] = entries.unwrap()
    return pairs


def _template_config(text: str) -> dict[str, Any]:
    """--chat-template-config's JSON object."""
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from exc
    if not isinstance(values, dict):
        raise argparse.ArgumentTypeError(
            f"give a JSON object of names and values, e.g. "
            f"'{{\"enable_thinking\": false}}', not {text!r}"
        )
    return values


def _generate(args: argparse.Namespace) -> None:
    for flag, asked in (
        ("--logprobs", args.logprobs),
        ("--top-logprobs", args.top_logprobs),
    ):
        if asked and not (args.json or args.prompts_file):
            _fail(f"{flag} needs --json (the log-probabilities are in its object)")
    sampling = _sampling(args)
    limits = _limits(args, args.logprobs, args.top_logprobs)
    prompt: str | None = args.prompt
    if args.prompt_option is not None:
        if prompt is not None:
            _fail("give the prompt once: either PROMPT or --prompt, not both")
        prompt = args.prompt_option
    if args.prompts_file:
        if prompt is not None:
            _fail("give either PROMPT (or --prompt) or --prompts-file, not both")
        prompts = [item["prompt"] for item in _read_prompts(args.prompts_file)]
    elif prompt is not None:
        prompts = [prompt]
    elif not sys.stdin.isatty():
        prompts = [sys.stdin.read()]
        if not prompts[0]:
            _fail(
                "no prompt: stdin was empty; give PROMPT, --prompts-file F.jsonl "
                "or pipe text in"
            )
    else:
        _fail(
            'no prompt: give PROMPT, --prompts-file F.jsonl, or pipe text in (e.g. specpipe generate "Hello")'
        )
    requests: list[Prompt] = list(prompts)
    if args.system is not None:  # each prompt after the system message, as a chat
        requests = [
            [{"role": "system", "content": args.system}, {"role": "user", "content": p}]
            for p in prompts
        ]
    cached = args.prompt_cache_file is not None
    budget = _cache_budget(args)  # checked whether or not a file asks for it
    pipeline = _pipeline(args, budget if cached else False)
    pipeline = _with_cache_file(pipeline, args)
    templated = args.chat_template_config is not None
    chat_options = {  # each: given, and the fix for a model without a template
        "--system-prompt": (
            args.system is not None,
            "give the system text as part of the prompt instead",
        ),
        "--chat-template-config": (templated, "leave the option out"),
    }
    for option, (given, fix) in chat_options.items():
        if given and not pipeline.target.tokenizer.has_chat_template:
            _fail(
                f"{option} needs a chat template, and {args.model} has none "
                f"(a base model): {fix}"
            )
    streaming = not args.json and not args.prompts_file

    def on_text(_row: int, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    results = _unwrap(
        pipeline.generate_batch(
            requests,
            sampling,
            limits,
            args.chat or templated,
            on_text if streaming else None,
        )
    )
    if streaming:
        sys.stdout.write("\n")
        if results[0].finish_reason != "failed":
            print(results[0].summary(), file=sys.stderr)
    elif args.prompts_file:
        for result in results:
            print(json.dumps(result.to_json(), ensure_ascii=False))
    else:
        print(json.dumps(results[0].to_json(), ensure_ascii=False))
    failed = [r for r in results if r.finish_reason == "failed"]
    if failed:
        _fail(failed[0].error or "generation failed", code=1)
    _save_cache_file(pipeline, args)


def _chat(args: argparse.Namespace) -> None:
    """A conversation on stdin: each line a user turn, each reply streamed (or
    one JSON object per turn with --json). Earlier turns' states stay in the
    prompt cache, so a turn prefills only what it adds."""
    sampling = _sampling(args)
    limits = _limits(args)
    pipeline = _with_cache_file(_pipeline(args, _cache_budget(args)), args)
    if not pipeline.target.tokenizer.has_chat_template:
        _fail(
            f"{args.model} has no chat template (a base model): "
            "`specpipe chat` needs a chat model; run `specpipe generate` with the "
            "prompt as plain text instead"
        )
    conversation = Conversation(
        ({"role": "system", "content": args.system},) if args.system else ()
    )
    interactive = sys.stdin.isatty() and not args.json

    def on_text(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    while True:
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:
            break
        text = line.rstrip("\n")
        if not text.strip():
            continue
        if text.strip() == "/reset":
            conversation = conversation.reset()
            continue
        turn = conversation.say(
            pipeline, text, sampling, limits, on_text=None if args.json else on_text
        )
        if not succeeded(turn):
            if not interactive:  # a script's turn failed: say so by the status
                _fail(str(turn.failure()), code=1)
            print(f"specpipe: error: {turn.failure()}", file=sys.stderr)
            continue
        conversation, result = turn.unwrap()
        if args.json:
            print(json.dumps(result.to_json(), ensure_ascii=False), flush=True)
        else:
            sys.stdout.write("\n")
            print(result.summary(), file=sys.stderr)
        if result.finish_reason == "failed":
            _fail(result.error or "generation failed", code=1)
    _save_cache_file(pipeline, args)


def _serve(args: argparse.Namespace) -> None:
    """The pipeline behind an OpenAI-compatible HTTP endpoint until Ctrl-C;
    the run options are each request's defaults."""
    if not 0 <= args.port <= 65535:
        _fail(f"--port must be 0-65535 (0: any free port), got {args.port}")
    if args.max_batch < 1:
        _fail(f"--max-batch must be at least 1, got {args.max_batch}")
    defaults = Defaults(_sampling(args), _limits(args))
    pipeline = _with_cache_file(_pipeline(args, _cache_budget(args)), args)
    name = str(pipeline.target.source)
    server = Server(pipeline, name, args.host, args.port, defaults, args.max_batch)
    try:
        host, port = server.bind()
    except OSError as exc:
        _fail(str(exc))
    print(
        f"specpipe: serving {name} (draft {pipeline.draft_kind}) at "
        f"http://{host}:{port}/v1 (Ctrl-C or SIGTERM stops)",
        file=sys.stderr,
        flush=True,
    )
    stop = threading.Event()  # SIGTERM stops it as Ctrl-C does
    previous = signal.signal(signal.SIGTERM, lambda _signal, _frame: stop.set())
    try:
        server.serve(stop)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    print("specpipe: stopped", file=sys.stderr)
    _save_cache_file(pipeline, args)


def _cache_budget(args: argparse.Namespace) -> int:
    """--prompt-cache-mb in bytes, checked."""
    if args.prompt_cache_mb <= 0:
        _fail(f"--prompt-cache-mb must be positive, got {args.prompt_cache_mb}")
    return int(args.prompt_cache_mb) << 20


def _with_cache_file(pipeline: Pipeline, args: argparse.Namespace) -> Pipeline:
    """The pipeline with `--prompt-cache-file`'s checkpoints, where it exists."""
    path = args.prompt_cache_file
    if path is not None:  # found now, not after the run it would have saved
        folder = Path(path).absolute().parent
        if Path(path).is_dir():
            _fail(f"--prompt-cache-file {path} is a folder; give a file path")
        if not folder.is_dir():
            _fail(f"--prompt-cache-file {path}: its folder {folder} does not exist")
        if not os.access(folder, os.W_OK):
            _fail(f"--prompt-cache-file {path}: its folder {folder} is not writable")
    if path is None or not Path(path).exists():
        return pipeline
    loaded: Pipeline = _unwrap(pipeline.load_prompt_cache(path))
    return loaded


def _save_cache_file(pipeline: Pipeline, args: argparse.Namespace) -> None:
    if args.prompt_cache_file is not None:
        _unwrap(pipeline.save_prompt_cache(args.prompt_cache_file))


def _convert(args: argparse.Namespace) -> None:
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        _fail(f"{out} is a file, not a folder; give a folder path for the model")
    if out.exists() and any(out.iterdir()) and not args.force:
        _fail(f"{out} exists and is not empty; pass --force to replace it")
    keep = args.quantize in ("keep", "keep-mlx")
    quantize = (
        None if args.quantize in ("none", "keep", "keep-mlx") else int(args.quantize)
    )
    if args.group_size not in AFFINE_GROUPS:
        _fail(
            f"--group-size must be one of {', '.join(map(str, AFFINE_GROUPS))} "
            f"(MLX's affine groups), got {args.group_size}"
        )
    loaded = _unwrap(checkpoint(args.src, args.dtype, gguf_quantized=keep))
    if args.quantize == "keep-mlx":
        floated = float_other_groups(loaded.model)
        if floated:
            print(
                f"specpipe: {floated} matrices in groups of 16 written as float "
                "(Q2_K, Q3_K, Q6_K: MLX's quantized layers and mlx-lm take no groups of 16)",
                file=sys.stderr,
            )
    path = _unwrap(save_folder(loaded, out, quantize, args.group_size))
    print(f"specpipe: wrote {path}", file=sys.stderr)


def _run_options(parser: argparse.ArgumentParser) -> None:
    """The model, sampling and draft options of generate and chat."""
    parser.add_argument(
        "--chat-template-config",
        type=_template_config,
        default=None,
        metavar="JSON",
        help="more values for the chat template, a JSON object (as mlx_lm.generate "
        "takes it), e.g. '{\"enable_thinking\": false}'; with generate it implies --chat",
    )
    parser.add_argument(
        "--extra-eos-token",
        nargs="+",
        default=[],
        metavar="TOKEN",
        help="more tokens that end a row, beside the model's end-of-sequence "
        "tokens (token texts such as <|im_end|>; as mlx_lm.generate takes them)",
    )
    parser.add_argument(
        "--prompt-cache-file",
        default=None,
        help="start from the prompt-cache checkpoints this file holds (if it "
        "exists) and write the cache back to it at the end: a long prompt "
        "prefilled once serves later runs that begin with it",
    )
    parser.add_argument(
        "--prompt-cache-mb",
        type=int,
        default=2048,
        help="memory the prompt cache's states may take (default 2048 MiB)",
    )
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"folder, .gguf, fixture name or hub id (default {DEFAULT_MODEL})",
    )
    parser.add_argument(
        "-m", "--max-tokens", type=int, default=256, help="(default 256)"
    )
    parser.add_argument(
        "--temperature",
        "--temp",
        type=float,
        default=0.0,
        help="0 = greedy (default)",
    )
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="divide the logits of recent tokens (1 = off)",
    )
    parser.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        help="subtract from the logit of each recent token (0 = off)",
    )
    parser.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="subtract from a recent token's logit per occurrence (0 = off)",
    )
    parser.add_argument(
        "--logit-bias",
        type=_logit_bias,
        default=(),
        metavar="JSON",
        help="add values to token ids' logits, e.g. '{\"50256\": -100}' "
        "(OpenAI's logit_bias; -100 all but bans a token)",
    )
    for kind in ("repetition", "presence", "frequency"):
        parser.add_argument(
            f"--{kind}-context-size",
            type=int,
            default=20,
            metavar="N",
            help=f"the {kind} penalty reads the last N tokens (default 20)",
        )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--stop",
        action="append",
        metavar="STR",
        help="a stop string; repeat the option for more (--stop A --stop B)",
    )
    parser.add_argument(
        "--dtype", choices=["float32", "float16", "bfloat16"], default=None
    )
    parser.add_argument(
        "--kv-bits",
        type=int,
        choices=KV_BITS,
        default=None,
        help="store the target's attention keys and values quantized to this "
        "many bits (mlx_lm's --kv-bits; default: at the model's dtype)",
    )
    parser.add_argument(
        "--kv-group-size",
        type=int,
        choices=KV_GROUP_SIZES,
        default=64,
        help="the groups --kv-bits quantizes in (default 64)",
    )
    parser.add_argument(
        "--draft",
        "--draft-model",
        default="none",
        help="none | ngram | mtp | auto | a draft model reference: a second "
        "model, a DFlash / DFlash2 / DSpark drafter, a Gemma-4 assistant or an "
        "mtp/ companion folder (--draft-model: the same, as mlx_lm.generate "
        "names it)",
    )
    parser.add_argument(
        "--draft-dtype",
        choices=["float32", "float16", "bfloat16"],
        default=None,
        help="a draft model's dtype, if not the target's (bfloat16 halves a "
        "draft's bytes; on an x86-64 CPU it runs on specpipe's AVX2 kernel)",
    )
    _draft_bits_option(parser)
    _gguf_quantized_option(parser)
    parser.add_argument(
        "--num-draft-tokens",
        type=int,
        default=None,
        help="draft tokens per round (default per kind)",
    )
    parser.add_argument("--ngram-min", type=int, default=None)
    parser.add_argument("--ngram-max", type=int, default=None)
    parser.add_argument(
        "--greedy-draft",
        action="store_true",
        help="argmax drafts (drops the coupled draw)",
    )
    parser.add_argument("--draft-temperature", type=float, default=None)
    parser.add_argument("--draft-drop-filters", action="store_true")
    parser.add_argument(
        "--staged-draft",
        choices=tuple(_SWITCH),
        default="auto",
        help="a draft model's forwards also check prompt-lookup guesses, several "
        "drafts per forward when they match (auto: on a CPU, not on a GPU)",
    )
    parser.add_argument(
        "--compiled-draft",
        choices=tuple(_SWITCH),
        default="auto",
        help="an MTP head's draft steps run as compiled functions (auto: on a "
        "GPU, not on a CPU)",
    )
    parser.add_argument(
        "--device-round",
        action="store_true",
        help="build the verify graph before reading drafts back (one host read "
        "per round; measured slower on an H200, so off by default)",
    )
    parser.add_argument(
        "--draft-ahead",
        choices=tuple(_SWITCH),
        default="auto",
        help="launch the next round's drafts before a round's host read, from "
        "device values only (an MTP head's rounds; auto: on a GPU, where one "
        "row's rounds measured 1.01-1.33x shorter and three rows' 1.46-1.75x, "
        "not on a CPU; bench/RESULTS.md)",
    )
    parser.add_argument(
        "--phase-timing",
        action="store_true",
        help="report ms spent drafting, verifying, sampling and committing "
        "(synchronises between phases, so it runs slower)",
    )
    parser.add_argument(
        "--adaptive",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="choose each row's draft depth per round (up to --num-draft-tokens) "
        "from costs measured on this machine, and gate speculation off where it "
        "would not pay (default: on when drafting; the first use of a model "
        "pair calibrates for a few seconds and caches it); --no-adaptive drafts "
        "the full width every round",
    )
    parser.add_argument(
        "--draft-vocab",
        default=None,
        help="FR-Spec draft vocabulary: a draft_vocab.json path, or 'off' "
        "(default: the list the draft ships, if any)",
    )


def _gguf_quantized_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gguf-quantized",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a .gguf (or fixture) model, and a --draft model that is one, keep "
        "their Q4_*, Q5_*, Q8_0 and K-type matrices quantized: the same weights in a "
        "fraction of the memory, and faster (the default for such models; "
        "--gguf-quantized also refuses other models); --no-gguf-quantized "
        "dequantizes them to float",
    )


def _draft_bits_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--draft-bits",
        type=int,
        choices=DRAFT_BITS,
        default=None,
        help="quantize a DFlash draft's attention, MLP and fc projections to 4 or "
        "8 bits at load (MLX affine, groups of 64), or keep them float (16) "
        "(default: 4 for a DFlash2 draft on a GPU, as the reference engine; float "
        "on a CPU, where MLX's quantized products measured far slower, and for "
        "DFlash v1; a checkpoint already quantized loads as it is)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specpipe", description="Lossless speculative decoding on MLX."
    )
    parser.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="CPU threads each weight product is split over when running on the CPU "
        "(default: $SPECPIPE_CPU_THREADS, else every CPU this process may use; 1 = no split; "
        "always 1 with MLX's CUDA backend)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text (plain or speculative)")
    gen.add_argument("prompt", nargs="?", help="the prompt (or pipe it on stdin)")
    gen.add_argument(
        "-p",
        "--prompt",
        dest="prompt_option",
        metavar="PROMPT",
        default=None,
        help="the prompt as an option (as mlx_lm.generate takes it), instead of PROMPT",
    )
    gen.add_argument(
        "--chat", action="store_true", help="apply the model's chat template"
    )
    gen.add_argument(
        "--system-prompt",
        "--system",
        dest="system",
        default=None,
        metavar="TEXT",
        help="a system message before each prompt (implies --chat; "
        "mlx_lm.generate's --system-prompt)",
    )
    gen.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object instead of streaming text",
    )
    gen.add_argument(
        "--logprobs",
        action="store_true",
        help="include each token's log-probability (with --json)",
    )
    gen.add_argument(
        "--top-logprobs",
        type=int,
        default=0,
        metavar="K",
        help="include each position's K most likely tokens and their "
        "log-probabilities, K <= 20 (with --json; implies --logprobs)",
    )
    gen.add_argument(
        "--prompts-file", help="JSONL, one prompt object per line, run as one batch"
    )
    _run_options(gen)
    gen.set_defaults(func=_generate)

    chat = sub.add_parser(
        "chat",
        help="a conversation on stdin, one user turn a line (/reset starts over); "
        "earlier turns stay in the prompt cache",
    )
    chat.add_argument(
        "--system",
        "--system-prompt",
        dest="system",
        default=None,
        metavar="TEXT",
        help="a system message (--system-prompt: the same, as mlx_lm names it)",
    )
    chat.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per turn instead of streaming text",
    )
    _run_options(chat)
    chat.set_defaults(func=_chat)

    serve = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (/v1/completions, "
        "/v1/chat/completions, /v1/models), speculating for every request",
    )
    serve.add_argument("--host", default="127.0.0.1", help="(default 127.0.0.1)")
    serve.add_argument(
        "--port", type=int, default=8080, help="(default 8080; 0: any free port)"
    )
    serve.add_argument(
        "--max-batch",
        type=int,
        default=8,
        help="the most requests generated at once: waiting requests join the "
        "live rows between rounds (continuous batching; default 8)",
    )
    _run_options(serve)
    serve.set_defaults(func=_serve)

    conv = sub.add_parser(
        "convert", help="write an HF-layout MLX folder from any model reference"
    )
    conv.add_argument("src", help="folder, .gguf, fixture name or hub id")
    conv.add_argument("out", help="output folder")
    conv.add_argument(
        "--quantize",
        choices=["2", "3", "4", "5", "6", "8", "none", "keep", "keep-mlx"],
        default="none",
        help="2, 3, 4, 5, 6 or 8: MLX affine bits in groups of --group-size (on a "
        "CPU all of them run on specpipe's affine kernel); keep (a .gguf or a "
        "fixture): its Q4_*, Q5_*, Q8_0 and K-type matrices stay quantized as "
        "they are (MLX affine layout, the same weights; Q2_K, Q3_K and Q6_K in "
        "groups of 16, which only specpipe reads), other types dequantized; "
        "keep-mlx: the same with the groups of 16 as float, a folder MLX and "
        "mlx-lm load too; none (default): float",
    )
    conv.add_argument(
        "--group-size",
        type=int,
        default=64,
        help="the affine groups of --quantize 2-8: 32, 64 (default) or 128",
    )
    conv.add_argument(
        "--dtype", choices=["float32", "float16", "bfloat16"], default=None
    )
    conv.add_argument("--force", action="store_true")
    conv.set_defaults(func=_convert)
    cal = sub.add_parser(
        "calibrate", help="measure round costs on this machine (cached)"
    )
    cal.add_argument("--model", default=DEFAULT_MODEL)
    cal.add_argument(
        "--draft",
        "--draft-model",
        default=None,
        help="the draft as generate's --draft takes it: ngram | auto | mtp | a draft "
        "model reference or companion folder (omit for none)",
    )
    cal.add_argument("--max-width", type=int, default=8)
    _draft_bits_option(cal)
    _gguf_quantized_option(cal)
    cal.add_argument(
        "--dtype", choices=["float32", "float16", "bfloat16"], default=None
    )
    cal.set_defaults(func=_calibrate)

    vocab = sub.add_parser(
        "draft-vocab", help="build an FR-Spec draft vocabulary from token frequencies"
    )
    vocab.add_argument(
        "--model", default=DEFAULT_MODEL, help="the model whose tokenizer counts"
    )
    vocab.add_argument(
        "--corpus", nargs="+", required=True, help="text files to count tokens in"
    )
    vocab.add_argument(
        "--size",
        type=int,
        required=True,
        help="ids to keep: the N most frequent (fewer where the corpus has fewer "
        "distinct tokens)",
    )
    vocab.add_argument("-o", "--out", required=True, help="output draft_vocab.json")
    vocab.set_defaults(func=_draft_vocab)
    return parser


def _calibrate(args: argparse.Namespace) -> None:
    from specpipe.api import calibrate

    if args.max_width < 1:
        _fail(f"max-width must be >= 1, got {args.max_width}")
    pipeline = _unwrap(
        load(
            args.model,
            draft=args.draft,
            dtype=args.dtype,
            draft_bits=args.draft_bits,
            gguf_quantized=args.gguf_quantized,
            adaptive=False,  # measured below, fresh (the default calibrates too)
        )
    )
    cost = calibrate(
        pipeline.target, pipeline.draft, args.dtype, args.max_width, refresh=True
    )
    print(
        json.dumps(
            {"verify_ms": list(cost.verify_ms), "draft_ms": cost.draft_ms},
            indent=2,
        )
    )


def _draft_vocab(args: argparse.Namespace) -> None:
    from collections import Counter

    from specpipe.draft_vocab import DraftVocabulary

    loaded = _unwrap(load_model(args.model))
    counts: Counter[int] = Counter()
    for name in args.corpus:
        try:
            text = Path(name).read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            _fail(f"{name}: cannot read the corpus file ({exc.strerror})")
        counts.update(loaded.tokenizer.encode(text, add_special_tokens=False))
    if not counts:
        _fail("the corpus has no tokens")
    vocab_size = loaded.args.vocab_size
    result = _unwrap(
        DraftVocabulary.from_counts(
            counts, args.size, vocab_size, loaded.tokenizer.eos_token_ids
        )
    )
    _unwrap(result.write(Path(args.out)))
    print(
        f"specpipe: wrote {args.out}: {result.size} ids covering "
        f"{sum(counts[i] for i in result.ids) / sum(counts.values()):.1%} of the corpus tokens",
        file=sys.stderr,
    )


def main(argv: Sequence[str] | None = None) -> None:
    prefer_exact_float32()  # before any product (specpipe/precision.py)
    args = build_parser().parse_args(argv)
    try:
        set_cpu_threads(args.cpu_threads)
        cpu_threads()
    except ValueError as exc:
        _fail(f"{exc}")
    try:
        args.func(args)
    except BrokenPipeError:
        # the reader went away (`specpipe generate ... | head`): stop quietly,
        # as other command-line tools do, instead of a traceback at exit too
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)  # 128 + SIGPIPE, as a shell reports a tool killed by it


if __name__ == "__main__":
    main()
