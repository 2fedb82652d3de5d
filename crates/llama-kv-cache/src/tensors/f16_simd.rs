//! f16 row kernels on x86-64's AVX and F16C instructions: f16 <-> f32 row conversion and the
//! K-shift's fused f16 RoPE (load 8 halves, widen, rotate, narrow, store, in one pass over the
//! row with no f32 scratch).
//!
//! Why explicit instructions rather than `half`'s slice conversion behind a byte-copy loop: that
//! generic path's speed depended on whether the compiler auto-vectorised the copy of the row's
//! bytes into `f16` values, and it did in the core's benchmark build but not in the shipped addon
//! (built with the `cuda` feature and fat LTO over a larger crate graph, which changes inlining).
//! The same source then ran the K-shift 1.4-2x slower through the addon: each half was stored to
//! the stack one at a time and reloaded 8 at a time, a store-forwarding stall per 8 values. Inside
//! a `#[target_feature]` function the vector code is written out, so every build gets the same
//! loop. The features are detected at run time (std caches the answer); without them, and on
//! other architectures, callers keep the generic path.
//!
//! The arithmetic is the scalar code's, so the results are bit-identical to it (and to ggml's
//! CPU K-shift): every product and sum is a separately rounded f32 operation (no FMA: Rust never
//! contracts `a * b - c * d`), and F16C's narrowing rounds to nearest, ties to even, as `half`
//! and ggml's `GGML_FP32_TO_FP16` do. Widening f16 to f32 is exact.

use crate::tensors::rope::{RopeTable, RopeType};

/// Values per vector step (8 f32 lanes of a 256-bit register).
const LANES: usize = 8;

/// Whether the CPU has the instructions these kernels need (AVX and F16C).
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx") && std::arch::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Runs `kernel` if the CPU has the instructions; returns whether it ran.
#[cfg(target_arch = "x86_64")]
fn when_available(kernel: impl FnOnce()) -> bool {
    let ok = available();
    if ok {
        kernel();
    }
    ok
}

/// Widens little-endian f16 bytes into `dst` (`src.len() == 2 * dst.len()`). Returns false,
/// having done nothing, when the CPU lacks the instructions.
#[cfg(target_arch = "x86_64")]
pub(crate) fn f16_to_f32(src: &[u8], dst: &mut [f32]) -> bool {
    assert_eq!(src.len(), 2 * dst.len(), "f16_to_f32: length mismatch");
    // SAFETY: runs only where the CPU has AVX and F16C; the lengths match (asserted).
    when_available(|| unsafe { x86::f16_to_f32(src, dst) })
}

/// Narrows `src` into little-endian f16 bytes (`dst.len() == 2 * src.len()`), rounding to
/// nearest, ties to even. Returns false, having done nothing, when the CPU lacks the
/// instructions.
#[cfg(target_arch = "x86_64")]
pub(crate) fn f32_to_f16(src: &[f32], dst: &mut [u8]) -> bool {
    assert_eq!(dst.len(), 2 * src.len(), "f32_to_f16: length mismatch");
    // SAFETY: as in f16_to_f32.
    when_available(|| unsafe { x86::f32_to_f16(src, dst) })
}

/// One [`RopeTable`] laid out for the vector kernel: rotates f16 rows in place.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) struct F16Rope {
    /// Norm: `cos` of each pair repeated for both of its lanes (`c0 c0 c1 c1 ...`); NeoX: one
    /// per pair. Padded to whole vectors with `1` (padding lanes are never stored).
    cos: Vec<f32>,
    /// `sin` laid out as `cos`, padded with `0`.
    sin: Vec<f32>,
    n_dims: usize,
    head_dim: usize,
    rope_type: RopeType,
}

impl F16Rope {
    /// The kernel for `table`, or `None` when the CPU lacks the instructions.
    pub(crate) fn new(table: &RopeTable) -> Option<F16Rope> {
        // the kernels rotate each head's leading dimensions: a latent K row's rotated part
        // (behind `dims_offset` values) takes the row path
        if !available() || table.dims_offset() != 0 {
            return None;
        }
        let (cos, sin) = table.cos_sin();
        let (cos, sin): (Vec<f32>, Vec<f32>) = match table.rope_type() {
            RopeType::Norm => (
                cos.iter().flat_map(|&c| [c, c]).collect(),
                sin.iter().flat_map(|&s| [s, s]).collect(),
            ),
            RopeType::Neox => (cos.to_vec(), sin.to_vec()),
        };
        let padded = cos.len().div_ceil(LANES) * LANES;
        let pad = |mut v: Vec<f32>, with: f32| {
            v.resize(padded, with);
            v
        };
        Some(F16Rope {
            cos: pad(cos, 1.0),
            sin: pad(sin, 0.0),
            n_dims: table.n_dims(),
            head_dim: table.head_dim(),
            rope_type: table.rope_type(),
        })
    }

    /// Rotates every head of `bytes` (whole heads of `head_dim` little-endian f16 values, row
    /// after row) in place; dimensions `n_dims..head_dim` of each head are not touched.
    ///
    /// # Panics
    ///
    /// Panics if `bytes` is not a whole number of heads (callers pass whole K rows).
    pub(crate) fn rotate_rows(&self, bytes: &mut [u8]) {
        let head_bytes = 2 * self.head_dim;
        assert!(
            head_bytes > 0 && bytes.len().is_multiple_of(head_bytes),
            "rope: {} bytes are not whole f16 heads of {} values",
            bytes.len(),
            self.head_dim
        );
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: a F16Rope exists only where the CPU has AVX and F16C (`new`); `bytes` is
            // whole heads (asserted); `n_dims <= head_dim` (RopeTable clamps it) and the tables
            // hold whole vectors covering every pair (`new`), which is what the kernels read.
            unsafe {
                match self.rope_type {
                    RopeType::Norm => x86::rope::<false>(bytes, self.head_dim, self.n_dims, self),
                    RopeType::Neox => x86::rope::<true>(bytes, self.head_dim, self.n_dims, self),
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;
    use std::ptr;

    use super::{F16Rope, LANES};

    /// Bytes of one vector of halves.
    const HALVES: usize = 2 * LANES;

    /// Loads 8 halves from `p` (unaligned) and widens them.
    ///
    /// # Safety
    /// AVX and F16C; `p` readable for 16 bytes.
    #[target_feature(enable = "avx,f16c")]
    #[inline]
    unsafe fn load8(p: *const u8) -> __m256 {
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }

    /// Narrows `v` (nearest, ties to even) and stores the 8 halves at `p` (unaligned).
    ///
    /// # Safety
    /// AVX and F16C; `p` writable for 16 bytes.
    #[target_feature(enable = "avx,f16c")]
    #[inline]
    unsafe fn store8(p: *mut u8, v: __m256) {
        unsafe { _mm_storeu_si128(p.cast(), _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v)) }
    }

    /// # Safety
    /// AVX and F16C; `src.len() == 2 * dst.len()`.
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn f16_to_f32(src: &[u8], dst: &mut [f32]) {
        let n = dst.len();
        let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
        let mut i = 0;
        // SAFETY (loop and tail): values [i, i + 8) of dst and bytes [2i, 2i + 16) of src are in
        // bounds while i + 8 <= n; the tail goes through a buffer.
        while i + LANES <= n {
            unsafe { _mm256_storeu_ps(d.add(i), load8(s.add(2 * i))) };
            i += LANES;
        }
        if i < n {
            let mut buf = [0u8; HALVES];
            buf[..2 * (n - i)].copy_from_slice(&src[2 * i..]);
            let mut out = [0f32; LANES];
            unsafe { _mm256_storeu_ps(out.as_mut_ptr(), load8(buf.as_ptr())) };
            dst[i..].copy_from_slice(&out[..n - i]);
        }
    }

    /// # Safety
    /// AVX and F16C; `dst.len() == 2 * src.len()`.
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn f32_to_f16(src: &[f32], dst: &mut [u8]) {
        let n = src.len();
        let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
        let mut i = 0;
        // SAFETY: as in f16_to_f32.
        while i + LANES <= n {
            unsafe { store8(d.add(2 * i), _mm256_loadu_ps(s.add(i))) };
            i += LANES;
        }
        if i < n {
            let mut vals = [0f32; LANES];
            vals[..n - i].copy_from_slice(&src[i..]);
            let mut buf = [0u8; HALVES];
            unsafe { store8(buf.as_mut_ptr(), _mm256_loadu_ps(vals.as_ptr())) };
            dst[2 * i..].copy_from_slice(&buf[..2 * (n - i)]);
        }
    }

    /// One step of 8 table lanes at lane `j` of the head at `h`, in place.
    /// NORM (`NEOX` false): the 8 values at `j` are 4 adjacent pairs `(x0, x1)`; the even lanes
    /// get `x0*c - x1*s` and the odd ones `x1*c + x0*s` (= ggml's `x0*s + x1*c`: addition
    /// commutes exactly). NeoX: values `j..j + 8` pair with `half + j..`, giving
    /// `lo*c - hi*s`, `lo*s + hi*c` (ggml's order).
    ///
    /// # Safety
    /// AVX and F16C; the 16 bytes at `h + 2j` (NeoX: also at `h + 2(half + j)`) are readable
    /// and writable.
    #[target_feature(enable = "avx,f16c")]
    #[inline]
    unsafe fn step<const NEOX: bool>(h: *mut u8, j: usize, half: usize, c: __m256, s: __m256) {
        unsafe {
            let lo = h.add(2 * j);
            if NEOX {
                let hi = h.add(2 * (half + j));
                let (x0, x1) = (load8(lo), load8(hi));
                store8(
                    lo,
                    _mm256_sub_ps(_mm256_mul_ps(x0, c), _mm256_mul_ps(x1, s)),
                );
                store8(
                    hi,
                    _mm256_add_ps(_mm256_mul_ps(x0, s), _mm256_mul_ps(x1, c)),
                );
            } else {
                let x = load8(lo);
                let swapped = _mm256_permute_ps::<0b1011_0001>(x);
                store8(
                    lo,
                    _mm256_addsub_ps(_mm256_mul_ps(x, c), _mm256_mul_ps(swapped, s)),
                );
            }
        }
    }

    /// Rotates every head of `bytes`: NORM (`NEOX` false) or NeoX pairing.
    ///
    /// # Safety
    /// AVX and F16C; `bytes` whole heads of `head_dim` halves; `n_dims <= head_dim`, even;
    /// `t.cos`/`t.sin` hold the table lanes (`n_dims` for NORM, `n_dims / 2` for NeoX) rounded
    /// up to whole vectors.
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn rope<const NEOX: bool>(
        bytes: &mut [u8],
        head_dim: usize,
        n_dims: usize,
        t: &F16Rope,
    ) {
        let (cos, sin) = (t.cos.as_ptr(), t.sin.as_ptr());
        let half = n_dims / 2;
        let lanes = if NEOX { half } else { n_dims };
        let whole = lanes / LANES * LANES;
        for head in bytes.chunks_exact_mut(2 * head_dim) {
            let h = head.as_mut_ptr();
            let mut j = 0;
            // SAFETY: j + 8 <= lanes, so the values a step touches lie in the rotated part of
            // the head (NORM: [j, j + 8) within n_dims; NeoX: [j, j + 8) and [half + j, ...)
            // within n_dims) and table values [j, j + 8) inside the tables.
            while j < whole {
                unsafe {
                    let (c, s) = (_mm256_loadu_ps(cos.add(j)), _mm256_loadu_ps(sin.add(j)));
                    step::<NEOX>(h, j, half, c, s);
                }
                j += LANES;
            }
            if j < lanes {
                // the last n < 8 lanes go through a scratch laid out as a head whose `half` is
                // 8: NORM's values at 0, NeoX's `lo` at 0 and `hi` at 8, zero-padded, so the
                // step reads and writes nothing beyond the rotated values
                let n = lanes - j;
                let segments: &[usize] = if NEOX { &[j, half + j] } else { &[j] };
                let mut scratch = [0u8; 2 * HALVES];
                // SAFETY: each segment's n values are inside the head (as above, with
                // j + n = lanes); the scratch holds 2 vectors; the tables are padded to a
                // whole vector past j.
                unsafe {
                    for (k, &at) in segments.iter().enumerate() {
                        let from = h.add(2 * at);
                        ptr::copy_nonoverlapping(from, scratch.as_mut_ptr().add(k * HALVES), 2 * n);
                    }
                    let (c, s) = (_mm256_loadu_ps(cos.add(j)), _mm256_loadu_ps(sin.add(j)));
                    step::<NEOX>(scratch.as_mut_ptr(), 0, LANES, c, s);
                    for (k, &at) in segments.iter().enumerate() {
                        let to = h.add(2 * at);
                        ptr::copy_nonoverlapping(scratch.as_ptr().add(k * HALVES), to, 2 * n);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensors::rope::RopeParams;
    use half::f16;

    /// xorshift32 halves: finite values of every magnitude, subnormals, zeros of both signs and
    /// infinities (NaN payloads are left out: they are not what the kernel is compared on).
    fn halves(n: usize, mut x: u32) -> Vec<u8> {
        let mut out = Vec::with_capacity(2 * n);
        while out.len() < 2 * n {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let mut h = (x >> 7) as u16;
            if h & 0x7c00 == 0x7c00 {
                h &= 0xfc00; // NaN -> infinity
            }
            if !x.is_multiple_of(5) {
                h = (h & 0x8000) | (0x3000 + (h & 0x0fff)); // mostly ordinary magnitudes
            }
            out.extend_from_slice(&h.to_le_bytes());
        }
        out
    }

    /// The scalar path: `half`'s per-value conversions around [`RopeTable::rotate`].
    fn rotate_scalar(bytes: &mut [u8], table: &RopeTable, row_len: usize) {
        for row in bytes.chunks_exact_mut(2 * row_len) {
            let mut v: Vec<f32> = row
                .chunks_exact(2)
                .map(|b| f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
                .collect();
            table.rotate(&mut v);
            for (b, x) in row.chunks_exact_mut(2).zip(v) {
                b.copy_from_slice(&f16::from_f32(x).to_bits().to_le_bytes());
            }
        }
    }

    #[test]
    fn the_fused_f16_rope_is_bit_identical_to_the_scalar_rotation() {
        if !available() {
            return; // the generic path is what runs on such a CPU, tested elsewhere
        }
        // tails of every length (n_dims % 8, half % 8), partial rotation, one-pair heads
        let shapes = [
            (16, 16, 2),
            (128, 128, 2),
            (64, 48, 3),
            (10, 10, 5),
            (6, 2, 4),
            (24, 22, 1),
            (2, 2, 8),
        ];
        let mut seed = 0x9e37_79b9u32;
        for rope_type in [RopeType::Norm, RopeType::Neox] {
            for &(head_dim, n_dims, n_head) in &shapes {
                for variant in 0..3 {
                    let mut p = RopeParams::new(n_dims, head_dim, n_head, rope_type);
                    if variant == 1 {
                        // YaRN: scaled cos/sin, mscale != 1
                        p.ext_factor = 1.0;
                        p.freq_scale = 0.25;
                        p.n_ctx_orig = 4096;
                    }
                    if variant == 2 {
                        p.freq_factors = Some((0..n_dims / 2).map(|i| 1.0 + i as f32).collect());
                        p.freq_base = 500000.0;
                    }
                    for pos in [1, -3, 4097, -100_000, 0] {
                        let table = RopeTable::new(&p, pos);
                        let rows = 37;
                        seed = seed.wrapping_mul(0x0101_0101).wrapping_add(pos as u32) | 1;
                        let mut got = halves(rows * p.row_len(), seed);
                        let mut want = got.clone();
                        rotate_scalar(&mut want, &table, p.row_len());
                        F16Rope::new(&table).unwrap().rotate_rows(&mut got);
                        assert!(
                            got == want,
                            "{rope_type:?} head_dim {head_dim} n_dims {n_dims} x {n_head}, \
                             variant {variant}, pos {pos}: rows differ"
                        );
                    }
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_f16c_conversions_match_half_for_every_length() {
        if !available() {
            return;
        }
        for n in [0, 1, 7, 8, 9, 15, 16, 17, 255, 256, 1000] {
            let bytes = halves(n, 0x1357_9bdf ^ n as u32);
            let want: Vec<f32> = bytes
                .chunks_exact(2)
                .map(|b| f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
                .collect();
            let mut got = vec![0f32; n];
            assert!(f16_to_f32(&bytes, &mut got));
            assert_eq!(
                got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "widening {n} values"
            );
            // narrowing values that need rounding (ties included) and that overflow
            let wide: Vec<f32> = (0..n)
                .map(|i| want[i] * (1.0 + i as f32 / 4096.0) + (i as f32 - 3.0) * 1e-4)
                .chain([65520.0, -65504.0, 1e-8, 2049.0].into_iter().take(n.min(4)))
                .collect();
            let mut out = vec![0u8; 2 * wide.len()];
            assert!(f32_to_f16(&wide, &mut out));
            let expect: Vec<u8> = wide
                .iter()
                .flat_map(|&x| f16::from_f32(x).to_bits().to_le_bytes())
                .collect();
            assert_eq!(out, expect, "narrowing {} values", wide.len());
        }
    }

    #[test]
    fn rotate_rows_rejects_a_partial_head() {
        if !available() {
            return;
        }
        let p = RopeParams::new(16, 16, 2, RopeType::Norm);
        let rope = F16Rope::new(&RopeTable::new(&p, 1)).unwrap();
        let mut bytes = vec![0u8; 2 * 16 + 2];
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            rope.rotate_rows(&mut bytes)
        }));
        assert!(caught.is_err());
    }
}
