//! K-shift against llama.cpp 0.1.161's own: the peer's state before a context shift, shifted by
//! our cache (for a Hadamard-rotated quantized K: rotate back, RoPE, rotate forward), holds the
//! K rows the peer's shift produced, and the peer continues our shifted state with the token it
//! produced after its own shift.

use llama_kv_cache::files::{inspect_bytes, params_for_payload};
use llama_kv_cache::{
    KvCache, Layout, ReadOptions, RopeParams, RopeType, ShiftParams, Tensor, WriteOptions,
};
use today_peer::{kshift_specs, rope_geometry, Spec};

fn loaded(spec: &Spec, bytes: &[u8]) -> KvCache {
    let ins = inspect_bytes(bytes).unwrap();
    let mut p = params_for_payload(&ins.payload, false).unwrap();
    p.size = today_peer::CTX;
    let mut c = KvCache::new(p).unwrap();
    c.load_session_bytes(bytes, ReadOptions::default(), None)
        .unwrap_or_else(|e| panic!("t161-{}: {e}", spec.name));
    c
}

/// K rows of every cell of sequence 0 by position, per layer.
fn k_by_pos(c: &KvCache) -> Vec<Vec<(i32, Vec<u8>)>> {
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

#[test]
fn our_k_shift_of_a_rotated_quantized_k_matches_llama_cpp_0_1_161() {
    let dir = std::env::temp_dir().join(format!("today-kshift-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for spec in kshift_specs() {
        let sidecar = spec.sidecar().unwrap();
        let (p0, p1, d) = spec.shift.unwrap();
        let pre = std::fs::read(spec.session_path()).unwrap();
        let post = std::fs::read(spec.post_path()).unwrap();
        let mut ours = loaded(&spec, &pre);
        assert_eq!(
            (ours.params().n_rot_k, ours.params().n_rot_v),
            spec.n_rot,
            "t161-{}",
            spec.name
        );
        ours.seq_rm(0, p0, p1).unwrap();
        ours.seq_add(0, p1, -1, -d).unwrap();
        let (head_dim, n_head) = rope_geometry(spec.model);
        let rope = RopeParams::new(head_dim, head_dim, n_head, RopeType::Norm);
        ours.update(
            Some(&ShiftParams {
                rope,
                per_layer: vec![],
            }),
            None,
        )
        .unwrap_or_else(|e| panic!("t161-{}: {e}", spec.name));

        // the peer's state after its shift also holds the token it decoded next: compare the
        // cells both have, by position
        let theirs = loaded(&spec, &post);
        let (a, b) = (k_by_pos(&ours), k_by_pos(&theirs));
        let mut rows = 0;
        for (la, lb) in a.iter().zip(&b) {
            for (pos, row) in la {
                let other = lb.iter().find(|(p, _)| p == pos).unwrap_or_else(|| {
                    panic!("t161-{}: the peer has no cell at position {pos}", spec.name)
                });
                assert!(
                    *row == other.1,
                    "t161-{}: K at position {pos} differs from llama.cpp 0.1.161's shift",
                    spec.name
                );
                rows += 1;
            }
        }
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
                "llama",
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

#[test]
fn rotated_caches_re_typed_by_us_continue_in_llama_cpp_0_1_161() {
    use llama_kv_cache::files::convert_bytes;
    use llama_kv_cache::{ConvertOptions, GgmlType};
    use today_peer::specs;
    let dir = std::env::temp_dir().join(format!("today-retype-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let by_name = |n: &str| specs().into_iter().find(|s| s.name == n).unwrap();
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
