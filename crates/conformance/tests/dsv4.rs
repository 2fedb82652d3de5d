//! DeepSeek V4's states (`llama_kv_cache_dsv4`) as llama.cpp 0.1.161 writes them for a tiny
//! deepseek4 model (`interop/make_models.py`; fixture `__test__/fixtures/dsv4/`): read part by
//! part (the raw cache's base and window caches, three compressed caches, three compressor
//! states), checked against the model, converted back byte for byte, a sequence taken out of a
//! session as the peer saves one (it continues our file with its own next token), damaged
//! states refused by name, and no live cache loads one.

use conformance::models_dir;
use conformance::today::{dsv4_spec, dsv4_specs, Spec};
use llama_kv_cache::model::{MemoryKind, ModelInfo};
use llama_kv_cache::state::dsv4::{self, Group, SectionKind};
use llama_kv_cache::state::files::{inspect_bytes, Inspection};
use llama_kv_cache::state::fit::check_state;
use llama_kv_cache::{
    convert_bytes, CacheParams, ConvertOptions, FileKind, GgmlType, KvError, PartRole, SeedCache,
};

fn fixture(spec: &Spec) -> (Vec<u8>, Vec<u8>) {
    let read = |p: std::path::PathBuf| {
        std::fs::read(&p).unwrap_or_else(|e| {
            panic!(
                "{}: {e} (make it: cargo run -p conformance --bin make-t161-fixtures {})",
                p.display(),
                spec.name
            )
        })
    };
    (read(spec.session_path()), read(spec.sequence_path()))
}

fn section_bytes<'a>(bytes: &'a [u8], ins: &Inspection, i: usize) -> &'a [u8] {
    let r = &ins.compressed.as_ref().unwrap().sections[i].range;
    &bytes[ins.payload_offset + r.start..ins.payload_offset + r.end]
}

#[test]
fn dsv4_states_of_0_1_161_read_part_by_part_and_fit_their_model() {
    for spec in dsv4_specs() {
        read_part_by_part(&spec);
    }
    // 135 positions: 33 rows of 4, one of 128
    assert_eq!(dsv4::used_rows(134, 4, 256), 33);
    assert_eq!(dsv4::used_rows(134, 128, 256), 1);
}

fn read_part_by_part(spec: &Spec) {
    let (session, sequence) = fixture(spec);
    let seqs = spec.prompts.len() as u32;
    let last = (spec.prompts[spec.seq as usize].len() - 1) as i32;
    let k_type = GgmlType::from_id(spec.types.0).unwrap();
    for (bytes, n_stream, whole) in [(&session, seqs, true), (&sequence, 1, false)] {
        let ins = inspect_bytes(bytes).unwrap();
        assert_eq!(ins.memory, MemoryKind::Dsv4);
        let roles: Vec<PartRole> = ins.parts.iter().map(|p| p.role).collect();
        assert_eq!(roles, [PartRole::Base, PartRole::Swa]);
        // every layer uses the window: the base cache holds cells but no layer, the window
        // cache K rows only (K is V), one stream per sequence whatever the context
        let [base, swa] = [&ins.parts[0].payload, &ins.parts[1].payload];
        assert!(base.streams.iter().all(|s| s.layers.is_empty()));
        assert_eq!(swa.streams.len(), seqs as usize);
        assert!(swa.no_v());
        let window = swa.streams.iter().find(|s| !s.layers.is_empty()).unwrap();
        assert_eq!(window.v_trans, Some(!spec.fa), "{}", spec.name);
        let c = ins.compressed.as_ref().unwrap();
        assert!(!c.partial);
        let shape: Vec<(Group, bool, Vec<u32>)> = c
            .sections
            .iter()
            .map(|s| {
                let cache = matches!(s.kind, SectionKind::Compressed { .. });
                (s.group, cache, s.layers.iter().map(|l| l.il).collect())
            })
            .collect();
        // the model's compression ratios are [0, 4, 128]: CSA and its indexer on layer 1, HCA
        // on layer 2
        assert_eq!(
            shape,
            [
                (Group::Csa, true, vec![1]),
                (Group::Hca, true, vec![2]),
                (Group::Lid, true, vec![1]),
                (Group::Csa, false, vec![1]),
                (Group::Hca, false, vec![2]),
                (Group::Lid, false, vec![1]),
            ]
        );
        for s in &c.sections {
            assert_eq!(s.n_stream, n_stream, "{:?}", s.group);
            if let SectionKind::Compressed { n_rows, .. } = s.kind {
                // a session writes every row, a sequence the rows its positions filled, of the
                // cache's K type
                let want = if whole {
                    256
                } else {
                    dsv4::used_rows(last, s.group.ratio(), 256)
                };
                assert_eq!(n_rows, want, "{:?}", s.group);
                assert_eq!(s.layers[0].tensors[0].type_id, k_type.id());
            }
        }
        let model = ModelInfo::from_file(&models_dir().join(spec.model), false).unwrap();
        let fit = check_state(&ins, &model);
        assert!(fit.fits, "{:?}", fit.reasons);
        let other = ModelInfo::from_file(&models_dir().join("deepseek32-dsa.gguf"), false).unwrap();
        let fit = check_state(&ins, &other);
        assert!(fit.reasons.iter().any(|r| r.field == "memory"), "{fit:?}");
    }
}

#[test]
fn dsv4_states_convert_back_byte_for_byte_and_a_sequence_taken_out_continues_in_the_peer() {
    for spec in dsv4_specs() {
        convert_back_and_take_out(&spec);
    }
}

fn convert_back_and_take_out(spec: &Spec) {
    let (session, sequence) = fixture(spec);
    let sidecar = spec.sidecar().unwrap();
    let token = |key: &str, s: usize| sidecar[key][s].as_i64().unwrap();
    // today's versions are the default of a dsv4 state: the only ones that have it
    for input in [&session, &sequence] {
        let out = convert_bytes(input, &ConvertOptions::default()).unwrap();
        assert!(&out == input, "a dsv4 state written back differs");
    }
    let dir = std::env::temp_dir().join(format!("kvc-dsv4-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let peer_seq = inspect_bytes(&sequence).unwrap();
    // every sequence, the saved one with the model's window too, and (two sequences) that one
    // renamed 0: its raw cells go into stream 0, where 0.1.161 loads it
    let mut cases: Vec<(i32, Option<u32>, Option<i32>)> = (0..spec.prompts.len() as i32)
        .map(|s| (s, None, None))
        .collect();
    cases.push((spec.seq, Some(8), None));
    if spec.seq != 0 {
        cases.push((spec.seq, Some(8), Some(0)));
    }
    for (seq, swa_window, as_seq) in cases {
        let opts = ConvertOptions {
            extract_seq: Some(seq),
            swa_window,
            as_seq,
            ..Default::default()
        };
        let ours = convert_bytes(&session, &opts).unwrap();
        let ins = inspect_bytes(&ours).unwrap();
        assert_eq!(ins.header.kind, FileKind::Sequence);
        if seq == spec.seq {
            // the compressed rows and compressor states are the peer's own one-sequence save
            for i in 0..6 {
                assert_eq!(
                    section_bytes(&ours, &ins, i),
                    section_bytes(&sequence, &peer_seq, i),
                    "section {i}"
                );
            }
        }
        if swa_window.is_some() && as_seq.is_none() {
            // and with the model's window (8), so is the whole payload (the session's tokens
            // are both prompts', the peer's file holds its sequence's)
            assert!(
                ours[ins.payload_offset..] == sequence[peer_seq.payload_offset..],
                "the payload of sequence {seq} differs from the peer's"
            );
        }
        let path = dir.join(format!("{}-seq{seq}.ggsq", spec.name));
        std::fs::write(&path, &ours).unwrap();
        let pos = spec.prompts[seq as usize].len();
        let dest = as_seq.unwrap_or(seq);
        let next = spec
            .continue_file(&path, Some(dest), token("next", seq as usize), pos)
            .unwrap_or_else(|e| panic!("sequence {seq} as {dest}: {e}"));
        assert_eq!(next, token("next2", seq as usize), "sequence {seq}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn dsv4_conversions_that_would_lose_the_compressed_caches_are_refused_by_name() {
    let (session, sequence) = fixture(&dsv4_spec());
    let refused = |input: &[u8], opts: ConvertOptions| match convert_bytes(input, &opts) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("{opts:?} was accepted"),
    };
    let e = refused(
        &sequence,
        ConvertOptions {
            type_k: Some(GgmlType::Q8_0),
            ..Default::default()
        },
    );
    assert!(e.contains("re-typing") && e.contains("dsv4"), "{e}");
    let e = refused(
        &sequence,
        ConvertOptions {
            to: Some(FileKind::Session),
            ..Default::default()
        },
    );
    assert!(e.contains("session") && e.contains("dsv4"), "{e}");
    let e = refused(
        &session,
        ConvertOptions {
            as_seq: Some(0),
            ..Default::default()
        },
    );
    assert!(e.contains("renaming") && e.contains("dsv4"), "{e}");
    let e = refused(
        &session,
        ConvertOptions {
            extract_seq: Some(-1),
            ..Default::default()
        },
    );
    assert!(e.contains("-1"), "{e}");
    let mut v2 = ConvertOptions::default();
    v2.write.version = Some(2);
    let e = refused(&session, v2);
    assert!(e.contains("sequence version 4"), "{e}");
    // one part of the raw cache is a file of one memory of its own
    let swa = convert_bytes(
        &sequence,
        &ConvertOptions {
            part: Some(PartRole::Swa),
            ..Default::default()
        },
    )
    .unwrap();
    let ins = inspect_bytes(&swa).unwrap();
    assert_eq!(
        (ins.memory, ins.compressed.is_none()),
        (MemoryKind::Unified, true)
    );
    // its base cache holds cells but no layer: alone, a file no reader would take
    let e = refused(
        &sequence,
        ConvertOptions {
            part: Some(PartRole::Base),
            ..Default::default()
        },
    );
    assert!(e.contains("part 'base' holds no layer"), "{e}");
}

#[test]
fn a_partial_dsv4_state_holds_the_window_cache_and_the_compressors_only() {
    let (_, sequence) = fixture(&dsv4_spec());
    let ins = inspect_bytes(&sequence).unwrap();
    let at = |r: &std::ops::Range<usize>| ins.payload_offset + r.start..ins.payload_offset + r.end;
    let c = ins.compressed.as_ref().unwrap();
    // PARTIAL_ONLY: the envelope in mode 1, the window cache, the compressor states
    let mut partial = sequence[..ins.payload_offset].to_vec();
    for x in [dsv4::MAGIC, dsv4::VERSION, 1] {
        partial.extend_from_slice(&x.to_le_bytes());
    }
    partial.extend_from_slice(&sequence[at(&ins.parts[1].range)]);
    for s in &c.sections[3..] {
        partial.extend_from_slice(&sequence[at(&s.range)]);
    }
    let p = inspect_bytes(&partial).unwrap();
    assert_eq!(p.memory, MemoryKind::Dsv4);
    assert_eq!(p.parts.len(), 1);
    assert_eq!(p.parts[0].role, PartRole::Swa);
    let pc = p.compressed.as_ref().unwrap();
    assert!(pc.partial);
    assert!(pc
        .sections
        .iter()
        .all(|s| matches!(s.kind, SectionKind::Compressor { .. })));
    let model = ModelInfo::from_file(&models_dir().join("deepseek4.gguf"), false).unwrap();
    assert!(check_state(&p, &model).fits);
    assert_eq!(
        convert_bytes(&partial, &ConvertOptions::default()).unwrap(),
        partial
    );
}

#[test]
fn damaged_dsv4_states_are_refused_by_name_and_no_live_cache_loads_one() {
    let (_, sequence) = fixture(&dsv4_spec());
    let ins = inspect_bytes(&sequence).unwrap();
    let payload = ins.payload_offset;
    let err = |bytes: &[u8]| match inspect_bytes(bytes) {
        Err(e) => e.to_string(),
        Ok(i) => panic!("a damaged state read as {:?}", i.memory),
    };
    // every cut after the magic ends in a refusal naming dsv4, never a panic
    for cut in (payload + 4..sequence.len()).step_by(61) {
        let e = err(&sequence[..cut]);
        assert!(e.contains("dsv4"), "cut at {cut}: {e}");
    }
    let patched = |at: usize, v: u32| {
        let mut b = sequence.clone();
        b[payload + at..payload + at + 4].copy_from_slice(&v.to_le_bytes());
        b
    };
    assert!(err(&patched(4, 2)).contains("dsv4 state version 2"));
    assert!(err(&patched(8, 7)).contains("dsv4 state mode 7"));
    let c = ins.compressed.as_ref().unwrap();
    // the HCA compressor's ratio, 4 bytes after its version
    let hca = c.sections[4].range.start;
    assert!(err(&patched(hca + 4, 4)).contains("dsv4 hca compressor: ratio 4, expected 128"));
    // a K row size that is not that of its width and type
    let row_size = c.sections[0].range.start + 16 + 4 + 4 + 8 + 8;
    assert!(err(&patched(row_size, 63)).contains("row size 63"));
    // a width near 2^64 (found by the state_reader fuzz target: it overflowed the row size)
    let mut huge = sequence.clone();
    let ne0 = payload + c.sections[0].range.start + 16 + 4 + 4;
    huge[ne0..ne0 + 8].copy_from_slice(&(1u64 << 63).to_le_bytes());
    assert!(err(&huge).contains("is not that of 9223372036854775808 f16 elements"));
    let mut trailing = sequence.clone();
    trailing.push(0);
    assert!(err(&trailing).contains("1 trailing bytes"));

    // a cache shaped like the raw window cache still refuses the whole state, unchanged
    let mut p = CacheParams::new(64, 3, 32, 0);
    p.no_v = true;
    p.n_seq_max = 2;
    let mut cache = SeedCache::new(p).unwrap();
    let path = dsv4_spec().sequence_path();
    match cache.load_sequence_file(&path, 1, Default::default(), None) {
        Err(KvError::Unsupported(m)) => assert!(m.contains("dsv4"), "{m}"),
        other => panic!("a live cache loaded a dsv4 state: {other:?}"),
    }
    assert_eq!(cache.used_cells(), 0);
}

#[test]
fn regression_the_prompt_store_kept_a_dsv4_state_as_its_raw_cache_alone() {
    // once dsv4 states parsed, the store would have kept their raw cache and dropped the
    // compressed caches and compressor states, restoring a state 0.1.161 cannot continue. It
    // keeps them now: a file it writes holds the sequence's sections byte for byte, its raw
    // cache one stream per sequence of the context (two here), the sequence in its own
    let spec = dsv4_spec();
    let (session, sequence) = fixture(&spec);
    let store = prompt_store::PromptStore::new(
        std::sync::Arc::new(prompt_store::MemoryBackend::new(None)),
        "dsv4",
        16,
    )
    .unwrap();
    // the session holds two sequences: the store ingests one
    match store.put_bytes(&session, None) {
        Err(prompt_store::StoreError::NotPrefix(m)) => assert!(m.contains("[0, 1]"), "{m}"),
        other => panic!("the store took a session of two sequences: {other:?}"),
    }
    let tokens = &spec.prompts[1];
    assert_eq!(
        store.put_bytes(&sequence, None).unwrap().tokens,
        tokens.len() as u64
    );
    let out = std::env::temp_dir().join(format!("kvc-dsv4-store-{}.ggsq", std::process::id()));
    let n = store
        .write_file(tokens, &out, &Default::default(), None)
        .unwrap();
    assert_eq!(n, tokens.len() as u64);
    let written = std::fs::read(&out).unwrap();
    let _ = std::fs::remove_file(&out);
    let (ins, peer) = (
        inspect_bytes(&written).unwrap(),
        inspect_bytes(&sequence).unwrap(),
    );
    assert_eq!(ins.memory, MemoryKind::Dsv4);
    for i in 0..6 {
        assert_eq!(
            section_bytes(&written, &ins, i),
            section_bytes(&sequence, &peer, i),
            "section {i}"
        );
    }
    // the store writes sequence 0 (in stream 0 of 2), the peer's file held sequence 1
    let cells: Vec<usize> = ins.parts[1]
        .payload
        .streams
        .iter()
        .map(|s| s.cells.len())
        .collect();
    assert_eq!(cells, [8, 0]);
}

/// Rounds of [`damaged_dsv4_states_inspect_convert_and_store_or_are_refused`]:
/// `DSV4_READER_ROUNDS` (default 4,000).
fn damage_rounds() -> u32 {
    std::env::var("DSV4_READER_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4_000)
}

#[test]
fn damaged_dsv4_states_inspect_convert_and_store_or_are_refused() {
    use conformance::today::trace::{damaged, Rng};
    // the payloads of both fixtures' sessions and sequence files, damaged (bits flipped, cut,
    // counts set to extremes, spans zeroed or repeated, bytes appended) behind their own
    // header: each is read, converted and put into a store, or refused, never a panic
    let mut good = Vec::new();
    for spec in dsv4_specs() {
        let (session, sequence) = fixture(&spec);
        for file in [session, sequence] {
            let at = inspect_bytes(&file).unwrap().payload_offset;
            good.push((file[..at].to_vec(), file[at..].to_vec()));
        }
    }
    let mut rng = Rng::new(4444);
    let (mut refused, mut read) = (0u32, 0u32);
    for round in 0..damage_rounds() {
        let (head, payload) = &good[rng.below(good.len() as u32) as usize];
        let bad = [head.clone(), damaged(&mut rng, payload)].concat();
        let Ok(ins) = inspect_bytes(&bad) else {
            refused += 1;
            continue;
        };
        read += 1;
        if ins.memory == MemoryKind::Dsv4 {
            // what converts is a dsv4 state the converter keeps as it is (a damaged sequence
            // file's stray seq ids become its sequence's)
            if let Ok(out) = convert_bytes(&bad, &ConvertOptions::default()) {
                assert_eq!(inspect_bytes(&out).unwrap().memory, MemoryKind::Dsv4);
                let again = convert_bytes(&out, &ConvertOptions::default()).unwrap_or_else(|e| {
                    panic!("round {round}: what we wrote does not convert: {e}")
                });
                assert!(
                    again == out,
                    "round {round}: a converted dsv4 state converts otherwise"
                );
            }
        }
        for seq in [0, 1] {
            let opts = ConvertOptions {
                extract_seq: Some(seq),
                ..Default::default()
            };
            let _ = convert_bytes(&bad, &opts);
        }
        let store = prompt_store::PromptStore::new(
            std::sync::Arc::new(prompt_store::MemoryBackend::new(None)),
            "dsv4",
            16,
        )
        .unwrap();
        let _ = store.put_bytes(&bad, None);
    }
    eprintln!("damaged dsv4 states: {refused} refused, {read} read");
    assert!(refused > 0 && read > 0);
}
