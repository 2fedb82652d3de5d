//! Rotary position embedding (RoPE) as llama.cpp applies it during the K-shift.
//!
//! When positions of cached tokens change (`llama_kv_self_seq_add`, `..._seq_div`, context
//! shifting), llama.cpp (b4944) does not recompute K: it rotates every cached K row by the
//! accumulated position delta of its cell (`llama_context::build_rope_shift`, which calls
//! `ggml_rope_ext` on the K view with the cell's delta as position). Because RoPE rotations
//! compose additively, rotating a K row already encoded at position `p` by `d` gives the
//! encoding at `p + d`.
//!
//! This module is a port of ggml's CPU kernel (`ggml/src/ggml-cpu`, functions
//! `ggml_rope_cache_init`, `rope_yarn`, `rope_yarn_ramp`, `ggml_rope_yarn_corr_dims` and
//! `ggml_compute_forward_rope_f32`). It keeps ggml's arithmetic: everything in `f32`, the angle of
//! pair `i` obtained by repeatedly multiplying the position by `theta_scale` (not by a fresh
//! `powf`), and the same operation order, so results agree with llama.cpp's CPU backend as closely
//! as a different compiler allows (see [`RopeTable`]).
//!
//! Only the two rope modes a K-shift can meet on a text model are supported:
//! [`RopeType::Norm`] (`LLAMA_ROPE_TYPE_NORM`, 0) and [`RopeType::Neox`]
//! (`LLAMA_ROPE_TYPE_NEOX`, 2). M-RoPE and vision modes are not supported here.

use crate::error::{KvError, Result};

/// How the dimensions of a head are paired for rotation (ggml's rope `mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeType {
    /// `LLAMA_ROPE_TYPE_NORM` / `GGML_ROPE_TYPE_NORMAL` (0): adjacent dimensions are paired,
    /// `(x[2i], x[2i + 1])` (LLaMA, Mistral, ...).
    Norm,
    /// `LLAMA_ROPE_TYPE_NEOX` / `GGML_ROPE_TYPE_NEOX` (2): the first half of the rotated dimensions
    /// is paired with the second half, `(x[i], x[i + n_dims / 2])` (GPT-NeoX, Qwen, Phi, Gemma, ...).
    Neox,
}

impl RopeType {
    /// The ggml / llama.cpp integer for this mode (`0` for [`Norm`](Self::Norm), `2` for
    /// [`Neox`](Self::Neox)).
    pub const fn ggml_mode(self) -> i32 {
        match self {
            RopeType::Norm => 0,
            RopeType::Neox => 2,
        }
    }

    /// Maps a llama.cpp `llama_rope_type` / ggml rope mode to a [`RopeType`]; `None` for modes a
    /// K-shift cannot use here (`-1` = no RoPE, `8` = M-RoPE, `24` = vision, anything else).
    pub const fn from_ggml_mode(mode: i32) -> Option<Self> {
        match mode {
            0 => Some(RopeType::Norm),
            2 => Some(RopeType::Neox),
            _ => None,
        }
    }
}

/// Every parameter of llama.cpp's K-shift RoPE (the arguments `build_rope_shift` passes to
/// `ggml_rope_ext`), plus the shape of one cell's K row.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeParams {
    /// Number of dimensions of each head that are rotated (`hparams.n_rot`, ggml's `n_dims`),
    /// from `dims_offset` on. Must be even, with `dims_offset + n_dims <= head_dim`; the other
    /// dimensions are left as they are.
    pub n_dims: usize,
    /// Dimensions per K head (`hparams.n_embd_head_k`, ggml's `ne0` of the K view).
    pub head_dim: usize,
    /// Leading dimensions of each head left as they are before the rotated ones: llama.cpp
    /// 0.1.161's `n_embd_nope` (`head_dim - n_dims`) for latent attention, whose K row is the
    /// latent then its rotated part; 0 otherwise. Default `0`.
    pub dims_offset: usize,
    /// Number of K heads in one cell's row (`hparams.n_head_kv(il)`).
    pub n_head: usize,
    /// Pairing of dimensions (`hparams.rope_type`).
    pub rope_type: RopeType,
    /// RoPE base frequency `theta` (`cparams.rope_freq_base`, or the layer's own base, e.g.
    /// `rope_freq_base_train_swa` for Gemma 3 sliding-window layers). Default `10000`.
    pub freq_base: f32,
    /// Linear position scale (`cparams.rope_freq_scale`, `1 / rope scaling factor`). Default `1`.
    pub freq_scale: f32,
    /// YaRN extrapolation mix factor (`cparams.yarn_ext_factor`, already resolved: `0` disables
    /// YaRN, `1` is full YaRN). Default `0`.
    pub ext_factor: f32,
    /// Magnitude scale applied to cos/sin (`cparams.yarn_attn_factor`; llama.cpp substitutes
    /// `1 / (1 + 0.1 ln(1 / freq_scale))` for DeepSeek-2). Default `1`.
    pub attn_factor: f32,
    /// YaRN low correction dimension, in rotations (`cparams.yarn_beta_fast`). Default `32`.
    pub beta_fast: f32,
    /// YaRN high correction dimension, in rotations (`cparams.yarn_beta_slow`). Default `1`.
    pub beta_slow: f32,
    /// Original training context used by YaRN to place its ramp (`cparams.n_ctx_orig_yarn`,
    /// normally the model's `n_ctx_train`). Only read when `ext_factor != 0`. Default `0`.
    pub n_ctx_orig: u32,
    /// Optional per-pair frequency divisors (the model's `rope_freqs` tensor, e.g. LLaMA 3.1
    /// long-context scaling, Phi-3 long/short factors): the angle of pair `i` is divided by
    /// `freq_factors[i]`. Must hold exactly `n_dims / 2` finite positive values. Default `None`.
    pub freq_factors: Option<Vec<f32>>,
}

impl RopeParams {
    /// Parameters with the given geometry and llama.cpp's defaults for everything else
    /// (`freq_base` 10000, `freq_scale` 1, `ext_factor` 0, `attn_factor` 1, `beta_fast` 32,
    /// `beta_slow` 1, `n_ctx_orig` 0, no `freq_factors`).
    pub fn new(n_dims: usize, head_dim: usize, n_head: usize, rope_type: RopeType) -> Self {
        Self {
            n_dims,
            head_dim,
            dims_offset: 0,
            n_head,
            rope_type,
            freq_base: 10000.0,
            freq_scale: 1.0,
            ext_factor: 0.0,
            attn_factor: 1.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            n_ctx_orig: 0,
            freq_factors: None,
        }
    }

    /// Checks the parameters: `n_dims` even with `0 < n_dims <= head_dim`, `head_dim > 0`,
    /// `n_head > 0`, `head_dim * n_head` representable, `freq_base` and `freq_scale` finite and
    /// positive, `ext_factor`, `attn_factor`, `beta_fast`, `beta_slow` finite, and
    /// `freq_factors` (if any) of length `n_dims / 2` with every value finite and positive.
    ///
    /// Returns [`KvError::InvalidArg`] naming the first offending field and its value.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(KvError::InvalidArg(format!("rope: {msg}")));
        if self.head_dim == 0 {
            return bad("head_dim must be > 0, got 0".into());
        }
        if self.n_head == 0 {
            return bad("n_head must be > 0, got 0".into());
        }
        if self.n_dims == 0 {
            return bad("n_dims must be > 0, got 0".into());
        }
        if !self.n_dims.is_multiple_of(2) {
            return bad(format!("n_dims must be even, got {}", self.n_dims));
        }
        if self.n_dims > self.head_dim {
            return bad(format!(
                "n_dims ({}) must not exceed head_dim ({})",
                self.n_dims, self.head_dim
            ));
        }
        if self.dims_offset > self.head_dim - self.n_dims {
            return bad(format!(
                "dims_offset ({}) + n_dims ({}) must not exceed head_dim ({})",
                self.dims_offset, self.n_dims, self.head_dim
            ));
        }
        if self.head_dim.checked_mul(self.n_head).is_none() {
            return bad(format!(
                "head_dim * n_head overflows ({} * {})",
                self.head_dim, self.n_head
            ));
        }
        let positive = [
            ("freq_base", self.freq_base),
            ("freq_scale", self.freq_scale),
        ];
        for (name, v) in positive {
            if !(v.is_finite() && v > 0.0) {
                return bad(format!("{name} must be finite and > 0, got {v}"));
            }
        }
        let finite = [
            ("ext_factor", self.ext_factor),
            ("attn_factor", self.attn_factor),
            ("beta_fast", self.beta_fast),
            ("beta_slow", self.beta_slow),
        ];
        for (name, v) in finite {
            if !v.is_finite() {
                return bad(format!("{name} must be finite, got {v}"));
            }
        }
        if let Some(ff) = &self.freq_factors {
            if ff.len() != self.n_dims / 2 {
                return bad(format!(
                    "freq_factors must have n_dims / 2 = {} values, got {}",
                    self.n_dims / 2,
                    ff.len()
                ));
            }
            if let Some((i, v)) = ff
                .iter()
                .enumerate()
                .find(|(_, v)| !(v.is_finite() && **v > 0.0))
            {
                return bad(format!("freq_factors[{i}] must be finite and > 0, got {v}"));
            }
        }
        Ok(())
    }

    /// Number of `f32` elements in one cell's K row: `head_dim * n_head` (heads stored one after
    /// another).
    pub fn row_len(&self) -> usize {
        self.head_dim * self.n_head
    }
}

/// ggml's `MAX` macro: `a > b ? a : b` (NaN handling differs from `f32::max`).
#[inline]
fn c_max(a: f32, b: f32) -> f32 {
    if a > b {
        a
    } else {
        b
    }
}

/// ggml's `MIN` macro: `a < b ? a : b`.
#[inline]
fn c_min(a: f32, b: f32) -> f32 {
    if a < b {
        a
    } else {
        b
    }
}

/// `ggml_rope_yarn_corr_dim`: the dimension at which a frequency makes `n_rot` full turns over
/// `n_ctx_orig` positions.
fn yarn_corr_dim(n_dims: usize, n_ctx_orig: u32, n_rot: f32, base: f32) -> f32 {
    n_dims as f32 * (n_ctx_orig as f32 / (n_rot * 2.0 * std::f32::consts::PI)).ln()
        / (2.0 * base.ln())
}

/// `ggml_rope_yarn_corr_dims`: `[low, high]` of YaRN's extrapolation/interpolation ramp.
fn yarn_corr_dims(
    n_dims: usize,
    n_ctx_orig: u32,
    freq_base: f32,
    beta_fast: f32,
    beta_slow: f32,
) -> [f32; 2] {
    let start = yarn_corr_dim(n_dims, n_ctx_orig, beta_fast, freq_base).floor();
    let end = yarn_corr_dim(n_dims, n_ctx_orig, beta_slow, freq_base).ceil();
    [c_max(0.0, start), c_min(n_dims as f32 - 1.0, end)]
}

/// `rope_yarn_ramp` for pair index `pair` (ggml's `i0 / 2`).
#[inline]
fn yarn_ramp(low: f32, high: f32, pair: usize) -> f32 {
    let y = (pair as f32 - low) / c_max(0.001, high - low);
    1.0 - c_min(1.0, c_max(0.0, y))
}

/// Precomputed `cos`/`sin` (already multiplied by the magnitude scale) of every rotated pair for
/// one position, reusable for every row and layer that shares the same [`RopeParams`].
///
/// Built exactly like ggml's `ggml_rope_cache_init` with `rope_yarn`: `theta_scale =
/// freq_base^(-2 / n_dims)`, the running angle starts at `pos` and is multiplied by `theta_scale`
/// after each pair, all in `f32`. The one known source of difference from a llama.cpp build is
/// floating-point contraction: a C compiler allowed to fuse `a*b - c*d` into FMA instructions can
/// differ from this code in the last bit of a value.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeTable {
    cos: Vec<f32>,
    sin: Vec<f32>,
    n_dims: usize,
    head_dim: usize,
    dims_offset: usize,
    n_head: usize,
    rope_type: RopeType,
    pos: i32,
}

impl RopeTable {
    /// Computes the table for position `pos` (for the K-shift: the cell's accumulated delta,
    /// which may be negative).
    ///
    /// `params` should have passed [`RopeParams::validate`]. This constructor does not panic on
    /// invalid geometry (it clamps the rotated width to an even number not above `head_dim` and
    /// treats missing frequency factors as 1), but the result of such parameters is meaningless.
    pub fn new(params: &RopeParams, pos: i32) -> Self {
        let dims_offset = params.dims_offset.min(params.head_dim);
        let n_dims = params.n_dims.min(params.head_dim - dims_offset) & !1;
        let n_pairs = n_dims / 2;

        let freq_scale = params.freq_scale;
        let ext_factor = params.ext_factor;
        let theta_scale = params.freq_base.powf(-2.0 / params.n_dims as f32);
        let corr_dims = yarn_corr_dims(
            params.n_dims,
            params.n_ctx_orig,
            params.freq_base,
            params.beta_fast,
            params.beta_slow,
        );
        // rope_yarn's magnitude correction, identical for every pair.
        let mscale = if ext_factor != 0.0 {
            params.attn_factor * (1.0 + 0.1 * (1.0 / freq_scale).ln())
        } else {
            params.attn_factor
        };

        let mut cos = Vec::with_capacity(n_pairs);
        let mut sin = Vec::with_capacity(n_pairs);
        let ff = params.freq_factors.as_deref().unwrap_or(&[]);
        // ggml passes the int64 position as the float `theta_base`.
        let mut theta = pos as f32;
        for i in 0..n_pairs {
            let f = ff.get(i).copied().unwrap_or(1.0);
            let theta_extrap = theta / f;
            let theta_interp = freq_scale * theta_extrap;
            let angle = if ext_factor != 0.0 {
                let ramp_mix = yarn_ramp(corr_dims[0], corr_dims[1], i) * ext_factor;
                theta_interp * (1.0 - ramp_mix) + theta_extrap * ramp_mix
            } else {
                theta_interp
            };
            cos.push(angle.cos() * mscale);
            sin.push(angle.sin() * mscale);
            theta *= theta_scale;
        }

        Self {
            cos,
            sin,
            n_dims,
            head_dim: params.head_dim,
            dims_offset,
            n_head: params.n_head,
            rope_type: params.rope_type,
            pos,
        }
    }

    /// The position this table rotates by.
    pub fn pos(&self) -> i32 {
        self.pos
    }

    /// `cos` and `sin` (magnitude-scaled) of each rotated pair, for the vector kernels.
    pub(crate) fn cos_sin(&self) -> (&[f32], &[f32]) {
        (&self.cos, &self.sin)
    }

    /// Rotated dimensions of each head (even, at most [`RopeTable::head_dim`]).
    pub(crate) fn n_dims(&self) -> usize {
        self.n_dims
    }

    /// Values per head.
    pub(crate) fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Leading values of each head before the rotated ones.
    pub(crate) fn dims_offset(&self) -> usize {
        self.dims_offset
    }

    /// How dimensions are paired.
    pub(crate) fn rope_type(&self) -> RopeType {
        self.rope_type
    }

    /// Whether rotating by this table changes nothing (every pair has cos 1 and sin 0, i.e. a
    /// zero angle without YaRN's magnitude scaling).
    pub fn is_identity(&self) -> bool {
        self.cos.iter().all(|&c| c == 1.0) && self.sin.iter().all(|&s| s == 0.0)
    }

    /// Rotates one cell's K row in place: each of the `n_head` heads (`head_dim` values each, head
    /// after head) is rotated independently by this table's position; only dimensions
    /// `dims_offset..dims_offset + n_dims` of every head change. Does not allocate.
    ///
    /// For each pair `(x0, x1)` with scaled `c = cos`, `s = sin`:
    /// `x0' = x0*c - x1*s`, `x1' = x0*s + x1*c` (ggml's order of operations).
    ///
    /// # Panics
    ///
    /// Panics if `row.len() != head_dim * n_head` ([`RopeParams::row_len`]); callers check the
    /// length before calling.
    pub fn rotate(&self, row: &mut [f32]) {
        assert_eq!(
            row.len(),
            self.head_dim * self.n_head,
            "rope: K row has {} values, expected head_dim * n_head = {} * {}",
            row.len(),
            self.head_dim,
            self.n_head
        );
        let n_dims = self.n_dims;
        let half = n_dims / 2;
        for head in row.chunks_exact_mut(self.head_dim) {
            let rotated = &mut head[self.dims_offset..self.dims_offset + n_dims];
            match self.rope_type {
                RopeType::Norm => {
                    for ((pair, &c), &s) in
                        rotated.chunks_exact_mut(2).zip(&self.cos).zip(&self.sin)
                    {
                        let x0 = pair[0];
                        let x1 = pair[1];
                        pair[0] = x0 * c - x1 * s;
                        pair[1] = x0 * s + x1 * c;
                    }
                }
                RopeType::Neox => {
                    let (lo, hi) = rotated.split_at_mut(half);
                    for (((a, b), &c), &s) in lo
                        .iter_mut()
                        .zip(hi.iter_mut())
                        .zip(&self.cos)
                        .zip(&self.sin)
                    {
                        let x0 = *a;
                        let x1 = *b;
                        *a = x0 * c - x1 * s;
                        *b = x0 * s + x1 * c;
                    }
                }
            }
        }
    }
}

/// RoPE parameters for the K-shift: one set for every layer, with optional per-layer
/// replacements (e.g. sliding-window layers with another base frequency).
#[derive(Clone, Debug, PartialEq)]
pub struct ShiftParams {
    /// Parameters of every layer without an override.
    pub rope: RopeParams,
    /// `(layer, parameters)` replacements.
    pub per_layer: Vec<(u32, RopeParams)>,
}

impl ShiftParams {
    pub(crate) fn for_layer(&self, il: u32) -> &RopeParams {
        self.per_layer
            .iter()
            .find(|(l, _)| *l == il)
            .map_or(&self.rope, |(_, p)| p)
    }

    /// The parameters of a cache that holds the model layers `layers` (its layer `k` is
    /// model layer `layers[k]`), as a part of an iSWA or hybrid memory does.
    pub fn for_layers(&self, layers: &[u32]) -> ShiftParams {
        let rope = layers
            .first()
            .map_or(&self.rope, |&il| self.for_layer(il))
            .clone();
        let per_layer = layers
            .iter()
            .enumerate()
            .map(|(k, &il)| (k as u32, self.for_layer(il).clone()))
            .filter(|(_, p)| *p != rope)
            .collect();
        ShiftParams { rope, per_layer }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tiny xorshift64 generator for reproducible rows in [-1, 1).
    struct XorShift(u64);

    impl XorShift {
        fn next_f32(&mut self) -> f32 {
            let mut x = self.0;
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            self.0 = x;
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }

        fn row(&mut self, n: usize) -> Vec<f32> {
            (0..n).map(|_| self.next_f32()).collect()
        }
    }

    /// Direct f64 evaluation of the RoPE formula (no iterated theta, no f32 rounding).
    fn reference(p: &RopeParams, pos: i32, row: &[f32]) -> Vec<f64> {
        let n_dims = p.n_dims;
        let base = p.freq_base as f64;
        let fs = p.freq_scale as f64;
        let ext = p.ext_factor as f64;
        let corr = |beta: f64| {
            n_dims as f64 * (p.n_ctx_orig as f64 / (beta * 2.0 * std::f64::consts::PI)).ln()
                / (2.0 * base.ln())
        };
        let lo = corr(p.beta_fast as f64).floor().max(0.0);
        let hi = corr(p.beta_slow as f64).ceil().min(n_dims as f64 - 1.0);
        let mut out: Vec<f64> = row.iter().map(|&v| v as f64).collect();
        for h in 0..p.n_head {
            let x = &mut out[h * p.head_dim..(h + 1) * p.head_dim];
            for i in 0..n_dims / 2 {
                let ff = p.freq_factors.as_ref().map_or(1.0, |f| f[i] as f64);
                let theta_e = pos as f64 * base.powf(-2.0 * i as f64 / n_dims as f64) / ff;
                let theta_i = fs * theta_e;
                let (theta, mscale) = if ext != 0.0 {
                    let y = (i as f64 - lo) / (hi - lo).max(0.001);
                    let ramp = (1.0 - y.clamp(0.0, 1.0)) * ext;
                    (
                        theta_i * (1.0 - ramp) + theta_e * ramp,
                        p.attn_factor as f64 * (1.0 + 0.1 * (1.0 / fs).ln()),
                    )
                } else {
                    (theta_i, p.attn_factor as f64)
                };
                let (s, c) = theta.sin_cos();
                let (s, c) = (s * mscale, c * mscale);
                let (a, b) = match p.rope_type {
                    RopeType::Norm => (2 * i, 2 * i + 1),
                    RopeType::Neox => (i, i + n_dims / 2),
                };
                let (x0, x1) = (x[a], x[b]);
                x[a] = x0 * c - x1 * s;
                x[b] = x0 * s + x1 * c;
            }
        }
        out
    }

    /// Largest |got - want| / max(1, |want|) over the row.
    fn max_rel_err(got: &[f32], want: &[f64]) -> f64 {
        got.iter()
            .zip(want)
            .map(|(&g, &w)| (g as f64 - w).abs() / w.abs().max(1.0))
            .fold(0.0, f64::max)
    }

    fn check_against_reference(p: &RopeParams, positions: &[i32], tol: f64, seed: u64) {
        p.validate().unwrap();
        let mut rng = XorShift(seed);
        for &pos in positions {
            let row = rng.row(p.row_len());
            let mut got = row.clone();
            RopeTable::new(p, pos).rotate(&mut got);
            let want = reference(p, pos, &row);
            let err = max_rel_err(&got, &want);
            assert!(err <= tol, "pos {pos}: max rel err {err:e} > {tol:e}");
        }
    }

    const POSITIONS: [i32; 7] = [1, -1, 3, 7, -13, 17, 29];

    #[test]
    fn norm_matches_formula() {
        let p = RopeParams::new(64, 80, 3, RopeType::Norm);
        check_against_reference(&p, &POSITIONS, 1e-5, 0x1234_5678);
    }

    #[test]
    fn neox_matches_formula() {
        let p = RopeParams::new(64, 64, 4, RopeType::Neox);
        check_against_reference(&p, &POSITIONS, 1e-5, 0x9abc_def0);
        let mut p = RopeParams::new(32, 128, 2, RopeType::Neox);
        p.freq_base = 500_000.0;
        check_against_reference(&p, &POSITIONS, 1e-5, 0x0bad_cafe);
    }

    #[test]
    fn large_positions_stay_close() {
        // f32 angles lose absolute precision as the position grows, exactly as in ggml.
        // The error grows about linearly with |pos| (~1.2e-7 * |pos| measured).
        let p = RopeParams::new(128, 128, 2, RopeType::Neox);
        for pos in [1000, -4096, 32_000] {
            check_against_reference(&p, &[pos], 2e-7 * f64::from(pos).abs(), 42);
        }
    }

    #[test]
    fn composition_is_additive() {
        for rope_type in [RopeType::Norm, RopeType::Neox] {
            let p = RopeParams::new(64, 96, 3, rope_type);
            let mut rng = XorShift(7);
            for (a, b) in [(5, 11), (13, -29), (-40, 17), (100, -100)] {
                let row = rng.row(p.row_len());
                let mut twice = row.clone();
                RopeTable::new(&p, a).rotate(&mut twice);
                RopeTable::new(&p, b).rotate(&mut twice);
                let mut once = row.clone();
                RopeTable::new(&p, a + b).rotate(&mut once);
                for (i, (x, y)) in twice.iter().zip(&once).enumerate() {
                    assert!(
                        (x - y).abs() <= 1e-4,
                        "{rope_type:?} a={a} b={b} [{i}]: {x} vs {y}"
                    );
                }
            }
        }
    }

    #[test]
    fn zero_position_is_identity() {
        for rope_type in [RopeType::Norm, RopeType::Neox] {
            let p = RopeParams::new(48, 64, 5, rope_type);
            let row = XorShift(99).row(p.row_len());
            let mut got = row.clone();
            RopeTable::new(&p, 0).rotate(&mut got);
            assert_eq!(got, row);
        }
    }

    #[test]
    fn dims_beyond_n_dims_untouched() {
        for rope_type in [RopeType::Norm, RopeType::Neox] {
            let p = RopeParams::new(16, 40, 3, rope_type);
            let row = XorShift(5).row(p.row_len());
            let mut got = row.clone();
            RopeTable::new(&p, 123).rotate(&mut got);
            for h in 0..p.n_head {
                let r = h * p.head_dim..(h + 1) * p.head_dim;
                assert_eq!(got[r.clone()][16..], row[r.clone()][16..]);
                assert_ne!(got[r.clone()][..16], row[r][..16]);
            }
        }
    }

    /// A latent K head (the latent, then its rotated dimensions): the rotation behind
    /// `dims_offset` is the plain head's rotation moved there, and the latent stays.
    #[test]
    fn a_dims_offset_rotates_the_dimensions_behind_it_as_a_plain_head_rotates_its_first() {
        for rope_type in [RopeType::Norm, RopeType::Neox] {
            let mut latent = RopeParams::new(16, 48, 2, rope_type);
            latent.dims_offset = 32;
            latent.validate().unwrap();
            let plain = RopeParams::new(16, 16, 1, rope_type);
            let row = XorShift(7).row(latent.row_len());
            let mut got = row.clone();
            RopeTable::new(&latent, -7).rotate(&mut got);
            for h in 0..2 {
                let head = h * 48..(h + 1) * 48;
                assert_eq!(got[head.clone()][..32], row[head.clone()][..32]);
                let mut tail = row[head.clone()][32..].to_vec();
                RopeTable::new(&plain, -7).rotate(&mut tail);
                assert_eq!(got[head][32..], tail[..]);
            }
            latent.dims_offset = 33;
            let e = latent.validate().unwrap_err().to_string();
            assert!(
                e.contains("dims_offset (33) + n_dims (16) must not exceed head_dim (48)"),
                "{e}"
            );
        }
    }

    #[test]
    fn heads_rotate_independently_with_same_angles() {
        let p = RopeParams::new(32, 32, 3, RopeType::Norm);
        let head = XorShift(11).row(32);
        let mut row: Vec<f32> = head.iter().chain(&head).chain(&head).copied().collect();
        RopeTable::new(&p, 9).rotate(&mut row);
        assert_eq!(row[..32], row[32..64]);
        assert_eq!(row[..32], row[64..]);
    }

    #[test]
    fn yarn_matches_formula() {
        for rope_type in [RopeType::Norm, RopeType::Neox] {
            let mut p = RopeParams::new(64, 64, 2, rope_type);
            p.ext_factor = 1.0;
            p.freq_scale = 0.25;
            p.n_ctx_orig = 4096;
            let [lo, hi] = yarn_corr_dims(64, 4096, 10000.0, 32.0, 1.0);
            assert_eq!((lo, hi), (10.0, 23.0), "ramp must cover part of the pairs");
            check_against_reference(&p, &POSITIONS, 1e-5, 0x5eed);
            // Partial mix and a non-unit attn_factor.
            p.ext_factor = 0.5;
            p.attn_factor = 0.8;
            check_against_reference(&p, &POSITIONS, 1e-5, 0x5eee);
        }
    }

    #[test]
    fn yarn_scales_magnitude() {
        let mut p = RopeParams::new(8, 8, 1, RopeType::Norm);
        p.ext_factor = 1.0;
        p.freq_scale = 0.25;
        p.n_ctx_orig = 4096;
        let t = RopeTable::new(&p, 3);
        let mscale = 1.0 + 0.1 * (4.0f32).ln();
        for (c, s) in t.cos.iter().zip(&t.sin) {
            assert!(((c * c + s * s).sqrt() - mscale).abs() < 1e-6);
        }
    }

    #[test]
    fn freq_factors_divide_angles() {
        for rope_type in [RopeType::Norm, RopeType::Neox] {
            let mut p = RopeParams::new(32, 32, 2, rope_type);
            let plain = p.clone();
            // Uniform factor 2 at position 2q is bit-identical to no factors at position q.
            p.freq_factors = Some(vec![2.0; 16]);
            p.validate().unwrap();
            let row = XorShift(3).row(p.row_len());
            for q in [1, 5, -8, 21] {
                let mut with_ff = row.clone();
                RopeTable::new(&p, 2 * q).rotate(&mut with_ff);
                let mut without = row.clone();
                RopeTable::new(&plain, q).rotate(&mut without);
                assert_eq!(with_ff, without, "{rope_type:?} q={q}");
            }
            // Varied factors against the formula, with and without YaRN.
            p.freq_factors = Some((0..16).map(|i| 1.0 + 0.37 * i as f32).collect());
            check_against_reference(&p, &POSITIONS, 1e-5, 77);
            p.ext_factor = 1.0;
            p.freq_scale = 0.5;
            p.n_ctx_orig = 8192;
            check_against_reference(&p, &POSITIONS, 1e-5, 78);
        }
    }

    #[test]
    fn validate_accepts_defaults() {
        RopeParams::new(128, 128, 8, RopeType::Neox)
            .validate()
            .unwrap();
        assert_eq!(RopeParams::new(64, 128, 8, RopeType::Norm).row_len(), 1024);
    }

    #[test]
    fn validate_rejects_each_bad_parameter() {
        let good = RopeParams::new(8, 16, 2, RopeType::Norm);
        type Mutate = fn(&mut RopeParams);
        let cases: Vec<(&str, Mutate)> = vec![
            ("n_dims", |p| p.n_dims = 0),
            ("n_dims", |p| p.n_dims = 7),
            ("n_dims", |p| p.n_dims = 18),
            ("head_dim", |p| p.head_dim = 0),
            ("n_head", |p| p.n_head = 0),
            ("head_dim * n_head", |p| p.n_head = usize::MAX),
            ("freq_base", |p| p.freq_base = 0.0),
            ("freq_base", |p| p.freq_base = -1.0),
            ("freq_base", |p| p.freq_base = f32::NAN),
            ("freq_base", |p| p.freq_base = f32::INFINITY),
            ("freq_scale", |p| p.freq_scale = 0.0),
            ("freq_scale", |p| p.freq_scale = f32::NAN),
            ("ext_factor", |p| p.ext_factor = f32::NAN),
            ("attn_factor", |p| p.attn_factor = f32::INFINITY),
            ("beta_fast", |p| p.beta_fast = f32::NAN),
            ("beta_slow", |p| p.beta_slow = f32::NEG_INFINITY),
            ("freq_factors", |p| p.freq_factors = Some(vec![1.0; 3])),
            ("freq_factors", |p| p.freq_factors = Some(vec![1.0; 5])),
            ("freq_factors[2]", |p| {
                p.freq_factors = Some(vec![1.0, 1.0, 0.0, 1.0])
            }),
            ("freq_factors[1]", |p| {
                p.freq_factors = Some(vec![1.0, f32::NAN, 1.0, 1.0])
            }),
        ];
        for (name, mutate) in cases {
            let mut p = good.clone();
            mutate(&mut p);
            match p.validate() {
                Err(KvError::InvalidArg(msg)) => {
                    assert!(msg.contains(name), "message {msg:?} should name {name}")
                }
                other => panic!("{name}: expected InvalidArg, got {other:?}"),
            }
        }
    }

    #[test]
    #[should_panic(expected = "K row has")]
    fn rotate_panics_on_wrong_row_len() {
        let p = RopeParams::new(8, 16, 2, RopeType::Norm);
        RopeTable::new(&p, 1).rotate(&mut [0.0; 31]);
    }

    #[test]
    fn invalid_geometry_does_not_panic_in_new() {
        let mut p = RopeParams::new(9, 8, 1, RopeType::Neox);
        p.freq_factors = Some(vec![]);
        let mut row = vec![1.0; 8];
        RopeTable::new(&p, 5).rotate(&mut row);
    }

    #[test]
    fn ggml_mode_round_trip() {
        for t in [RopeType::Norm, RopeType::Neox] {
            assert_eq!(RopeType::from_ggml_mode(t.ggml_mode()), Some(t));
        }
        for m in [-1, 1, 8, 24, 40] {
            assert_eq!(RopeType::from_ggml_mode(m), None);
        }
    }
}
