"""llama.cpp quant blocks that MLX's affine quantization holds exactly.

MLX affine quantization stores, per group of `group_size` values of a row,
unsigned integers q with one scale s and one bias b: w = s * q + b. Seven
llama.cpp block types are that form with groups of 32:

- Q4_0 (32 values, 18 bytes): an fp16 scale d, then 16 bytes of nibbles
  (byte j: value j low, value j + 16 high); w = d * (q - 8): s = d, b = -8d.
- Q4_1 (32 values, 20 bytes): fp16 d and m, then the same nibbles;
  w = d * q + m: s = d, b = m.
- Q8_0 (32 values, 34 bytes): fp16 d, then 32 signed bytes; w = d * q:
  q + 128 at 8 bits, s = d, b = -128d.
- Q4_K (256 values, 144 bytes): fp16 d and dmin, 12 bytes packing eight
  6-bit scales and eight 6-bit mins, then 128 bytes of nibbles (each 32 bytes
  hold two sub-blocks of 32: low nibbles the first, high the second);
  w = d * sc * q - dmin * m: s = d * sc, b = -dmin * m per sub-block.
- Q5_0 / Q5_1 (32 values, 22 / 24 bytes): Q4_0's / Q4_1's layout with a
  32-bit word of fifth bits (bit j: value j's) before the nibbles;
  Q5_0: w = d * (q - 16): s = d, b = -16d; Q5_1: s = d, b = m.
- Q5_K (256 values, 176 bytes): Q4_K with 32 bytes of fifth bits before
  the nibbles (byte l, bit k: value l of sub-block k).

Three K types are that form with groups of 16 (sub-blocks of 16 values,
each with its own scale):

- Q6_K (256 values, 210 bytes: 128 bytes of low nibbles, 64 of high bit
  pairs, sixteen signed 8-bit scales, fp16 d) at 6 bits:
  w = d * sc * (q - 32): s = d * sc, b = -32 s.
- Q3_K (256 values, 110 bytes: 32 bytes of high bits, 64 of low bit pairs,
  12 packing sixteen 6-bit scales, fp16 d) at 3 bits:
  w = d * (sc - 32) * (q - 4): s = d * (sc - 32), b = -4 s.
- Q2_K (256 values, 84 bytes: sixteen bytes of a 4-bit scale and a 4-bit
  min, 64 of bit pairs, fp16 d and dmin) at 2 bits:
  w = d * sc * q - dmin * m: s = d * sc, b = -dmin * m.

MLX's products take groups of 32, 64 and 128 (not 16 throughout); specpipe's CPU
kernel multiplies groups of 16 as they are, and elsewhere `load` expands
them to float once (models/parallel.py, specpipe/load.py). So a kept Q6_K
matrix costs 1.25 bytes a weight instead of float32's 4 (Q3_K 0.875, Q2_K
0.75).

Scales and biases are float32, where each of these products is exact (an
fp16 value times an integer below 64, or times a signed 8-bit scale and
then an integer of at most 6 bits: at most 24 significant bits), so the
weights dequantize to exactly the values llama.cpp's own dequantization
gives (tests/models/test_gguf_quant.py checks against the `gguf` package's).
Other types (the IQ types, floats) have no such form here and load
dequantized.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

__all__ = ["AFFINE_TYPES", "GROUP_SIZES", "affine_rows", "read_affine", "row_blocks"]

Q = GGMLQuantizationType
# type -> MLX bits
AFFINE_TYPES: dict[GGMLQuantizationType, int] = {
    Q.Q4_0: 4,
    Q.Q4_1: 4,
    Q.Q4_K: 4,
    Q.Q5_0: 5,
    Q.Q5_1: 5,
    Q.Q5_K: 5,
    Q.Q6_K: 6,
    Q.Q8_0: 8,
    Q.Q2_K: 2,
    Q.Q3_K: 3,
}
# type -> MLX group size (32 unless listed)
GROUP_SIZES: dict[GGMLQuantizationType, int] = {Q.Q2_K: 16, Q.Q3_K: 16, Q.Q6_K: 16}
# raw bytes converted at a time (a row block; packing takes ~16 bytes a value)
_CHUNK_BYTES = 1 << 22

Affine = tuple[np.ndarray, np.ndarray, np.ndarray]  # packed uint32, scales, biases


def _half(blocks: np.ndarray, at: int) -> np.ndarray:  # [n, 1] float32
    return blocks[:, at : at + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:  # [n, 16] bytes -> [n, 32]
    return np.concatenate([qs & 15, qs >> 4], axis=1)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's eight 6-bit scales and mins from its 12 bytes: [n, 8] each.
    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales
    4-7; bytes 4-7 the same for the mins; bytes 8-11 the low 4 bits of
    scales 4-7 (low nibble) and of mins 4-7 (high nibble)."""
    p = packed.astype(np.int32)
    low_sc, low_m, rest = p[:, 0:4], p[:, 4:8], p[:, 8:12]
    scales = np.concatenate([low_sc & 63, (rest & 15) | ((low_sc >> 6) << 4)], axis=1)
    mins = np.concatenate([low_m & 63, (rest >> 4) | ((low_m >> 6) << 4)], axis=1)
    return scales, mins


def _fifth_bits(qh: np.ndarray) -> np.ndarray:  # [n, 4] bytes -> [n, 32] of 0 / 16
    """Q5_0's / Q5_1's high bits: bit j of the little-endian word is value j's."""
    bits = np.unpackbits(qh, axis=1, bitorder="little")
    return (bits << 4).astype(np.uint8)


def _q6_k(blocks: np.ndarray) -> Affine:
    """Q6_K's values [16n, 16] with scales and biases [16n, 1]. Each half of
    a block (64 bytes of low nibbles, 32 of high bit pairs) holds 128
    values: value 32k + l (k < 4, l < 32) takes low nibble byte l (k even)
    or l + 32 (k odd), its low half for k < 2, its high half else, and bits
    2k, 2k + 1 of high byte l. Value v's scale is sc[v // 16]."""
    low, high = blocks[:, :128], blocks[:, 128:192]
    sc = blocks[:, 192:208].view(np.int8).astype(np.float32)  # [n, 16]
    d = _half(blocks, 208)
    halves = []
    for h in range(2):
        ql = low[:, 64 * h : 64 * h + 64]
        qh = high[:, 32 * h : 32 * h + 32]
        nibbles = (ql[:, :32] & 15, ql[:, 32:] & 15, ql[:, :32] >> 4, ql[:, 32:] >> 4)
        halves += [
            nibbles[k] | (((qh >> (2 * k)) & 3) << 4) for k in range(4)
        ]  # each [n, 32]
    values = np.stack(halves, axis=1).reshape(-1, 16)  # [n * 16, 16]
    scales = (d * sc).reshape(-1, 1)
    return values, scales, -32 * scales


def _bit_pairs(qs: np.ndarray) -> list[np.ndarray]:
    """Q2_K's / Q3_K's 2-bit values: each half of a block (32 bytes) holds
    128 values, value 32j + l of the half (j < 4, l < 32) in bits 2j, 2j + 1
    of byte l. Eight [n, 32] arrays in value order."""
    return [
        (qs[:, 32 * h : 32 * h + 32] >> (2 * j)) & 3 for h in range(2) for j in range(4)
    ]


def _q3_k(blocks: np.ndarray) -> Affine:
    """Q3_K's values [16n, 16] with scales and biases [16n, 1]. Value v's
    third bit is bit 4h + j of high byte l (its half h, j and l as in
    `_bit_pairs`); scale i's low nibble is byte i's (i < 8) or byte i - 8's
    high one, its top two bits those at 2 (i // 4) of byte 8 + i % 4."""
    hmask, qs, packed = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108]
    low = np.concatenate([packed[:, :8] & 15, packed[:, :8] >> 4], axis=1)
    top = np.concatenate([(packed[:, 8:12] >> (2 * k)) & 3 for k in range(4)], axis=1)
    sc = (low | (top << 4)).astype(np.float32) - 32
    third = [(hmask >> k) & 1 for k in range(8)]  # k = 4h + j, in value order
    pairs = _bit_pairs(qs)
    values = np.stack([p | (t << 2) for p, t in zip(pairs, third, strict=True)], axis=1)
    scales = (_half(blocks, 108) * sc).reshape(-1, 1)
    return values.reshape(-1, 16), scales, -4 * scales


def _q2_k(blocks: np.ndarray) -> Affine:
    """Q2_K's values [16n, 16] with scales and biases [16n, 1]: sub-block i's
    scale the low nibble of byte i, its min the high one."""
    sc, mins = blocks[:, :16] & 15, blocks[:, :16] >> 4
    values = np.stack(_bit_pairs(blocks[:, 16:80]), axis=1).reshape(-1, 16)
    d, dmin = _half(blocks, 80), _half(blocks, 82)
    return (
        values,
        (d * sc.astype(np.float32)).reshape(-1, 1),
        (-(dmin * mins.astype(np.float32))).reshape(-1, 1),
    )


def _groups(qtype: GGMLQuantizationType, raw: np.ndarray) -> Affine:
    """Unpacked values [G, group] (uint8; group 32, `GROUP_SIZES`'s 16) with their
    scales and biases [G, 1], G groups in row order, from whole blocks of
    `qtype`."""
    _, size = GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(-1, size)
    if qtype == Q.Q6_K:
        return _q6_k(blocks)
    if qtype == Q.Q3_K:
        return _q3_k(blocks)
    if qtype == Q.Q2_K:
        return _q2_k(blocks)
    if qtype == Q.Q4_0:
        d = _half(blocks, 0)
        return _nibbles(blocks[:, 2:18]), d, -8 * d
    if qtype == Q.Q4_1:
        return _nibbles(blocks[:, 4:20]), _half(blocks, 0), _half(blocks, 2)
    if qtype == Q.Q5_0:
        d = _half(blocks, 0)
        values = _nibbles(blocks[:, 6:22]) | _fifth_bits(blocks[:, 2:6])
        return values, d, -16 * d
    if qtype == Q.Q5_1:
        values = _nibbles(blocks[:, 8:24]) | _fifth_bits(blocks[:, 4:8])
        return values, _half(blocks, 0), _half(blocks, 2)
    if qtype == Q.Q8_0:
        d = _half(blocks, 0)
        signed = blocks[:, 2:34].view(np.int8).astype(np.int16)
        return (signed + 128).astype(np.uint8), d, -128 * d
    assert qtype in (Q.Q4_K, Q.Q5_K), qtype
    d, dmin = _half(blocks, 0), _half(blocks, 2)
    sc, mins = _k_scales(blocks[:, 4:16])
    qs = blocks[:, -128:].reshape(-1, 4, 1, 32)
    values = np.concatenate([qs & 15, qs >> 4], axis=2)  # [n, 4 chunks, 2, 32]
    if qtype == Q.Q5_K:
        # byte l of the 32, bit k: the fifth bit of value l of sub-block k
        high = np.unpackbits(blocks[:, 16:48, None], axis=2, bitorder="little")
        values = values | (high.transpose(0, 2, 1).reshape(-1, 4, 2, 32) << 4)
    return (
        values.reshape(-1, 32),
        (d * sc).reshape(-1, 1),
        (-(dmin * mins)).reshape(-1, 1),
    )


def _pack(values: np.ndarray, bits: int) -> np.ndarray:  # [R, W] -> [R, W * bits / 32]
    """MLX's packing: a little-endian bit stream of `bits`-bit values (value
    i at bit i * bits), read as uint32 words. Whole bytes where the values
    fill them (8 bits: a byte each; 2 and 4: 4 and 2 to a byte; 6: four in
    three bytes), else each eight summed into one 64-bit word (value k
    shifted by k * bits) whose low `bits` bytes, little-endian, are theirs
    (3 and 5 bits)."""
    rows = values.shape[0]
    small = values.reshape(rows, -1).astype(np.uint8, copy=False)
    stream: np.ndarray
    if bits == 8:
        stream = small
    elif bits in (2, 4):
        per = 8 // bits
        grouped = small.reshape(rows, -1, per)
        stream = grouped[..., 0].copy()
        for k in range(1, per):
            stream |= grouped[..., k] << np.uint8(k * bits)
    elif bits == 6:
        v = small.reshape(rows, -1, 4)
        stream = np.empty((rows, v.shape[1], 3), dtype=np.uint8)
        stream[..., 0] = v[..., 0] | (v[..., 1] << np.uint8(6))
        stream[..., 1] = (v[..., 1] >> np.uint8(2)) | (v[..., 2] << np.uint8(4))
        stream[..., 2] = (v[..., 2] >> np.uint8(4)) | (v[..., 3] << np.uint8(2))
    else:
        eights = small.reshape(rows, -1, 8).astype("<u8")
        word = eights[..., 0].copy()
        for k in range(1, 8):
            word |= eights[..., k] << np.uint64(k * bits)
        stream = word.view(np.uint8).reshape(rows, -1, 8)[..., :bits]
    words: np.ndarray = np.ascontiguousarray(stream).reshape(rows, -1).view("<u4")
    return words


def affine_rows(qtype: GGMLQuantizationType, raw: np.ndarray, width: int) -> Affine:
    """Whole rows of `width` values of `qtype` (raw bytes, uint8) as MLX
    affine arrays: packed [R, width * bits / 32] uint32, scales and biases
    [R, width / group] float32 (`GROUP_SIZES`)."""
    bits = AFFINE_TYPES[qtype]
    values, scales, biases = _groups(qtype, raw)
    rows = values.size // width
    return (
        _pack(values.reshape(rows, width), bits),
        scales.reshape(rows, -1).astype(np.float32),
        biases.reshape(rows, -1).astype(np.float32),
    )


def row_blocks(
    fd: int,
    qtype: GGMLQuantizationType,
    rows: int,
    width: int,
    offset: int,
    step: int,
    what: str = "tensor",
) -> Iterator[tuple[int, int, np.ndarray]]:
    """A tensor of `rows` rows of `width` values of `qtype` at `offset` of the
    open file, `step` rows at a time: (first row, row count, raw bytes as one
    flat uint8 array of whole blocks). A short read is a ValueError naming
    `what`."""
    block, size = GGML_QUANT_SIZES[qtype]
    row_bytes = width // block * size
    for start in range(0, rows, step):
        count = min(step, rows - start)
        want = count * row_bytes
        raw = os.pread(fd, want, offset + start * row_bytes)
        if len(raw) != want:
            raise ValueError(f"{what}: short read ({len(raw)} of {want} bytes)")
        yield start, count, np.frombuffer(raw, dtype=np.uint8)


def read_affine(
    fd: int,
    qtype: GGMLQuantizationType,
    shape: tuple[int, ...],
    offset: int,
    what: str = "tensor",
) -> Affine:
    """A 2-D tensor of `shape` [R, W] at `offset` of the open file, as
    `affine_rows` gives it, read a row block at a time."""
    block, size = GGML_QUANT_SIZES[qtype]
    rows, width = shape
    step = max(1, _CHUNK_BYTES // (width // block * size))
    parts = [
        affine_rows(qtype, raw, width)
        for _, _, raw in row_blocks(fd, qtype, rows, width, offset, step, what)
    ]
    packed, scales, biases = (np.concatenate(p) for p in zip(*parts, strict=True))
    return packed, scales, biases
