"""llama.cpp blocks kept quantized (models/gguf_quant.py, `keep_quantized`).

Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K and Q8_0 blocks become MLX affine groups
of 32, Q6_K blocks groups of 16, whose dequantized weights are exactly
llama.cpp's (the `gguf` package's dequantization); a kept GGUF model
computes what its dequantized twin does, in a fraction of the memory, and
converts to a quantized MLX folder.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize
from gguf_support import tiny_tokens, tiny_weights, write_tiny_gguf
from mlx.utils import tree_flatten
from returns.result import Failure, Success

import models.gguf_quant as gguf_quant
from models import cpu_kernel
from models.gguf import read_gguf
from models.gguf_quant import AFFINE_TYPES, GROUP_SIZES, affine_rows
from models.parallel import MLX_GROUP_SIZES, dequantized, project
from specpipe.load import LoadedModel, load, save_folder

Q = GGMLQuantizationType


def random_blocks(
    qtype: GGMLQuantizationType, rows: int, width: int, seed: int
) -> np.ndarray:
    """Whole rows of random blocks (random bytes with finite fp16 scales)."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    count = rows * width // block
    raw = rng.integers(0, 256, (count, size), dtype=np.uint8)
    halves = rng.normal(0.0, 0.05, (count, 2)).astype(np.float16)
    # the K types of groups of 16 keep d (Q2_K: d, dmin) after their
    # values and scales; small, as a model's weights are
    tail = {Q.Q6_K: (208,), Q.Q3_K: (108,), Q.Q2_K: (80, 82)}.get(qtype)
    if tail is not None:
        for k, at in enumerate(tail):
            raw[:, at : at + 2] = (halves[:, k : k + 1] * np.float16(0.01)).view(
                np.uint8
            )
        return raw.reshape(-1)
    # d (and m / dmin)
    width_of_halves = 4 if qtype in (Q.Q4_1, Q.Q4_K, Q.Q5_1, Q.Q5_K) else 2
    raw[:, :width_of_halves] = halves.view(np.uint8).reshape(count, 4)[
        :, :width_of_halves
    ]
    return raw.reshape(-1)


def _values(
    packed: mx.array, scales: mx.array, biases: mx.array, group: int, bits: int
) -> mx.array:
    """The dequantized weights: MLX's own for its group sizes, else
    `models.parallel.dequantized` (which `test_the_own_dequantization_is_mlxs`
    checks against MLX's)."""
    if group in MLX_GROUP_SIZES:
        return mx.dequantize(packed, scales, biases, group, bits)
    return dequantized(packed, scales, biases, group, bits)


@pytest.mark.parametrize("qtype", list(AFFINE_TYPES), ids=lambda q: q.name)
@pytest.mark.parametrize("width", [256, 768])
def test_blocks_dequantize_to_llamacpp_values_exactly(
    qtype: GGMLQuantizationType, width: int
) -> None:
    rows = 6
    raw = random_blocks(qtype, rows, width, seed=width)
    packed, scales, biases = affine_rows(qtype, raw, width)
    bits, group = AFFINE_TYPES[qtype], GROUP_SIZES.get(qtype, 32)
    assert packed.dtype == np.uint32 and packed.shape == (rows, width * bits // 32)
    assert scales.shape == biases.shape == (rows, width // group)
    assert scales.dtype == biases.dtype == np.float32
    got = _values(mx.array(packed), mx.array(scales), mx.array(biases), group, bits)
    want = dequantize(raw.reshape(1, -1), qtype).reshape(rows, width)
    np.testing.assert_array_equal(np.array(got), want)


def test_row_blocks_read_as_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tensor read in several row blocks is the tensor read whole."""
    raw = random_blocks(Q.Q4_K, 10, 512, seed=3)
    path = tmp_path / "raw.bin"
    path.write_bytes(b"\0" * 7 + raw.tobytes())
    with path.open("rb") as handle:
        whole = gguf_quant.read_affine(handle.fileno(), Q.Q4_K, (10, 512), 7)
        monkeypatch.setattr(gguf_quant, "_CHUNK_BYTES", 3 * 288)  # 3 rows a block
        parts = gguf_quant.read_affine(handle.fileno(), Q.Q4_K, (10, 512), 7)
    for a, b in zip(whole, parts, strict=True):
        np.testing.assert_array_equal(a, b)


def _tiny(tmp_path: Path, qtype: GGMLQuantizationType, arch: str = "llama") -> Path:
    tokens, _ = tiny_tokens()
    weights = tiny_weights(4, len(tokens), model_type=arch, tied=arch == "llama")
    path = tmp_path / f"tiny-{arch}-{qtype.name}.gguf"
    write_tiny_gguf(path, weights, arch=arch, qtype=qtype)
    return path


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize(
    "qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0], ids=lambda q: q.name
)
def test_kept_matrices_are_the_dequantized_weights(
    tmp_path: Path, qtype: GGMLQuantizationType, arch: str
) -> None:
    """Every matrix comes as an MLX triple (llama's Q/K rows unpermuted in all
    three) that dequantizes to the weight the float import gives; vectors
    (norms, biases) come as they do without keeping."""
    path = _tiny(tmp_path, qtype, arch)
    plain = read_gguf(path).unwrap().weights
    kept = read_gguf(path, keep_quantized=True).unwrap().weights
    bits = AFFINE_TYPES[qtype]
    matrices = [n for n, v in plain.items() if v.ndim == 2]
    assert matrices and "model.layers.0.self_attn.q_proj.weight" in matrices
    for name, value in plain.items():
        if value.ndim == 1:
            assert kept[name].dtype == mx.float32
            np.testing.assert_array_equal(np.array(kept[name]), np.array(value))
            continue
        base = name.removesuffix(".weight")
        packed = kept[name]
        assert packed.dtype == mx.uint32, name
        got = mx.dequantize(
            packed, kept[f"{base}.scales"], kept[f"{base}.biases"], 32, bits
        )
        np.testing.assert_array_equal(np.array(got), np.array(value), err_msg=name)
    assert len(kept) == len(plain) + 2 * len(matrices)


def test_types_without_an_affine_form_load_as_floats(tmp_path: Path) -> None:
    path = _tiny(tmp_path, Q.BF16)
    kept = read_gguf(path, keep_quantized=True).unwrap().weights
    assert not any(name.endswith(".scales") for name in kept)
    # a file of BF16 matrices: bfloat16 throughout, as without keeping
    assert all(v.dtype == mx.bfloat16 for v in kept.values())


def _logits(loaded: LoadedModel) -> mx.array:
    ids = mx.array([[1, 5, 9, 12, 3, 7]])
    model = loaded.model
    cache = model.make_cache(1)
    first = model(ids[:, :4], cache, [0]).logits
    rest = model(ids[:, 4:], cache, [4]).logits
    return mx.concatenate([first, rest], axis=1)


def _bytes(loaded: LoadedModel) -> int:
    return sum(v.nbytes for _, v in tree_flatten(loaded.model.parameters()))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_kept_model_computes_what_its_float_twin_does(
    tmp_path: Path, arch: str
) -> None:
    path = _tiny(tmp_path, Q.Q4_0, arch)
    plain = load(str(path), gguf_quantized=False).unwrap()
    kept = load(str(path)).unwrap()  # the default keeps a GGUF's blocks
    assert isinstance(plain.model.model.layers[0].mlp.down_proj, nn.Linear)
    layer = kept.model.model.layers[0]
    assert isinstance(layer.mlp.down_proj, nn.QuantizedLinear)
    asked = load(str(path), gguf_quantized=True).unwrap()
    assert isinstance(asked.model.model.layers[0].mlp.down_proj, nn.QuantizedLinear)
    assert isinstance(kept.model.model.embed_tokens, nn.QuantizedEmbedding)
    assert _bytes(kept) < _bytes(plain) / 3
    # the same weights; float32 sums in another order (the CPU's affine
    # kernel unpacks them, models/kernels/affine_matmul.c): logits up to ~20
    np.testing.assert_allclose(
        np.array(_logits(kept)), np.array(_logits(plain)), rtol=1e-5, atol=1e-4
    )


def test_a_kept_model_converts_to_a_quantized_folder(tmp_path: Path) -> None:
    path = _tiny(tmp_path, Q.Q8_0)
    kept = load(str(path), gguf_quantized=True).unwrap()
    out = save_folder(kept, tmp_path / "out")
    assert isinstance(out, Success), out
    config = (tmp_path / "out" / "config.json").read_text()
    assert '"group_size": 32' in config and '"bits": 8' in config
    again = load(str(tmp_path / "out")).unwrap()
    assert isinstance(again.model.model.layers[1].self_attn.o_proj, nn.QuantizedLinear)
    np.testing.assert_array_equal(np.array(_logits(again)), np.array(_logits(kept)))


def test_keeping_needs_a_gguf(tmp_path: Path) -> None:
    folder = tmp_path / "folder"
    folder.mkdir()
    result = load(str(folder), gguf_quantized=True)
    assert isinstance(result, Failure)
    message = result.failure().message
    assert "needs a .gguf file or a fixture" in message and "--quantize N" in message
    missing = load(str(tmp_path / "none.gguf"), gguf_quantized=True)
    assert (
        isinstance(missing, Failure)
        and "no such GGUF file" in missing.failure().message
    )


def test_the_command_keeps_a_gguf_quantized(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`convert --quantize keep` writes the kept blocks; `generate` keeps
    them by default (`--gguf-quantized` asks the same) and decodes what the
    float import (`--no-gguf-quantized`) decodes; keeping a folder's weights
    is refused with the fix named."""
    from tests.cli.conftest import run as cli

    run = functools.partial(cli, capsys)

    path = _tiny(tmp_path, Q.Q4_1)
    out = tmp_path / "kept"
    assert run("convert", str(path), str(out), "--quantize", "keep")[0] == 0
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 4}
    texts = [
        json.loads(
            run(
                "generate", "ab", "--model", model, "--max-tokens", "6", "--json", *flag
            )[1]
        )
        for model, flag in (
            (str(path), ("--no-gguf-quantized",)),
            (str(path), ("--gguf-quantized",)),
            (str(out), ()),
            (str(path), ()),
        )
    ]
    assert len({tuple(t["tokens"]) for t in texts}) == 1
    code, _, err = run(
        "convert", str(out), str(tmp_path / "again"), "--quantize", "keep"
    )
    assert code != 0 and "needs a .gguf file or a fixture" in err
    assert not (tmp_path / "again").exists()


def test_a_two_model_draft_kept_quantized_is_plain_decoding(tmp_path: Path) -> None:
    """With `gguf_quantized` a GGUF draft keeps its blocks too, and the output
    is the target's own."""
    from schemas.request import GenerationLimits, SamplingParams
    from specpipe.api import load as load_pipeline

    target = _tiny(tmp_path, Q.Q8_0)
    tokens, _ = tiny_tokens()
    draft = tmp_path / "draft.gguf"
    write_tiny_gguf(draft, tiny_weights(9, len(tokens)), qtype=Q.Q4_1)
    spec = load_pipeline(
        str(target),
        draft=str(draft),
        num_draft_tokens=3,
        adaptive=False,
        gguf_quantized=True,
    ).unwrap()
    assert spec.draft is not None
    layer = spec.draft.model.model.layers[0]
    assert isinstance(layer.mlp.down_proj, nn.QuantizedLinear)
    plain = load_pipeline(str(target), adaptive=False).unwrap()
    for sampling in (SamplingParams(), SamplingParams(temperature=0.8, seed=3)):
        limits = GenerationLimits(max_tokens=12)
        want = plain.generate("abc", sampling, limits).unwrap()
        got = spec.generate("abc", sampling, limits).unwrap()
        assert got.tokens == want.tokens and got.stats.drafted > 0


def test_a_kept_model_is_calibrated_apart_from_its_float_twin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One .gguf loaded kept and dequantized has one source but not one
    cost: their calibrations are cached apart."""
    from specpipe.api import load as load_pipeline

    monkeypatch.setenv("SPECPIPE_CALIBRATION_CACHE", str(tmp_path / "costs"))
    path = _tiny(tmp_path, Q.Q4_0)
    for kept in (False, True, False, True):
        load_pipeline(
            str(path), draft="ngram", num_draft_tokens=2, gguf_quantized=kept
        ).unwrap()
    assert len(list((tmp_path / "costs").glob("*.json"))) == 2


# (on the CPU: MLX's GPU dequantize rounds otherwise, not bit-equal to the
# CPU's on an H100, 2026-12-06; the CPU kernel rounds as the CPU's does)
@pytest.mark.usefixtures("cpu_default")
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_the_own_dequantization_is_mlxs(bits: int, group: int) -> None:
    """`models.parallel.dequantized` (any group size: Q6_K's 16 off the CPU
    kernel) gives MLX's own dequantized weights where MLX takes the groups."""
    mx.random.seed(bits * group)
    packed, scales, biases = mx.quantize(
        mx.random.normal((7, 512)), group_size=group, bits=bits
    )
    assert mx.array_equal(
        dequantized(packed, scales, biases, group, bits),
        mx.dequantize(packed, scales, biases, group_size=group, bits=bits),
    ).item()


def _k_blocks(
    rows: int, width: int, seed: int, qtype: GGMLQuantizationType = Q.Q6_K
) -> np.ndarray:
    """Random rows of a K type [rows, width / 256 * block bytes] with small
    scales."""
    raw = random_blocks(qtype, rows, width, seed)
    return raw.reshape(rows, -1)


def _tiny_q6_k(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    arch: str,
    qtype: GGMLQuantizationType = Q.Q6_K,
) -> tuple[Path, dict[str, np.ndarray]]:
    """A GGUF mixed as llama.cpp's Q4_K_M mixes: the MLP's down projections
    and the head (llama: the tied embedding) Q6_K (or `qtype`, another K
    type of groups of 16), the rest Q8_0 (widths of 256, whole K blocks).
    Returns the file and the weights a reader must give back."""
    import gguf_support

    for key, value in (
        ("hidden_size", 256),
        ("intermediate_size", 256),
        ("num_attention_heads", 16),
        ("num_key_value_heads", 4),
    ):
        monkeypatch.setitem(gguf_support.TINY, key, value)
    tokens, _ = tiny_tokens()
    tied = arch == "llama"
    weights = tiny_weights(4, len(tokens), model_type=arch, tied=tied)
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    six = [head] + [n for n in weights if n.endswith("mlp.down_proj.weight")]
    blocks = {
        name: (_k_blocks(*weights[name].shape, seed=i, qtype=qtype), qtype)
        for i, name in enumerate(six)
    }
    path = tmp_path / f"tiny-{arch}-{qtype.name}.gguf"
    expected = write_tiny_gguf(path, weights, arch=arch, qtype=Q.Q8_0, blocks=blocks)
    return path, expected


@pytest.mark.usefixtures("cpu_default")
@pytest.mark.parametrize(
    ("arch", "qtype"),
    [("llama", Q.Q6_K), ("qwen2", Q.Q6_K), ("llama", Q.Q3_K), ("qwen2", Q.Q2_K)],
    ids=lambda v: getattr(v, "name", v),
)
def test_k_matrices_are_kept_in_groups_of_16(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    arch: str,
    qtype: GGMLQuantizationType,
) -> None:
    """Q6_K (Q3_K, Q2_K) matrices come as 6-bit (3-, 2-bit) groups of 16
    holding llama.cpp's weights exactly (an embedding's looked-up rows too);
    the kept model computes what its float twin does on the CPU kernel, and
    the same again where the kernel is not used (the weights expanded for
    each product)."""
    path, expected = _tiny_q6_k(tmp_path, monkeypatch, arch, qtype)
    bits = AFFINE_TYPES[qtype]
    kept = load(str(path)).unwrap()
    plain = load(str(path), gguf_quantized=False).unwrap()
    model = kept.model.model
    down = model.layers[0].mlp.down_proj
    assert isinstance(down, nn.QuantizedLinear)
    assert (down.bits, down.group_size) == (bits, 16)
    assert model.layers[0].self_attn.o_proj.group_size == 32  # Q8_0
    assert cpu_kernel.affine_usable(down.weight, bits, 16, "affine")
    name = "model.layers.1.mlp.down_proj.weight"
    got = dequantized(down.weight, down.scales, down.biases, 16, bits)
    want = expected[name.replace(".1.", ".0.")]
    np.testing.assert_array_equal(np.array(got), want)
    if arch == "llama":
        embed = model.embed_tokens
        assert isinstance(embed, nn.QuantizedEmbedding) and embed.group_size == 16
        ids = mx.array([[3, 0, 7, 3]])
        np.testing.assert_array_equal(
            np.array(embed(ids)),
            expected["model.embed_tokens.weight"][[3, 0, 7, 3]][None],
        )
    assert _bytes(kept) < _bytes(plain) / 2.5
    on_kernel = _logits(kept)
    np.testing.assert_allclose(
        np.array(on_kernel), np.array(_logits(plain)), rtol=1e-5, atol=1e-4
    )
    monkeypatch.setattr(cpu_kernel, "affine_usable", lambda *_a, **_k: False)
    np.testing.assert_allclose(
        np.array(_logits(kept)), np.array(on_kernel), rtol=1e-5, atol=1e-4
    )


@pytest.mark.usefixtures("cpu_default")
def test_groups_of_16_off_the_kernel_multiply_as_their_float_weights() -> None:
    """Where the kernel does not take a product (inside `mx.compile`, where
    nothing can be evaluated), a Q6_K layer's product is its expanded
    weights' float32 product."""
    raw = _k_blocks(40, 512, seed=9)
    packed, scales, biases = (mx.array(a) for a in affine_rows(Q.Q6_K, raw, 512))
    x = mx.random.normal((3, 512))
    eager = project(x, packed, scales, biases, group_size=16, bits=6)
    traced = mx.compile(
        lambda x: project(x, packed, scales, biases, group_size=16, bits=6)
    )(x)
    want = (
        np.asarray(x, dtype=np.float64)
        @ dequantize(raw.reshape(1, -1), Q.Q6_K).reshape(40, 512).astype(np.float64).T
    )
    for got in (eager, traced):
        assert np.allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)


@pytest.mark.usefixtures("cpu_default")
def test_q6_k_folders_keep_or_float_their_groups_of_16(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`convert --quantize keep` writes Q6_K layers as groups of 16 (a
    per-layer entry), which load back to the same logits; `keep-mlx` writes
    them as float (a folder MLX's own quantized layers read whole), the
    same weights."""
    from specpipe.cli import main

    path, _ = _tiny_q6_k(tmp_path, monkeypatch, "qwen2")
    kept = load(str(path)).unwrap()
    main(["convert", str(path), str(tmp_path / "keep"), "--quantize", "keep"])
    config = json.loads((tmp_path / "keep" / "config.json").read_text())
    block = config["quantization"]
    assert block["model.layers.0.mlp.down_proj"] == {"group_size": 16, "bits": 6}
    again = load(str(tmp_path / "keep")).unwrap()
    np.testing.assert_array_equal(np.array(_logits(again)), np.array(_logits(kept)))

    main(["convert", str(path), str(tmp_path / "mlx"), "--quantize", "keep-mlx"])
    assert "3 matrices in groups of 16 written as float" in capsys.readouterr().err
    config = json.loads((tmp_path / "mlx" / "config.json").read_text())
    groups = {
        v["group_size"] for v in config["quantization"].values() if isinstance(v, dict)
    }
    assert 16 not in groups and config["quantization"]["group_size"] == 32
    floated = load(str(tmp_path / "mlx")).unwrap()
    down = floated.model.model.layers[0].mlp.down_proj
    assert type(down).__name__ == "Linear" and down.weight.dtype == mx.float32
    np.testing.assert_allclose(
        np.array(_logits(floated)), np.array(_logits(kept)), rtol=1e-5, atol=1e-4
    )
    # MLX's own dequantize takes every quantized layer of it
    weights = mx.load(str(tmp_path / "mlx" / "model.safetensors"))
    scaled = [n.removesuffix(".scales") for n in weights if n.endswith(".scales")]
    assert scaled
    for base in scaled:
        values = mx.dequantize(
            weights[f"{base}.weight"], weights[f"{base}.scales"],
            weights[f"{base}.biases"], group_size=32, bits=8,
        )  # fmt: skip
        mx.eval(values)


@pytest.mark.usefixtures("cpu_default")
def test_groups_of_16_load_as_float_where_the_kernel_does_not_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Off the CPU kernel (here: a CPU without it; a GPU alike) `load` expands
    Q6_K's groups of 16 to float once, the other kept blocks staying as they
    are; `checkpoint` (what `convert` writes) keeps them either way."""
    from specpipe.load import checkpoint

    path, expected = _tiny_q6_k(tmp_path, monkeypatch, "qwen2")
    monkeypatch.setattr(cpu_kernel, "available", lambda: False)
    loaded = load(str(path)).unwrap()
    layer = loaded.model.model.layers[0]
    assert type(layer.mlp.down_proj).__name__ == "Linear"
    np.testing.assert_array_equal(
        np.array(layer.mlp.down_proj.weight),
        expected["model.layers.0.mlp.down_proj.weight"],
    )
    assert isinstance(layer.self_attn.o_proj, nn.QuantizedLinear)  # Q8_0
    own = checkpoint(str(path)).unwrap().model.model.layers[0].mlp.down_proj
    assert isinstance(own, nn.QuantizedLinear) and own.group_size == 16


@pytest.mark.usefixtures("cpu_default")
def test_stacked_experts_in_groups_of_16_multiply_on_and_off_the_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A gemma4 GGUF's experts in a K type's groups of 16: the placeholder
    layer `to_quantized` builds takes the checkpoint's arrays; its products
    on the kernel, off it (the chosen experts' weights expanded) and after
    `float_other_groups` (float experts, as `load` makes them off the
    kernel) are the float32 sums of the weights."""
    from models.build import float_other_groups
    from models.qwen3_next import QuantizedSwitchLinear, SwitchLinear

    experts, rows, width = 4, 24, 512
    raw = _k_blocks(experts * rows, width, seed=11)
    packed, scales, biases = affine_rows(Q.Q6_K, raw.reshape(-1), width)
    holder = nn.Module()
    holder.proj = SwitchLinear(width, rows, experts).to_quantized(16, 6)
    layer = holder.proj
    assert isinstance(layer, QuantizedSwitchLinear) and layer.group_size == 16
    assert layer.weight.shape == (experts, rows, width * 6 // 32)
    layer.weight = mx.array(packed.reshape(experts, rows, -1))
    layer.scales = mx.array(scales.reshape(experts, rows, -1))
    layer.biases = mx.array(biases.reshape(experts, rows, -1))
    float_weights = dequantize(raw.reshape(1, -1), Q.Q6_K).reshape(experts, rows, width)
    x = mx.random.normal((5, 1, 1, width))
    chosen = mx.array([[0, 3], [1, 1], [2, 0], [3, 2], [1, 0]])
    want = np.einsum(
        "ni,nkoi->nko",
        np.asarray(x, dtype=np.float64)[:, 0, 0],
        float_weights.astype(np.float64)[np.asarray(chosen)],
    )

    def close(got: mx.array) -> None:
        assert got.shape == (5, 2, 1, rows)
        assert np.allclose(np.asarray(got)[:, :, 0], want, rtol=1e-5, atol=1e-4)

    close(layer(x, chosen))
    with monkeypatch.context() as patch:
        patch.setattr(cpu_kernel, "affine_usable", lambda *_a, **_k: False)
        close(layer(x, chosen))
    assert float_other_groups(holder) == 1
    assert isinstance(holder.proj, SwitchLinear)
    close(holder.proj(x, chosen))


@pytest.mark.usefixtures("cpu_default")
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_values_pack_as_mlx_reads_them(bits: int) -> None:
    """The packing (whole bytes at 2, 4, 6 and 8 bits, 64-bit words of eight
    at 3 and 5) is MLX's: its dequantize with unit scales gives the values."""
    rng = np.random.default_rng(bits)
    values = rng.integers(0, 1 << bits, (5, 256), dtype=np.uint8)
    packed = gguf_quant._pack(values, bits)
    assert packed.dtype == np.uint32 and packed.shape == (5, 256 * bits // 32)
    ones, zeros = mx.ones((5, 8)), mx.zeros((5, 8))
    got = mx.dequantize(mx.array(packed), ones, zeros, group_size=32, bits=bits)
    np.testing.assert_array_equal(np.array(got), values.astype(np.float32))


@pytest.mark.usefixtures("cpu_default")
def test_each_quantized_form_is_calibrated_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The calibration cache's key names every form of quantized layer, the
    target's and a draft model's: a GGUF with its Q6_K layers kept and the
    same with them float (the earlier kept form, `keep-mlx`) share their most
    common form (Q8_0) and not their cost."""
    from models.build import float_other_groups
    from specpipe.api import _precision_key

    path, _ = _tiny_q6_k(tmp_path, monkeypatch, "qwen2")
    kept = load(str(path)).unwrap()
    key = _precision_key(kept, None)
    assert key == "native/q6g16x3,q8g32x13"
    floated = load(str(path)).unwrap()
    assert float_other_groups(floated.model) == 3
    assert _precision_key(floated, None) == "native/q8g32x13"
    assert _precision_key(kept, "float32", floated.model) == (
        "float32/q6g16x3,q8g32x13/draft:q8g32x13"
    )
    plain = load(str(path), gguf_quantized=False).unwrap()
    assert _precision_key(plain, None) == "native"


def test_a_kept_fixture_folder_of_an_earlier_form_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fixture's kept folder is converted again in the current form
    (`KEPT_FORM`: Q6_K kept since 2) and the earlier forms' folders are
    removed once the new one is written; the float folder is left alone."""
    import importlib

    spload = importlib.import_module(
        "specpipe.load"
    )  # (the package's `load` is a function)
    path = _tiny(tmp_path, Q.Q4_0)
    monkeypatch.setattr(spload, "install_fixture", lambda _name: Success(path))
    monkeypatch.setattr(spload, "cache_root", lambda: tmp_path / "cache")
    models = tmp_path / "cache" / "models"
    stale = [models / "tiny-gguf-quantized", models / "tiny-gguf-quantized.v1"]
    for folder in [*stale, models / "tiny"]:
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
    made = spload.fixture_folder("tiny", kept=True).unwrap()
    assert made == models / f"tiny-gguf-quantized.v{spload.KEPT_FORM}"
    assert (made / "config.json").is_file() and any(made.glob("*.safetensors"))
    assert not any(folder.exists() for folder in stale)
    assert (models / "tiny" / "config.json").is_file()
    assert spload.fixture_folder("tiny", kept=True).unwrap() == made  # reused
