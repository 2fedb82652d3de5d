//! K-shift against llama.cpp 0.1.161's own: the peer's state before a context shift, shifted by
//! our cache (for a Hadamard-rotated quantized K: rotate back, RoPE, rotate forward) with the
//! RoPE parameters `ModelInfo` derives from the model's GGUF, holds the K rows the peer's shift
//! produced, and the peer continues our shifted state with the token it produced after its own
//! shift. Norm RoPE (llama), NeoX RoPE (qwen2), YaRN scaling (both) and latent attention
//! (deepseek2: the rotated dimensions at the end of each K head), with the controls that show
//! the comparison can fail: NeoX shifted as norm, YaRN without its ramp and magnitude, a latent
//! head rotated from its start.

use conformance::models_dir;
use conformance::today::{kshift_specs, rope_geometry, spec_named, Spec};
use llama_kv_cache::state::files::{inspect_bytes, params_for_payload};
use llama_kv_cache::{
    Layout, ModelInfo, ReadOptions, RopeParams, RopeType, SeedCache, ShiftParams, Tensor,
    WriteOptions,
};

fn loaded(spec: &Spec, bytes: &[u8]) -> SeedCache {
    let ins = inspect_bytes(bytes).unwrap();
    let mut p = params_for_payload(&ins.payload, false).unwrap();
    p.size = conformance::today::CTX;
    let mut c = SeedCache::new(p).unwrap();
    c.load_session_bytes(bytes, ReadOptions::default(), None)
        .unwrap_or_else(|e| panic!("t161-{}: {e}", spec.name));
    c
}

/// K rows of every cell of sequence 0 by position, per layer.
type RowsByPos = Vec<Vec<(i32, Vec<u8>)>>;

fn k_by_pos(c: &SeedCache) -> RowsByPos {
    (0..c.params().n_layer)
        .map(|il| {
            let mut rows: Vec<(i32, Vec<u8>)> = (0..c.params().size)
                .filter(|&i| c.cell(i).is_ok_and(|cell| cell.pos >= 0))
                .map(|i| {
                    let row = c.read_rows(il, Tensor::K, i, 1).unwrap();
                    (c.cell(i).unwrap().pos, row)
                })
                .collect();
            rows.sort_by_key(|r| r.0);
            rows
        })
        .collect()
}

/// The spec's model as `ModelInfo` reads it.
fn model(spec: &Spec) -> ModelInfo {
    ModelInfo::from_file(&models_dir().join(spec.model), false)
        .unwrap_or_else(|e| panic!("t161-{}: {e}", spec.name))
}

/// The RoPE a user passes by hand for each model of the shift fixtures (what the model's
/// metadata says, in `update({ rope })` terms): the derived parameters must equal it.
fn expected_rope(model: &str) -> RopeParams {
    if model == "deepseek2-mla.gguf" {
        // one latent K head of kv_lora_rank 32 then the 16 rotated dimensions (norm RoPE),
        // which the shift rotates behind the 32 (0.1.161's `n_embd_nope`)
        let mut p = RopeParams::new(16, 48, 1, RopeType::Norm);
        p.dims_offset = 32;
        p.n_ctx_orig = 256;
        return p;
    }
    let (head_dim, n_head) = rope_geometry(model);
    let neox = model.starts_with("qwen2");
    let ty = if neox { RopeType::Neox } else { RopeType::Norm };
    let mut p = RopeParams::new(head_dim, head_dim, n_head, ty);
    // YaRN: ext_factor 1, freq_scale 1 / factor, n_ctx_orig the original context (64)
    let yarn = match model {
        "qwen2-h64-yarn.gguf" => Some(4.0),
        "llama-h64-yarn.gguf" => Some(12.0),
        _ => None,
    };
    p.n_ctx_orig = 256;
    if let Some(factor) = yarn {
        p.freq_scale = 1.0 / factor;
        p.ext_factor = 1.0;
        p.n_ctx_orig = 64;
        // 0.1.161's YaRN attention factor: get_mscale(factor) / (1 + 0.1 ln factor) in f32
        p.attn_factor = if factor == 12.0 {
            1.0 - f32::EPSILON / 2.0
        } else {
            1.0
        };
    }
    p
}

/// The shift fixtures whose K is quantized (and rotated): f32 K rows differ from 0.1.161's in
/// the last bit where its compiler fused `a*b - c*d` into FMA instructions (`-mfma`), so the
/// f32 fixture is compared on its own, below.
fn quantized_kshift_specs() -> Vec<Spec> {
    kshift_specs()
        .into_iter()
        .filter(|s| s.types.0 != 0)
        .collect()
}

/// Our shift of the spec's state before the shift, with `rope` on every layer.
fn shifted(spec: &Spec, rope: &RopeParams) -> SeedCache {
    let (p0, p1, d) = spec.shift.unwrap();
    let pre = std::fs::read(spec.session_path()).unwrap();
    let mut ours = loaded(spec, &pre);
    assert_eq!(
        (ours.params().n_rot_k, ours.params().n_rot_v),
        spec.n_rot,
        "t161-{}",
        spec.name
    );
    ours.seq_rm(0, p0, p1).unwrap();
    ours.seq_add(0, p1, -1, -d).unwrap();
    let shift = ShiftParams {
        rope: rope.clone(),
        per_layer: vec![],
    };
    ours.update(Some(&shift), None)
        .unwrap_or_else(|e| panic!("t161-{}: {e}", spec.name));
    ours
}

/// Compares our K rows with those of 0.1.161's state after its shift (which also holds the
/// token it decoded next: the cells both have, by position). The number of rows compared, or
/// the first position whose row differs.
fn compare_with_peer(spec: &Spec, ours: &RowsByPos) -> Result<usize, String> {
    let post = std::fs::read(spec.post_path()).unwrap();
    let theirs = k_by_pos(&loaded(spec, &post));
    let mut rows = 0;
    for (il, (la, lb)) in ours.iter().zip(&theirs).enumerate() {
        for (pos, row) in la {
            let other = lb.iter().find(|(p, _)| p == pos).unwrap_or_else(|| {
                panic!("t161-{}: the peer has no cell at position {pos}", spec.name)
            });
            if *row != other.1 {
                return Err(format!("layer {il}, position {pos}"));
            }
            rows += 1;
        }
    }
    Ok(rows)
}

#[test]
fn our_k_shift_of_a_rotated_quantized_k_matches_llama_cpp_0_1_161() {
    let dir = std::env::temp_dir().join(format!("today-kshift-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for spec in quantized_kshift_specs() {
        let sidecar = spec.sidecar().unwrap();
        let (p0, p1, d) = spec.shift.unwrap();
        let info = model(&spec);
        let derived = info
            .shift_params(None)
            .unwrap_or_else(|| panic!("t161-{}: no K-shift parameters", spec.name));
        assert_eq!(derived.per_layer, vec![], "t161-{}", spec.name);
        assert_eq!(
            derived.rope,
            expected_rope(spec.model),
            "t161-{}",
            spec.name
        );
        let ours = shifted(&spec, &derived.rope);
        let rows = compare_with_peer(&spec, &k_by_pos(&ours)).unwrap_or_else(|at| {
            panic!(
                "t161-{}: K at {at} differs from llama.cpp 0.1.161's shift",
                spec.name
            )
        });
        assert_eq!(
            rows,
            2 * (spec.prompts[0].len() - (p1 - p0) as usize),
            "t161-{}",
            spec.name
        );

        // and the peer continues our shifted state as it continued its own
        let file = dir.join(format!("{}.ggsn", spec.name));
        let bytes = ours
            .session_file_bytes(
                &spec.prompts[0],
                &info.arch,
                None,
                WriteOptions {
                    version: Some(11),
                    layout: Layout::StreamsRot,
                    n_stream: 1,
                },
                None,
            )
            .unwrap();
        std::fs::write(&file, bytes).unwrap();
        let next = sidecar["next"][0].as_i64().unwrap();
        let pos = spec.prompts[0].len() - d as usize;
        let got = spec
            .continue_file(&file, None, next, pos)
            .unwrap_or_else(|e| panic!("t161-{}: {e}", spec.name));
        assert_eq!(
            got,
            sidecar["next2"][0].as_i64().unwrap(),
            "t161-{}",
            spec.name
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The comparison above can fail: the wrong pairing, or YaRN without its extrapolation mix and
/// magnitude scale, gives K rows that differ from the peer's.
#[test]
fn a_k_shift_with_the_wrong_rope_differs_from_llama_cpp_0_1_161() {
    let mut controls = 0;
    for spec in quantized_kshift_specs() {
        let right = expected_rope(spec.model);
        let mut wrong = Vec::new();
        if right.rope_type == RopeType::Neox {
            wrong.push((
                "norm pairing",
                RopeParams {
                    rope_type: RopeType::Norm,
                    ..right.clone()
                },
            ));
        }
        if right.dims_offset != 0 {
            // a latent K head rotated from its first dimensions, as a plain head is
            wrong.push((
                "rotated from the head's start",
                RopeParams {
                    dims_offset: 0,
                    ..right.clone()
                },
            ));
        }
        if right.ext_factor != 0.0 {
            // linear interpolation only: no ramp towards extrapolation, no mscale
            wrong.push((
                "no YaRN",
                RopeParams {
                    ext_factor: 0.0,
                    ..right.clone()
                },
            ));
            // the ramp without the magnitude scale (mscale) cancelled by attn_factor
            let mscale = 1.0 + 0.1 * (1.0 / right.freq_scale).ln();
            wrong.push((
                "no YaRN mscale",
                RopeParams {
                    attn_factor: 1.0 / mscale,
                    ..right.clone()
                },
            ));
        }
        for (what, rope) in wrong {
            let ours = shifted(&spec, &rope);
            assert!(
                compare_with_peer(&spec, &k_by_pos(&ours)).is_err(),
                "t161-{}: a shift with {what} matched the peer's",
                spec.name
            );
            controls += 1;
        }
    }
    assert_eq!(
        controls,
        4 + 4 * 2 + 1,
        "NeoX: 1 control each, YaRN: 2 each, latent: 1"
    );
}

#[test]
fn rotated_caches_re_typed_by_us_continue_in_llama_cpp_0_1_161() {
    use llama_kv_cache::convert_bytes;
    use llama_kv_cache::{ConvertOptions, GgmlType};
    let dir = std::env::temp_dir().join(format!("today-retype-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let by_name = spec_named;
    // (source fixture, context whose types and rotation the re-typed file must match)
    for (from, to, ty, n_rot) in [
        ("h64-q8_0-fa", "h64-f16-fa", GgmlType::F16, 0),
        ("h64-f16-fa", "h64-q8_0-fa", GgmlType::Q8_0, 64),
        ("h64-f16-fa", "h64-q4_0-fa", GgmlType::Q4_0, 64),
    ] {
        let (src, target) = (by_name(from), by_name(to));
        let bytes = std::fs::read(src.session_path()).unwrap();
        let out = convert_bytes(
            &bytes,
            &ConvertOptions {
                write: WriteOptions {
                    version: Some(11),
                    ..WriteOptions::default()
                },
                type_k: Some(ty),
                type_v: Some(ty),
                n_rot_k: Some(n_rot),
                n_rot_v: Some(n_rot),
                ..ConvertOptions::default()
            },
        )
        .unwrap_or_else(|e| panic!("{from} -> {to}: {e}"));
        let file = dir.join(format!("{from}-as-{to}.ggsn"));
        std::fs::write(&file, out).unwrap();
        let side = src.sidecar().unwrap();
        let next = side["next"][0].as_i64().unwrap();
        let got = target
            .continue_file(&file, None, next, src.prompts[0].len())
            .unwrap_or_else(|e| panic!("{from} re-typed for {to}: {e}"));
        assert_eq!(
            got,
            side["next2"][0].as_i64().unwrap(),
            "{from} re-typed for {to}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Regression: `ModelInfo::shift_params` passed YaRN's `rope.scaling.attn_factor` (1) as the
/// shift's attention factor, as llama.cpp 0.1.103 does; 0.1.161 computes
/// `get_mscale(f) * (1 / (1 + 0.1 ln f))`, 1 - 2^-24 for a factor of 12. The quantized rows of
/// the other fixtures cannot show one ulp of magnitude; an f32 K shows it in every row. The
/// cells the shift does not move (delta 0: cos = 1 * mscale, sin = 0) take no FMA path, so they
/// must be bit-identical; moved cells may differ from the peer's FMA-fused arithmetic in the
/// last bits.
#[test]
fn regression_yarn_attention_factor_is_0_1_161s_not_the_metadata_value() {
    let spec = spec_named("h64-yarn-f32-fa-shift");
    let derived = model(&spec).shift_params(None).unwrap().rope;
    assert_eq!(derived, expected_rope(spec.model));
    assert_eq!(derived.attn_factor.to_bits(), 0x3f7f_ffff);
    let post = std::fs::read(spec.post_path()).unwrap();
    let theirs = k_by_pos(&loaded(&spec, &post));
    let (p0, _, _) = spec.shift.unwrap();
    let unmoved = |rows: &RowsByPos| -> Vec<Vec<u8>> {
        rows.iter()
            .flat_map(|l| l.iter().filter(|(p, _)| *p < p0).map(|(_, r)| r.clone()))
            .collect()
    };
    let ours = k_by_pos(&shifted(&spec, &derived));
    assert_eq!(unmoved(&ours).len(), 4);
    assert!(unmoved(&ours) == unmoved(&theirs), "unmoved rows differ");
    // every moved row within a few ulp of the row's largest value (the FMA-fused `x0*c - x1*s`
    // rounds once where ours rounds twice; small results of that difference lose more bits)
    let floats = |r: &[u8]| -> Vec<f32> {
        r.chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    };
    for (la, lb) in ours.iter().zip(&theirs) {
        for (pos, row) in la {
            let other = floats(&lb.iter().find(|(p, _)| p == pos).unwrap().1);
            let row = floats(row);
            let scale = other.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (a, b) in row.iter().zip(&other) {
                assert!(
                    (a - b).abs() <= 4.0 * f32::EPSILON * scale,
                    "position {pos}: {a:e} vs {b:e}"
                );
            }
        }
    }
    // with the metadata's attention factor (1), the unmoved rows differ
    let old = RopeParams {
        attn_factor: 1.0,
        ..derived
    };
    assert!(unmoved(&k_by_pos(&shifted(&spec, &old))) != unmoved(&theirs));
}
