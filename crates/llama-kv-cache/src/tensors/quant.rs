//! Row conversion between `f32` and the storage types a KV cache can hold.
//!
//! Quantization follows ggml's reference quantizers (`quantize_row_*_ref` in
//! `ggml/src/ggml-quants.c`) bit for bit, in plain f32 arithmetic without fused multiply-adds.
//! For q4_0, q4_1, q5_0, q5_1 and iq4_nl the reference is also what ggml's CPU backend runs
//! when it copies f32 into a tensor of that type, as llama.cpp does to store K and V. For q8_0
//! the CPU backend has SIMD versions instead (AVX: inverse scale `127/amax`, ties rounded to
//! even; NEON: ties rounded to even), which put about one block in ten thousand of random data
//! one level away from the reference; this module implements the reference.
//!
//! Dequantization follows ggml's `dequantize_row_*` (and the `GGML_FP16_TO_FP32` /
//! `GGML_BF16_TO_FP32` conversions for the float types).
//!
//! Every quantized type stores blocks of 32 elements:
//!
//! | type     | bytes | layout                            | value          |
//! |----------|-------|-----------------------------------|----------------|
//! | `q4_0`   | 18    | `f16 d; u8 qs[16]`                | `(q-8)*d`      |
//! | `q4_1`   | 20    | `f16 d; f16 m; u8 qs[16]`         | `q*d + m`      |
//! | `q5_0`   | 22    | `f16 d; u32 qh; u8 qs[16]`        | `(q-16)*d`     |
//! | `q5_1`   | 24    | `f16 d; f16 m; u32 qh; u8 qs[16]` | `q*d + m`      |
//! | `q8_0`   | 34    | `f16 d; i8 qs[32]`                | `q*d`          |
//! | `iq4_nl` | 18    | `f16 d; u8 qs[16]`                | `d*kvalues[q]` |
//!
//! In the 4- and 5-bit types element `j < 16` is the low nibble of `qs[j]` and element
//! `j + 16` its high nibble; bit `j` of the little-endian `qh` is the fifth bit of element `j`.
//! All multi-byte fields are little-endian.

use crate::error::{KvError, Result};
use crate::ggml_type::GgmlType;
use half::f16;
use half::slice::HalfFloatSliceExt;

/// Elements per block of every quantized type.
const QK: usize = 32;
/// Half a block: the nibble split of `qs`.
const HALF: usize = QK / 2;

/// The iq4_nl codebook (`kvalues_iq4nl` in ggml-common.h).
const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// [`KVALUES_IQ4NL`] as floats, as C's usual arithmetic conversions see them.
const KVALUES_IQ4NL_F32: [f32; 16] = {
    let mut out = [0.0f32; 16];
    let mut i = 0;
    while i < 16 {
        out[i] = KVALUES_IQ4NL[i] as f32;
        i += 1;
    }
    out
};

/// ggml's `GROUP_MAX_EPS`: below this absolute maximum an iq4_nl block counts as all zero.
const GROUP_MAX_EPS: f32 = 1e-15;

/// The `ntry` that `quantize_row_iq4_nl_ref` passes to `quantize_row_iq4_nl_impl`: no scale
/// search. This is the quantizer ggml's CPU backend uses when it copies f32 into an iq4_nl
/// tensor (`from_float`), hence what llama.cpp writes into an iq4_nl KV cache. The model-file
/// quantizer `quantize_iq4_nl` passes 7 instead.
const IQ4_NL_REF_NTRY: i32 = -1;

/// Elements converted per step of the f16 paths (a stack buffer, no allocation).
const F16_CHUNK: usize = 256;

/// Converts one row stored as `ty` into f32. `src.len()` must equal `ty.row_size(dst.len())`.
///
/// The float types are widened exactly (`f16`, `bf16`) or copied (`f32`, little-endian); the
/// quantized types are expanded block by block with ggml's `dequantize_row_*` arithmetic.
///
/// # Errors
///
/// [`KvError::InvalidArg`] when `dst.len()` is not a multiple of the block size of `ty` or
/// `src.len()` is not the row size of `dst.len()` elements.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    check_row_len("dequantize_row", ty, dst.len(), src.len())?;
    match ty {
        GgmlType::F32 => {
            for (y, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *y = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => f16_bytes_to_f32(src, dst),
        GgmlType::Bf16 => {
            for (y, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *y = bf16_bits_to_f32(u16::from_le_bytes([b[0], b[1]]));
            }
        }
        GgmlType::Q4_0 => dequantize_blocks(src, dst, 18, dequantize_block_q4_0),
        GgmlType::Q4_1 => dequantize_blocks(src, dst, 20, dequantize_block_q4_1),
        GgmlType::Q5_0 => dequantize_blocks(src, dst, 22, dequantize_block_q5_0),
        GgmlType::Q5_1 => dequantize_blocks(src, dst, 24, dequantize_block_q5_1),
        GgmlType::Q8_0 => dequantize_blocks(src, dst, 34, dequantize_block_q8_0),
        GgmlType::Iq4Nl => dequantize_blocks(src, dst, 18, dequantize_block_iq4_nl),
    }
    Ok(())
}

/// Converts f32 values into one row of `ty`, bit-exact with ggml's reference quantizers.
/// `dst.len()` must equal `ty.row_size(src.len())`.
///
/// * `f32` is stored as little-endian bytes.
/// * `f16` rounds to nearest, ties to even (ggml's `GGML_FP32_TO_FP16`).
/// * `bf16` rounds to nearest, ties to even, and keeps NaN a NaN by setting its quiet bit
///   (ggml's `GGML_FP32_TO_BF16`).
/// * `q4_0`, `q4_1`, `q5_0`, `q5_1` and `q8_0` follow `quantize_row_<type>_ref` (for q8_0
///   see the module docs on ggml's SIMD variants).
/// * `iq4_nl` follows `quantize_row_iq4_nl_ref`, which is what ggml's CPU backend uses to
///   copy f32 into an iq4_nl tensor: the block scale starts at `max / -127` (`max` the element
///   of largest magnitude), each element takes the nearest codebook value, and the stored scale
///   is the least-squares fit `Σ w·q·x / Σ w·q²` with weights `w = x²`. An all-zero block
///   (largest magnitude below `1e-15`) stores scale 0 and all-zero nibbles.
///
/// # Errors
///
/// [`KvError::InvalidArg`] when `src.len()` is not a multiple of the block size of `ty` or
/// `dst.len()` is not the row size of `src.len()` elements.
pub fn quantize_row(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<()> {
    check_row_len("quantize_row", ty, src.len(), dst.len())?;
    match ty {
        GgmlType::F32 => {
            for (b, x) in dst.chunks_exact_mut(4).zip(src) {
                b.copy_from_slice(&x.to_le_bytes());
            }
        }
        GgmlType::F16 => f32_to_f16_bytes(src, dst),
        GgmlType::Bf16 => {
            for (b, &x) in dst.chunks_exact_mut(2).zip(src) {
                b.copy_from_slice(&f32_to_bf16_bits(x).to_le_bytes());
            }
        }
        GgmlType::Q4_0 => quantize_blocks(src, dst, 18, quantize_block_q4_0),
        GgmlType::Q4_1 => quantize_blocks(src, dst, 20, quantize_block_q4_1),
        GgmlType::Q5_0 => quantize_blocks(src, dst, 22, quantize_block_q5_0),
        GgmlType::Q5_1 => quantize_blocks(src, dst, 24, quantize_block_q5_1),
        GgmlType::Q8_0 => quantize_blocks(src, dst, 34, quantize_block_q8_0),
        GgmlType::Iq4Nl => quantize_blocks(src, dst, 18, |x, out| {
            quantize_block_iq4_nl(x, out, IQ4_NL_REF_NTRY)
        }),
    }
    Ok(())
}

/// Checks that `bytes` is the row size of `n` elements of `ty`.
fn check_row_len(what: &str, ty: GgmlType, n: usize, bytes: usize) -> Result<()> {
    let expected = ty.row_size(n)?;
    if bytes != expected {
        return Err(KvError::InvalidArg(format!(
            "{what}: a {ty} row of {n} elements takes {expected} bytes, got a buffer of {bytes} bytes"
        )));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Scalar helpers

/// `GGML_FP32_TO_FP16`: round to nearest, ties to even.
#[inline]
fn fp16_bytes(x: f32) -> [u8; 2] {
    f16::from_f32(x).to_bits().to_le_bytes()
}

/// `GGML_FP16_TO_FP32` of the little-endian half at `b[0..2]` (exact).
#[inline]
fn fp16_at(b: &[u8]) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
}

/// `GGML_FP32_TO_BF16`: NaN keeps its top bits and gets the quiet bit; everything else
/// rounds to nearest, ties to even (overflowing to infinity).
///
/// `half::bf16::from_f32` gives the same bits (checked in the tests); it is written out here
/// so that the rounding rule is visibly ggml's.
#[inline]
fn f32_to_bf16_bits(x: f32) -> u16 {
    let u = x.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        ((u >> 16) | 64) as u16
    } else {
        (u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16) as u16
    }
}

/// `GGML_BF16_TO_FP32`: the bits shifted into the high half (exact, NaN payload untouched).
#[inline]
fn bf16_bits_to_f32(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// C's float-to-integer conversion as x86's `cvttss2si` performs it: truncation toward zero,
/// and the "integer indefinite" `i32::MIN` for NaN and out-of-range values. ggml stores the
/// result in an 8-bit field (`(int8_t)`, `(uint8_t)` or an implicit `int8_t` assignment); the
/// caller takes the low byte with `as`. For finite inputs every quantizer here stays in range,
/// so this only pins down what C leaves undefined (NaN or infinite inputs).
#[inline]
fn c_float_to_int(v: f32) -> i32 {
    if v.is_nan() || !(-2_147_483_648.0..2_147_483_648.0).contains(&v) {
        i32::MIN
    } else {
        v as i32
    }
}

/// C's `roundf` (halves away from zero) without the libm call that `f32::round` compiles to on
/// baseline x86-64 (it was a fifth of a q8_0 conversion): truncation through an integer is
/// exact below 2^23, and so is the fraction. Larger values, infinities and NaN are already
/// `roundf`'s answer or go to it. The sign of a zero result may differ, which no caller sees:
/// every result is converted to an integer.
#[inline]
fn round_half_away(x: f32) -> f32 {
    if x.is_nan() || x.abs() >= 8_388_608.0 {
        return x.round();
    }
    let t = (x as i32) as f32;
    let frac = x - t;
    // without branches: on data, the comparisons go either way about half the time (the
    // mispredictions made q8_0 12 ns a value); t is never -0.0 (an integer's float), so adding
    // the two 0-or-1 terms gives exactly t, t + 1 or t - 1
    t + f32::from(u8::from(frac >= 0.5)) - f32::from(u8::from(frac <= -0.5))
}

/// The element of largest magnitude (the first one on ties) and that magnitude, as the
/// q4_0/q5_0/iq4_nl quantizers pick it (`if (amax < fabsf(v)) { amax = fabsf(v); max = v; }`).
/// NaN elements are never picked.
#[inline]
fn signed_absmax(x: &[f32; QK]) -> (f32, f32) {
    let mut amax = 0.0f32;
    let mut max = 0.0f32;
    for &v in x {
        let a = v.abs();
        if amax < a {
            amax = a;
            max = v;
        }
    }
    (amax, max)
}

/// Minimum and maximum as q4_1/q5_1 compute them (starting from `FLT_MAX` / `-FLT_MAX`,
/// strict comparisons, so NaN elements are skipped).
#[inline]
fn min_max(x: &[f32; QK]) -> (f32, f32) {
    let mut min = f32::MAX;
    let mut max = -f32::MAX;
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

/// `d ? 1.0f/d : 0.0f`.
#[inline]
fn inverse_or_zero(d: f32) -> f32 {
    if d != 0.0 {
        1.0 / d
    } else {
        0.0
    }
}

// ---------------------------------------------------------------------------------------------
// Float rows

/// f16 little-endian bytes to f32: F16C straight from the bytes where the CPU has it (see
/// `f16_simd` for why not through `half`), else through a stack buffer for `half`'s slice
/// conversion.
fn f16_bytes_to_f32(src: &[u8], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::tensors::f16_simd::f16_to_f32(src, dst) {
        return;
    }
    let mut buf = [f16::ZERO; F16_CHUNK];
    for (s, d) in src.chunks(2 * F16_CHUNK).zip(dst.chunks_mut(F16_CHUNK)) {
        let halves = &mut buf[..d.len()];
        for (h, b) in halves.iter_mut().zip(s.chunks_exact(2)) {
            *h = f16::from_bits(u16::from_le_bytes([b[0], b[1]]));
        }
        halves.convert_to_f32_slice(d);
    }
}

/// f32 to f16 little-endian bytes (round to nearest even): F16C where the CPU has it, else
/// through a stack buffer.
fn f32_to_f16_bytes(src: &[f32], dst: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if crate::tensors::f16_simd::f32_to_f16(src, dst) {
        return;
    }
    let mut buf = [f16::ZERO; F16_CHUNK];
    for (s, d) in src.chunks(F16_CHUNK).zip(dst.chunks_mut(2 * F16_CHUNK)) {
        let halves = &mut buf[..s.len()];
        halves.convert_from_f32_slice(s);
        for (b, h) in d.chunks_exact_mut(2).zip(halves.iter()) {
            b.copy_from_slice(&h.to_bits().to_le_bytes());
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Block drivers

/// Runs `f` over every (block bytes, 32 outputs) pair of a row whose lengths were checked.
#[inline]
fn dequantize_blocks(
    src: &[u8],
    dst: &mut [f32],
    block_bytes: usize,
    f: impl Fn(&[u8], &mut [f32; QK]),
) {
    for (b, y) in src.chunks_exact(block_bytes).zip(dst.chunks_exact_mut(QK)) {
        let y: &mut [f32; QK] = y.try_into().expect("chunks_exact_mut yields QK elements");
        f(b, y);
    }
}

/// Runs `f` over every (32 inputs, block bytes) pair of a row whose lengths were checked.
#[inline]
fn quantize_blocks(
    src: &[f32],
    dst: &mut [u8],
    block_bytes: usize,
    f: impl Fn(&[f32; QK], &mut [u8]),
) {
    for (x, b) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(block_bytes)) {
        let x: &[f32; QK] = x.try_into().expect("chunks_exact yields QK elements");
        f(x, b);
    }
}

// ---------------------------------------------------------------------------------------------
// Dequantization (ggml's dequantize_row_*)

fn dequantize_block_q4_0(b: &[u8], y: &mut [f32; QK]) {
    let d = fp16_at(&b[0..2]);
    let qs = &b[2..18];
    for (j, &q) in qs.iter().enumerate() {
        y[j] = ((q & 0x0f) as i32 - 8) as f32 * d;
        y[j + HALF] = ((q >> 4) as i32 - 8) as f32 * d;
    }
}

fn dequantize_block_q4_1(b: &[u8], y: &mut [f32; QK]) {
    let d = fp16_at(&b[0..2]);
    let m = fp16_at(&b[2..4]);
    let qs = &b[4..20];
    for (j, &q) in qs.iter().enumerate() {
        y[j] = (q & 0x0f) as f32 * d + m;
        y[j + HALF] = (q >> 4) as f32 * d + m;
    }
}

fn dequantize_block_q5_0(b: &[u8], y: &mut [f32; QK]) {
    let d = fp16_at(&b[0..2]);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    for (j, &q) in qs.iter().enumerate() {
        let h0 = ((qh >> j) << 4) & 0x10;
        let h1 = (qh >> (j + 12)) & 0x10;
        y[j] = ((u32::from(q & 0x0f) | h0) as i32 - 16) as f32 * d;
        y[j + HALF] = ((u32::from(q >> 4) | h1) as i32 - 16) as f32 * d;
    }
}

fn dequantize_block_q5_1(b: &[u8], y: &mut [f32; QK]) {
    let d = fp16_at(&b[0..2]);
    let m = fp16_at(&b[2..4]);
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let qs = &b[8..24];
    for (j, &q) in qs.iter().enumerate() {
        let h0 = ((qh >> j) << 4) & 0x10;
        let h1 = (qh >> (j + 12)) & 0x10;
        y[j] = (u32::from(q & 0x0f) | h0) as f32 * d + m;
        y[j + HALF] = (u32::from(q >> 4) | h1) as f32 * d + m;
    }
}

fn dequantize_block_q8_0(b: &[u8], y: &mut [f32; QK]) {
    let d = fp16_at(&b[0..2]);
    for (y, &q) in y.iter_mut().zip(&b[2..34]) {
        *y = f32::from(q as i8) * d;
    }
}

fn dequantize_block_iq4_nl(b: &[u8], y: &mut [f32; QK]) {
    let d = fp16_at(&b[0..2]);
    let qs = &b[2..18];
    for (j, &q) in qs.iter().enumerate() {
        y[j] = d * KVALUES_IQ4NL_F32[usize::from(q & 0x0f)];
        y[j + HALF] = d * KVALUES_IQ4NL_F32[usize::from(q >> 4)];
    }
}

// ---------------------------------------------------------------------------------------------
// Quantization (ggml's quantize_row_*_ref)

/// `quantize_row_q4_0_ref`: `d = max / -8`, `q = min(15, (int8)(x/d + 8.5))`.
fn quantize_block_q4_0(x: &[f32; QK], out: &mut [u8]) {
    let (_, max) = signed_absmax(x);
    let d = max / -8.0;
    let id = inverse_or_zero(d);
    out[0..2].copy_from_slice(&fp16_bytes(d));
    for (j, q) in out[2..18].iter_mut().enumerate() {
        let x0 = x[j] * id;
        let x1 = x[j + HALF] * id;
        let q0 = (c_float_to_int(x0 + 8.5) as i8).min(15) as u8;
        let q1 = (c_float_to_int(x1 + 8.5) as i8).min(15) as u8;
        *q = q0 | (q1 << 4);
    }
}

/// `quantize_row_q4_1_ref`: `d = (max - min) / 15`, `m = min`,
/// `q = min(15, (int8)((x - min)/d + 0.5))`.
fn quantize_block_q4_1(x: &[f32; QK], out: &mut [u8]) {
    let (min, max) = min_max(x);
    let d = (max - min) / 15.0;
    let id = inverse_or_zero(d);
    out[0..2].copy_from_slice(&fp16_bytes(d));
    out[2..4].copy_from_slice(&fp16_bytes(min));
    for (j, q) in out[4..20].iter_mut().enumerate() {
        let x0 = (x[j] - min) * id;
        let x1 = (x[j + HALF] - min) * id;
        let q0 = (c_float_to_int(x0 + 0.5) as i8).min(15) as u8;
        let q1 = (c_float_to_int(x1 + 0.5) as i8).min(15) as u8;
        *q = q0 | (q1 << 4);
    }
}

/// `quantize_row_q5_0_ref`: `d = max / -16`, `q = min(31, (int8)(x/d + 16.5))`.
fn quantize_block_q5_0(x: &[f32; QK], out: &mut [u8]) {
    let (_, max) = signed_absmax(x);
    let d = max / -16.0;
    let id = inverse_or_zero(d);
    out[0..2].copy_from_slice(&fp16_bytes(d));
    let mut qh = 0u32;
    for (j, q) in out[6..22].iter_mut().enumerate() {
        let x0 = x[j] * id;
        let x1 = x[j + HALF] * id;
        let q0 = (c_float_to_int(x0 + 16.5) as i8).min(31) as u8;
        let q1 = (c_float_to_int(x1 + 16.5) as i8).min(31) as u8;
        *q = (q0 & 0x0f) | ((q1 & 0x0f) << 4);
        qh |= u32::from((q0 & 0x10) >> 4) << j;
        qh |= u32::from((q1 & 0x10) >> 4) << (j + HALF);
    }
    out[2..6].copy_from_slice(&qh.to_le_bytes());
}

/// `quantize_row_q5_1_ref`: `d = (max - min) / 31`, `m = min`,
/// `q = (uint8)((x - min)/d + 0.5)` (no clamp in ggml; the value cannot exceed 31).
fn quantize_block_q5_1(x: &[f32; QK], out: &mut [u8]) {
    let (min, max) = min_max(x);
    let d = (max - min) / 31.0;
    let id = inverse_or_zero(d);
    out[0..2].copy_from_slice(&fp16_bytes(d));
    out[2..4].copy_from_slice(&fp16_bytes(min));
    let mut qh = 0u32;
    for (j, q) in out[8..24].iter_mut().enumerate() {
        let x0 = (x[j] - min) * id;
        let x1 = (x[j + HALF] - min) * id;
        let q0 = c_float_to_int(x0 + 0.5) as u8;
        let q1 = c_float_to_int(x1 + 0.5) as u8;
        *q = (q0 & 0x0f) | ((q1 & 0x0f) << 4);
        qh |= u32::from((q0 & 0x10) >> 4) << j;
        qh |= u32::from((q1 & 0x10) >> 4) << (j + HALF);
    }
    out[4..8].copy_from_slice(&qh.to_le_bytes());
}

/// `quantize_row_q8_0_ref`: `d = amax / 127`, `q = roundf(x/d)` (half away from zero).
fn quantize_block_q8_0(x: &[f32; QK], out: &mut [u8]) {
    // MAX(amax, fabsf(v)) is `amax > |v| ? amax : |v|`: a NaN is taken, then replaced by the
    // next element. Spelled out so NaN handling matches too.
    let mut amax = 0.0f32;
    for &v in x {
        let a = v.abs();
        amax = if amax > a { amax } else { a };
    }
    let d = amax / 127.0;
    let id = inverse_or_zero(d);
    out[0..2].copy_from_slice(&fp16_bytes(d));
    for (q, &v) in out[2..34].iter_mut().zip(x) {
        *q = c_float_to_int(round_half_away(v * id)) as u8;
    }
}

/// ggml's `best_index_int8(16, kvalues_iq4nl, x)`: the codebook index nearest to `x`, found by
/// bisection; the final tie-break `x - v[mu-1] < v[mu] - x` is evaluated in f32 exactly as
/// ggml does (an exact midpoint goes to the upper value; NaN ends on index 15).
#[inline]
fn best_index_iq4_nl(x: f32) -> u8 {
    let v = &KVALUES_IQ4NL_F32;
    if x <= v[0] {
        return 0;
    }
    if x >= v[15] {
        return 15;
    }
    let (mut ml, mut mu) = (0usize, 15usize);
    while mu - ml > 1 {
        let mav = (ml + mu) / 2;
        if x < v[mav] {
            mu = mav;
        } else {
            ml = mav;
        }
    }
    if x - v[mu - 1] < v[mu] - x {
        (mu - 1) as u8
    } else {
        mu as u8
    }
}

/// Weighted sums `(Σ w·q·x, Σ w·q²)` with `w = x²` for the codebook indices of `id * x`,
/// accumulated in element order like ggml. Writes the indices to `l` when given.
#[inline]
fn iq4_nl_fit(
    x: &[f32; QK],
    weight: &[f32; QK],
    id: f32,
    mut l: Option<&mut [u8; QK]>,
) -> (f32, f32) {
    let mut sumqx = 0.0f32;
    let mut sumq2 = 0.0f32;
    for j in 0..QK {
        let idx = best_index_iq4_nl(id * x[j]);
        if let Some(l) = l.as_deref_mut() {
            l[j] = idx;
        }
        let q = KVALUES_IQ4NL_F32[usize::from(idx)];
        let w = weight[j];
        sumqx += w * q * x[j];
        sumq2 += w * q * q;
    }
    (sumqx, sumq2)
}

/// `quantize_row_iq4_nl_impl(QK4_NL, 32, ..., quant_weights = NULL, ntry)` for one block.
///
/// `ntry <= 0` is `quantize_row_iq4_nl_ref` (no scale search, indices from the initial
/// scale); `ntry > 0` is `quantize_iq4_nl` without an importance matrix (tries `2*ntry + 1`
/// further scales, then re-picks every index for the chosen scale).
///
/// ggml leaves the indices of an all-zero block (below [`GROUP_MAX_EPS`]) as whatever its
/// scratch buffer held when `ntry <= 0`; newer ggml clears them, and so does this port. Their
/// values never matter: the block scale is 0.
fn quantize_block_iq4_nl(x: &[f32; QK], out: &mut [u8], ntry: i32) {
    let mut weight = [0.0f32; QK];
    for (w, &v) in weight.iter_mut().zip(x) {
        *w = v * v;
    }
    let mut l = [0u8; QK];
    // ggml's test here is `ax > amax`, the same as `amax < ax` in signed_absmax.
    let (amax, max) = signed_absmax(x);
    let scale = if amax < GROUP_MAX_EPS {
        0.0
    } else {
        let v0 = KVALUES_IQ4NL_F32[0];
        let d0 = if ntry > 0 { -max / v0 } else { max / v0 };
        let (sumqx, sumq2) = iq4_nl_fit(x, &weight, 1.0 / d0, Some(&mut l));
        let mut d = sumqx / sumq2;
        let mut best = d * sumqx;
        for itry in -ntry..=ntry {
            let id = (itry + i32::from(KVALUES_IQ4NL[0])) as f32 / max;
            let (sumqx, sumq2) = iq4_nl_fit(x, &weight, id, None);
            if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
                d = sumqx / sumq2;
                best = d * sumqx;
            }
        }
        d
    };
    out[0..2].copy_from_slice(&fp16_bytes(scale));
    if ntry > 0 {
        let id = inverse_or_zero(scale);
        for (l, &v) in l.iter_mut().zip(x) {
            *l = best_index_iq4_nl(id * v);
        }
    }
    for (j, q) in out[2..18].iter_mut().enumerate() {
        *q = l[j] | (l[j + HALF] << 4);
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn round_half_away_is_roundf_for_every_value_a_quantizer_rounds() {
        let mut xs: Vec<f32> = vec![
            0.5,
            -0.5,
            1.5,
            -1.5,
            2.5,
            0.499_999_97,
            -0.499_999_97,
            126.5,
            -127.5,
            8_388_607.5,
            8_388_608.0,
            1e10,
            -1e10,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            0.0,
            -0.0,
            f32::MIN_POSITIVE,
            1e-45,
        ];
        let mut bits = 0x1234_5678u32;
        for _ in 0..200_000 {
            bits ^= bits << 13;
            bits ^= bits >> 17;
            bits ^= bits << 5;
            xs.push(f32::from_bits(bits));
            xs.push((bits % 100_000) as f32 / 391.0 - 128.0);
        }
        for x in xs {
            let (ours, libm) = (round_half_away(x), x.round());
            assert!(
                ours == libm || (ours.is_nan() && libm.is_nan()),
                "{x:e}: {ours} vs {libm}"
            );
            assert_eq!(c_float_to_int(ours), c_float_to_int(libm), "{x:e}");
        }
    }

    use super::*;

    /// The ramp -16, -15, ..., 15.
    fn ramp() -> [f32; QK] {
        std::array::from_fn(|j| j as f32 - 16.0)
    }

    fn quant(ty: GgmlType, x: &[f32]) -> Vec<u8> {
        let mut out = vec![0u8; ty.row_size(x.len()).unwrap()];
        quantize_row(ty, x, &mut out).unwrap();
        out
    }

    fn dequant(ty: GgmlType, b: &[u8], n: usize) -> Vec<f32> {
        let mut out = vec![0f32; n];
        dequantize_row(ty, b, &mut out).unwrap();
        out
    }

    /// A block of `header` bytes followed by `qs`.
    fn block(header: &[u8], qs: &[u8]) -> Vec<u8> {
        header.iter().chain(qs).copied().collect()
    }

    /// Deterministic pseudo-random numbers (xorshift64).
    struct XorShift(u64);

    impl XorShift {
        fn next_u64(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }

        /// Uniform in [-1, 1).
        fn unit(&mut self) -> f32 {
            (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        }
    }

    /// Rows of `nblocks` blocks with a mix of shapes: centred, offset (for the `_1` types),
    /// with outliers, and with scales from 1e-3 to 1e3.
    fn random_rows(seed: u64, nrows: usize, nblocks: usize) -> Vec<Vec<f32>> {
        let mut rng = XorShift(seed);
        (0..nrows)
            .map(|r| {
                let scale = 10f32.powi((r % 7) as i32 - 3);
                (0..nblocks * QK)
                    .map(|_| {
                        let u = rng.unit() * scale;
                        match r % 3 {
                            0 => u,
                            1 => u + 2.5 * scale,
                            _ if rng.next_u64().is_multiple_of(16) => u * 20.0,
                            _ => u,
                        }
                    })
                    .collect()
            })
            .collect()
    }

    const Q_TYPES: [GgmlType; 6] = [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Iq4Nl,
    ];

    // ----- known answers, derived by hand from the reference algorithms -----

    #[test]
    fn q4_0_known_answers() {
        // Ramp: max = -16 (first of largest magnitude), d = -16 / -8 = 2 (f16 0x4000),
        // q = trunc(x/2 + 8.5) capped at 15.
        let lo = [0u8, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8];
        let hi = [
            8u8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15, 15,
        ];
        let qs: Vec<u8> = lo.iter().zip(&hi).map(|(l, h)| l | (h << 4)).collect();
        assert_eq!(quant(GgmlType::Q4_0, &ramp()), block(&[0x00, 0x40], &qs));

        // One large value: max = 3, d = 3 / -8 = -0.375 (f16 0xb600); x = 3 -> trunc(-8 + 8.5) = 0,
        // zeros -> trunc(8.5) = 8.
        let mut x = [0.0f32; QK];
        x[5] = 3.0;
        let mut qs = [0x88u8; 16];
        qs[5] = 0x80;
        assert_eq!(quant(GgmlType::Q4_0, &x), block(&[0x00, 0xb6], &qs));

        // Equal magnitudes: the first one sets the sign of d.
        let mut x = [0.0f32; QK];
        x[0] = -3.0;
        x[1] = 3.0;
        assert_eq!(&quant(GgmlType::Q4_0, &x)[..2], &[0x00, 0x36]);

        // All zero: d = 0 / -8 = -0.0 (f16 0x8000), q = trunc(8.5) = 8.
        assert_eq!(
            quant(GgmlType::Q4_0, &[0.0; QK]),
            block(&[0x00, 0x80], &[0x88; 16])
        );
    }

    #[test]
    fn q4_1_known_answers() {
        // Ramp: min = -16 (f16 0xcc00), d = 31 / 15 = 2.0666.. -> f16 0x4022 (2.06640625),
        // q = trunc((x + 16) * 15/31 + 0.5).
        let lo = [0u8, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7];
        let qs: Vec<u8> = lo.iter().map(|l| l | ((l + 8) << 4)).collect();
        assert_eq!(
            quant(GgmlType::Q4_1, &ramp()),
            block(&[0x22, 0x40, 0x00, 0xcc], &qs)
        );

        // One large value: min = 0, d = 1/15 -> f16 0x2c44; x = 1 -> 15, zeros -> 0.
        let mut x = [0.0f32; QK];
        x[0] = 1.0;
        let mut qs = [0u8; 16];
        qs[0] = 0x0f;
        assert_eq!(
            quant(GgmlType::Q4_1, &x),
            block(&[0x44, 0x2c, 0x00, 0x00], &qs)
        );

        // All zero: d = 0, m = 0, q = trunc(0.5) = 0.
        assert_eq!(quant(GgmlType::Q4_1, &[0.0; QK]), vec![0u8; 20]);
    }

    #[test]
    fn q5_0_known_answers() {
        // Ramp: d = -16 / -16 = 1 (f16 0x3c00), q = trunc(x + 16.5) = x + 16: the low half has
        // fifth bit 0, the high half fifth bit 1.
        let qs: Vec<u8> = (0..16u8).map(|j| j | (j << 4)).collect();
        assert_eq!(
            quant(GgmlType::Q5_0, &ramp()),
            block(&[0x00, 0x3c, 0x00, 0x00, 0xff, 0xff], &qs)
        );

        // One large value: max = -2, d = 0.125 (f16 0x3000); x = -2 -> 0, zeros -> 16
        // (nibble 0, fifth bit set) so qh has every bit but bit 20.
        let mut x = [0.0f32; QK];
        x[20] = -2.0;
        assert_eq!(
            quant(GgmlType::Q5_0, &x),
            block(&[0x00, 0x30, 0xff, 0xff, 0xef, 0xff], &[0; 16])
        );

        // All zero: d = -0.0, q = 16.
        assert_eq!(
            quant(GgmlType::Q5_0, &[0.0; QK]),
            block(&[0x00, 0x80, 0xff, 0xff, 0xff, 0xff], &[0; 16])
        );
    }

    #[test]
    fn q5_1_known_answers() {
        // Ramp: min = -16, d = 31 / 31 = 1, q = trunc(x + 16 + 0.5) = x + 16.
        let qs: Vec<u8> = (0..16u8).map(|j| j | (j << 4)).collect();
        assert_eq!(
            quant(GgmlType::Q5_1, &ramp()),
            block(&[0x00, 0x3c, 0x00, 0xcc, 0x00, 0x00, 0xff, 0xff], &qs)
        );

        // One large value: min = -31 (f16 0xcfc0), d = 1; zeros -> 31, x = -31 -> 0.
        let mut x = [0.0f32; QK];
        x[31] = -31.0;
        let mut qs = [0xffu8; 16];
        qs[15] = 0x0f;
        assert_eq!(
            quant(GgmlType::Q5_1, &x),
            block(&[0x00, 0x3c, 0xc0, 0xcf, 0xff, 0xff, 0xff, 0x7f], &qs)
        );

        assert_eq!(quant(GgmlType::Q5_1, &[0.0; QK]), vec![0u8; 24]);
    }

    #[test]
    fn q8_0_known_answers() {
        // amax = 127 -> d = 1 (f16 0x3c00) and q = roundf(x): halves round away from zero.
        let mut x = [0.0f32; QK];
        let vals = [127.0, -127.0, 0.5, -0.5, 1.5, 2.5, -2.5, 3.49, 100.2, -0.49];
        x[..vals.len()].copy_from_slice(&vals);
        let mut qs = [0u8; 32];
        for (q, v) in qs.iter_mut().zip([127i8, -127, 1, -1, 2, 3, -3, 3, 100, 0]) {
            *q = v as u8;
        }
        assert_eq!(quant(GgmlType::Q8_0, &x), block(&[0x00, 0x3c], &qs));

        // One large value: d = 5/127 -> f16 0x290a, q = round(5 * 127/5) = 127.
        let mut x = [0.0f32; QK];
        x[3] = 5.0;
        let mut qs = [0u8; 32];
        qs[3] = 127;
        assert_eq!(quant(GgmlType::Q8_0, &x), block(&[0x0a, 0x29], &qs));

        assert_eq!(quant(GgmlType::Q8_0, &[0.0; QK]), vec![0u8; 34]);
    }

    #[test]
    fn iq4_nl_known_answers() {
        // The codebook itself, twice: max = -127 so the first scale is exactly 1, every element
        // is its own codebook value, and the least-squares scale is exactly 1 (the two sums
        // are the same expression).
        let x: Vec<f32> = (0..QK).map(|j| KVALUES_IQ4NL_F32[j % 16]).collect();
        let qs: Vec<u8> = (0..16u8).map(|j| j | (j << 4)).collect();
        assert_eq!(quant(GgmlType::Iq4Nl, &x), block(&[0x00, 0x3c], &qs));

        // Halved: every sum scales by a power of two, so the scale is exactly 0.5 (f16 0x3800).
        let half: Vec<f32> = x.iter().map(|v| v * 0.5).collect();
        assert_eq!(quant(GgmlType::Iq4Nl, &half), block(&[0x00, 0x38], &qs));

        // All zero (below GROUP_MAX_EPS): scale 0, indices 0.
        assert_eq!(quant(GgmlType::Iq4Nl, &[0.0; QK]), vec![0u8; 18]);
        assert_eq!(quant(GgmlType::Iq4Nl, &[1e-16; QK]), vec![0u8; 18]);
    }

    #[test]
    fn iq4_nl_index_search_matches_ggml() {
        assert_eq!(best_index_iq4_nl(-200.0), 0);
        assert_eq!(best_index_iq4_nl(-127.0), 0);
        assert_eq!(best_index_iq4_nl(200.0), 15);
        assert_eq!(best_index_iq4_nl(113.0), 15);
        // Exact midpoints go up; just below goes down.
        assert_eq!(best_index_iq4_nl(-4.5), 8);
        assert_eq!(best_index_iq4_nl(-4.5001), 7);
        assert_eq!(best_index_iq4_nl(101.0), 15);
        assert_eq!(best_index_iq4_nl(100.99), 14);
        assert_eq!(best_index_iq4_nl(0.0), 8);
        assert_eq!(best_index_iq4_nl(f32::NAN), 15);
        for (i, &v) in KVALUES_IQ4NL_F32.iter().enumerate() {
            assert_eq!(usize::from(best_index_iq4_nl(v)), i);
        }

        // In a block: with max = -127 the first scale is 1, so -4.5 takes index 8.
        let mut x = [0.0f32; QK];
        x[0] = -127.0;
        x[1] = -4.5;
        x[17] = -4.5001;
        let b = quant(GgmlType::Iq4Nl, &x);
        assert_eq!(b[2] & 0x0f, 0);
        assert_eq!(b[3] & 0x0f, 8);
        assert_eq!(b[3] >> 4, 7);
    }

    #[test]
    fn iq4_nl_scale_search_variant_is_close() {
        // ntry = 7 is ggml's model-file quantizer (quantize_iq4_nl without imatrix); not used by
        // quantize_row, kept to document the difference. Its error stays within the same bound.
        for row in random_rows(7, 14, 2) {
            let mut out = [0u8; 36];
            quantize_blocks(&row, &mut out, 18, |x, o| quantize_block_iq4_nl(x, o, 7));
            let y = dequant(GgmlType::Iq4Nl, &out, row.len());
            for (xb, yb) in row.chunks(QK).zip(y.chunks(QK)) {
                let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
                for (a, b) in xb.iter().zip(yb) {
                    assert!((a - b).abs() <= 24.0 * amax / 127.0 + 1e-6, "{a} vs {b}");
                }
            }
        }
        // All zero with the search: scale 0, every index re-picked for x = 0 -> 8.
        let mut out = [0u8; 18];
        quantize_block_iq4_nl(&[0.0; QK], &mut out, 7);
        assert_eq!(out, *block(&[0, 0], &[0x88; 16]));
    }

    #[test]
    fn dequantize_known_answers() {
        // q4_0 ramp block from above: (q - 8) * 2.
        let lo = [0u8, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8];
        let hi = [
            8u8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15, 15,
        ];
        let qs: Vec<u8> = lo.iter().zip(&hi).map(|(l, h)| l | (h << 4)).collect();
        let y = dequant(GgmlType::Q4_0, &block(&[0x00, 0x40], &qs), QK);
        for j in 0..16 {
            assert_eq!(y[j], (f32::from(lo[j]) - 8.0) * 2.0);
            assert_eq!(y[j + 16], (f32::from(hi[j]) - 8.0) * 2.0);
        }

        // q4_1: q * d + m with d = 2.06640625, m = -16.
        let qs: Vec<u8> = (0..16u8).map(|j| j | ((15 - j) << 4)).collect();
        let y = dequant(GgmlType::Q4_1, &block(&[0x22, 0x40, 0x00, 0xcc], &qs), QK);
        for j in 0..16 {
            assert_eq!(y[j], j as f32 * 2.066_406_3 - 16.0);
            assert_eq!(y[j + 16], (15 - j) as f32 * 2.066_406_3 - 16.0);
        }

        // The 5-bit ramps decode to the ramp exactly.
        let qs: Vec<u8> = (0..16u8).map(|j| j | (j << 4)).collect();
        let b = block(&[0x00, 0x3c, 0x00, 0x00, 0xff, 0xff], &qs);
        assert_eq!(dequant(GgmlType::Q5_0, &b, QK), ramp());
        let b = block(&[0x00, 0x3c, 0x00, 0xcc, 0x00, 0x00, 0xff, 0xff], &qs);
        assert_eq!(dequant(GgmlType::Q5_1, &b, QK), ramp());

        // q8_0: signed bytes times d.
        let mut qs = [0u8; 32];
        qs[0] = 0x81; // -127
        qs[1] = 0x7f;
        qs[2] = 0xff; // -1
        let y = dequant(GgmlType::Q8_0, &block(&[0x00, 0x38], &qs), QK);
        assert_eq!(&y[..4], &[-63.5, 63.5, -0.5, 0.0]);

        // iq4_nl: d * codebook.
        let qs: Vec<u8> = (0..16u8).map(|j| j | ((15 - j) << 4)).collect();
        let y = dequant(GgmlType::Iq4Nl, &block(&[0x00, 0x40], &qs), QK);
        for j in 0..16 {
            assert_eq!(y[j], 2.0 * KVALUES_IQ4NL_F32[j]);
            assert_eq!(y[j + 16], 2.0 * KVALUES_IQ4NL_F32[15 - j]);
        }
    }

    #[test]
    fn float_types_known_answers() {
        let x = [
            1.0f32,
            -2.5,
            1.0 + 2f32.powi(-11),
            1.0 + 3.0 * 2f32.powi(-11),
            70000.0,
            1e-8,
        ];
        // f16: round to nearest even; 70000 overflows to +inf; 1e-8 flushes to +0.
        let f16_bits: Vec<u16> = quant(GgmlType::F16, &x)
            .chunks(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
        assert_eq!(f16_bits, [0x3c00, 0xc100, 0x3c00, 0x3c02, 0x7c00, 0x0000]);

        // bf16: round to nearest even; NaN keeps its top bits plus the quiet bit.
        let x = [
            1.0f32,
            1.0 + 2f32.powi(-8),
            1.0 + 3.0 * 2f32.powi(-8),
            f32::MAX,
            f32::from_bits(0x7f80_0001),
            f32::NEG_INFINITY,
        ];
        let bf16_bits: Vec<u16> = quant(GgmlType::Bf16, &x)
            .chunks(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
        assert_eq!(bf16_bits, [0x3f80, 0x3f80, 0x3f82, 0x7f80, 0x7fc0, 0xff80]);

        // Widening is exact; bf16 NaN payloads are kept as they are (a plain shift).
        assert_eq!(
            dequant(GgmlType::Bf16, &[0x81, 0x7f], 1)[0].to_bits(),
            0x7f81_0000
        );
        assert_eq!(dequant(GgmlType::F16, &[0x00, 0xc1], 1), [-2.5]);
        let b = (-1.5f32).to_le_bytes();
        assert_eq!(quant(GgmlType::F32, &[-1.5]), b);
        assert_eq!(dequant(GgmlType::F32, &b, 1), [-1.5]);
    }

    #[test]
    fn bf16_rounding_equals_half_crate() {
        let mut rng = XorShift(0x1234_5678);
        let edge = [
            0u32,
            0x8000_0000,
            0x7f80_0000,
            0xff80_0000,
            0x7fc0_0000,
            0x7f7f_ffff,
        ];
        let random = (0..100_000).map(|_| rng.next_u64() as u32);
        for u in edge.into_iter().chain(random) {
            let x = f32::from_bits(u);
            assert_eq!(
                f32_to_bf16_bits(x),
                half::bf16::from_f32(x).to_bits(),
                "{u:#x}"
            );
        }
    }

    // ----- round trips -----

    #[test]
    fn float_round_trip_error_bounds() {
        for row in random_rows(1, 14, 9) {
            let y = dequant(GgmlType::F32, &quant(GgmlType::F32, &row), row.len());
            assert_eq!(y, row);
            // Rows of 288 elements cross the 256-element f16 chunk boundary.
            let y = dequant(GgmlType::F16, &quant(GgmlType::F16, &row), row.len());
            for (a, b) in row.iter().zip(&y) {
                assert!((a - b).abs() <= f16_err(*a), "f16 {a} vs {b}");
            }
            let y = dequant(GgmlType::Bf16, &quant(GgmlType::Bf16, &row), row.len());
            for (a, b) in row.iter().zip(&y) {
                assert!((a - b).abs() <= a.abs() * 2f32.powi(-8), "bf16 {a} vs {b}");
            }
        }
    }

    /// The most f32 -> f16 rounding can move `v`: half an ulp, relative 2^-11 for normal
    /// halves and absolute 2^-25 in the subnormal range.
    fn f16_err(v: f32) -> f32 {
        (v.abs() * 2f32.powi(-11)).max(2f32.powi(-25))
    }

    /// Half a step of a scale `d` stored as f16, plus what the f16 rounding of the scale can
    /// add at the largest level `qmax`, plus f32 slack.
    fn step_bound(d: f32, qmax: f32, amax: f32) -> f32 {
        d.abs() * 0.5 + qmax * f16_err(d) + amax * 1e-6
    }

    #[test]
    fn quantized_round_trip_error_bounds() {
        for row in random_rows(2, 21, 4) {
            for ty in Q_TYPES {
                let y = dequant(ty, &quant(ty, &row), row.len());
                for (xb, yb) in row.chunks(QK).zip(y.chunks(QK)) {
                    let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
                    let min = xb.iter().copied().fold(f32::MAX, f32::min);
                    let max = xb.iter().copied().fold(-f32::MAX, f32::max);
                    for (&a, &b) in xb.iter().zip(yb) {
                        let bound = match ty {
                            GgmlType::Q8_0 => step_bound(amax / 127.0, 127.0, amax),
                            // Values beyond +7d (q4_0) / +15d (q5_0) on the side opposite the
                            // largest element are clamped: up to one full step there.
                            GgmlType::Q4_0 => 2.0 * step_bound(amax / 8.0, 8.0, amax),
                            GgmlType::Q5_0 => 2.0 * step_bound(amax / 16.0, 16.0, amax),
                            // The `_1` types also carry the f16 rounding of the minimum.
                            GgmlType::Q4_1 => {
                                step_bound((max - min) / 15.0, 15.0, amax) + f16_err(min)
                            }
                            GgmlType::Q5_1 => {
                                step_bound((max - min) / 31.0, 31.0, amax) + f16_err(min)
                            }
                            // In units of amax/127: half the largest codebook gap (89..113)
                            // is 12; on the side opposite the largest element values up to 127
                            // clamp to 113 (14); the least-squares refit of the scale moves
                            // every level by a few percent (seen: under 18 in all). 24 units
                            // (the largest gap) bounds it with room to spare.
                            GgmlType::Iq4Nl => 24.0 * amax / 127.0 + 127.0 * f16_err(amax / 127.0),
                            _ => unreachable!(),
                        };
                        assert!((a - b).abs() <= bound, "{ty}: {a} -> {b}, bound {bound}");
                    }
                }
            }
        }
    }

    #[test]
    fn unclamped_symmetric_values_are_within_half_a_step() {
        // For q4_0/q5_0, elements on the same side as the largest one are never clamped.
        for row in random_rows(3, 14, 3) {
            for (ty, levels) in [(GgmlType::Q4_0, 8.0f32), (GgmlType::Q5_0, 16.0)] {
                let y = dequant(ty, &quant(ty, &row), row.len());
                for (xb, yb) in row.chunks(QK).zip(y.chunks(QK)) {
                    let (amax, max) = signed_absmax(xb.try_into().unwrap());
                    for (&a, &b) in xb.iter().zip(yb) {
                        if a * max >= 0.0 {
                            let bound = step_bound(amax / levels, levels, amax);
                            assert!((a - b).abs() <= bound, "{ty}: {a} -> {b}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn requantizing_a_dequantized_row_is_idempotent() {
        // For each of these types the dequantized block still holds an element at the extreme
        // level (q = 0 for q4_0/q5_0/iq4_nl, q = ±127 for q8_0, q = 0 and the top level for
        // q4_1/q5_1), so requantizing recovers the same f16 scale (and minimum), and every
        // element lands back on its own level, far from any rounding boundary. This fails
        // only in degenerate cases kept out of the data here (which spans 1e-3..1e3): an f16
        // scale or minimum that underflows to 0 or overflows to infinity (|x| beyond about
        // 1e4, or below about 1e-6 for q8_0/iq4_nl), or a q4_1/q5_1 minimum so large (about
        // 2^20 steps) that `q*d + m` loses the level in f32.
        // iq4_nl also holds in practice (the refit scale moves by ~2^-19 relative, far below
        // half an f16 ulp) and is checked as well.
        for row in random_rows(4, 21, 4) {
            for ty in Q_TYPES {
                let q = quant(ty, &row);
                let y = dequant(ty, &q, row.len());
                assert_eq!(quant(ty, &y), q, "{ty}");
            }
        }
        // The hand-made blocks too.
        for ty in Q_TYPES {
            for x in [ramp(), [0.0; QK]] {
                let q = quant(ty, &x);
                assert_eq!(quant(ty, &dequant(ty, &q, QK)), q, "{ty}");
            }
        }
    }

    #[test]
    fn rows_are_quantized_block_by_block() {
        let row = &random_rows(5, 1, 3)[0];
        for ty in Q_TYPES {
            let whole = quant(ty, row);
            let parts: Vec<u8> = row.chunks(QK).flat_map(|b| quant(ty, b)).collect();
            assert_eq!(whole, parts, "{ty}");
        }
    }

    #[test]
    fn non_finite_inputs_do_not_panic() {
        let mut x = [1.0f32; QK];
        x[3] = f32::NAN;
        x[7] = f32::INFINITY;
        let mut tiny = [0.0f32; QK];
        tiny[0] = 1e-38; // scale underflows, 1/d overflows
        for ty in GgmlType::ALL {
            for x in [x, tiny, [f32::NAN; QK]] {
                let q = quant(ty, &x);
                dequant(ty, &q, QK);
            }
        }
    }

    // ----- errors -----

    #[test]
    fn length_mismatches_are_rejected() {
        let x = [0.0f32; 64];
        for ty in GgmlType::ALL {
            let n = ty.row_size(64).unwrap();
            for bad in [n - 1, n + 1, 0] {
                let mut b = vec![0u8; bad];
                let err = quantize_row(ty, &x, &mut b).unwrap_err();
                assert!(
                    matches!(&err, KvError::InvalidArg(m) if m.contains(&n.to_string())
                    && m.contains(&bad.to_string())),
                    "{ty}: {err}"
                );
                let mut y = [0f32; 64];
                let err = dequantize_row(ty, &b, &mut y).unwrap_err();
                assert!(matches!(err, KvError::InvalidArg(_)), "{ty}");
            }
        }
        // Element counts that are not whole blocks.
        let mut b = [0u8; 18];
        let err = quantize_row(GgmlType::Q4_0, &[0.0; 33], &mut b).unwrap_err();
        assert!(
            matches!(&err, KvError::InvalidArg(m) if m.contains("33")),
            "{err}"
        );
        let err = dequantize_row(GgmlType::Iq4Nl, &b, &mut [0.0; 16]).unwrap_err();
        assert!(
            matches!(&err, KvError::InvalidArg(m) if m.contains("16")),
            "{err}"
        );
        // Empty rows are fine.
        quantize_row(GgmlType::Q8_0, &[], &mut []).unwrap();
        dequantize_row(GgmlType::F16, &[], &mut []).unwrap();
    }
}
