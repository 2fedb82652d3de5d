//! llama.cpp 0.1.161's files (`__test__/fixtures/t161/`) without the peer: each inspects as
//! its spec says (version, memory, parts, rotation, cells), each part loads into a cache shaped
//! like it and writes back byte for byte, and malformed copies are refused with the cache left
//! as it was.

use conformance::models_dir;
use conformance::today::{specs, Spec};
use llama_kv_cache::state::files::{inspect_bytes, params_for_payload, Inspection};
use llama_kv_cache::state::parts::{Part, PartKind};
use llama_kv_cache::{
    memory_for_model, Layout, Memory, ModelInfo, PartRole, ReadOptions, SeedCache, WriteOptions,
};

fn read(path: &std::path::Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn inspect(spec: &Spec, session: bool) -> (Vec<u8>, Inspection) {
    let path = if session {
        spec.session_path()
    } else {
        spec.sequence_path()
    };
    let bytes = read(&path);
    let ins = inspect_bytes(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    (bytes, ins)
}

fn part_bytes<'a>(bytes: &'a [u8], ins: &Inspection, part: &Part) -> &'a [u8] {
    &bytes[ins.payload_offset + part.range.start..ins.payload_offset + part.range.end]
}

/// A cache shaped like one part (as many sequences as the spec decodes).
fn cache_for(spec: &Spec, part: &Part) -> SeedCache {
    let mut p = params_for_payload(&part.payload, part.kind == PartKind::Recurrent).unwrap();
    p.n_seq_max = p.n_seq_max.max(spec.prompts.len() as u32);
    p.size = p.size.max(p.n_seq_max).max(conformance::today::CTX);
    SeedCache::new(p).unwrap_or_else(|e| panic!("t161-{} {}: {e}", spec.name, part.role))
}

/// The layers a recurrent part declares (every model layer) and writes (its own): Jamba
/// declares 2 and writes its Mamba layer, LFM2 declares 4 and writes its 2 short-convolution
/// layers (as Qwen3.5 its 2 gated delta nets), Mamba writes both of its 2.
fn recurrent_layers(spec: &Spec) -> (u32, usize) {
    match spec.model {
        "jamba.gguf" => (2, 1),
        "lfm2.gguf" | "lfm2-swa.gguf" | "qwen35.gguf" => (4, 2),
        "nemotron-h.gguf" => (3, 1),
        "falcon-h1.gguf" => (2, 2),
        _ => (2, 2),
    }
}

#[test]
fn every_t161_fixture_inspects_as_its_spec_says() {
    for spec in specs() {
        for session in [true, false] {
            let (_, ins) = inspect(&spec, session);
            let what = format!("t161-{} ({})", spec.name, ins.header.kind.name());
            assert_eq!(ins.header.version, if session { 11 } else { 4 }, "{what}");
            assert_eq!(ins.memory.name(), spec.memory, "{what}");
            let tokens: Vec<i32> = if session {
                spec.prompts.concat()
            } else {
                spec.prompts[spec.seq as usize].clone()
            };
            assert_eq!(ins.header.tokens, tokens, "{what}");
            let roles: Vec<PartRole> = ins.parts.iter().map(|p| p.role).collect();
            let expected_roles = match spec.memory {
                "iswa" => vec![PartRole::Base, PartRole::Swa],
                // LFM2 with a window: llama_memory_hybrid_iswa
                "hybrid" if spec.model == "lfm2-swa.gguf" => {
                    vec![PartRole::Base, PartRole::Swa, PartRole::Recurrent]
                }
                "hybrid" => vec![PartRole::Attention, PartRole::Recurrent],
                "dsa" => vec![PartRole::Attention, PartRole::Indexer],
                _ => vec![PartRole::Whole],
            };
            assert_eq!(roles, expected_roles, "{what}");
            for part in &ins.parts {
                let cells: usize = part.payload.streams.iter().map(|s| s.cells.len()).sum();
                match part.kind {
                    PartKind::Kv => {
                        assert_eq!(part.payload.layout, Layout::StreamsRot, "{what}");
                        let streams = if spec.unified { 1 } else { spec.prompts.len() };
                        assert_eq!(part.payload.streams.len(), streams, "{what}");
                        // the lightning indexer keeps its keys Hadamard-rotated whatever their
                        // type (0.1.161's self_k_rot_lid over its 64-wide head)
                        let n_rot = if part.role == PartRole::Indexer {
                            (64, 0)
                        } else {
                            spec.n_rot
                        };
                        for s in part.payload.streams.iter().filter(|s| !s.cells.is_empty()) {
                            assert_eq!(s.n_rot, Some(n_rot), "{what} {}", part.role);
                            assert_eq!(s.v_trans, Some(!spec.fa), "{what}");
                        }
                        // the SWA cache of a one-sequence save drops the cells outside the window
                        let expected = if part.role == PartRole::Swa && !session {
                            4
                        } else {
                            tokens.len()
                        };
                        assert_eq!(cells, expected, "{what} {} cells", part.role);
                    }
                    PartKind::Recurrent => {
                        assert_eq!(
                            cells,
                            if session { spec.prompts.len() } else { 1 },
                            "{what}"
                        );
                        let s = &part.payload.streams[0];
                        let (declared, written) = recurrent_layers(&spec);
                        assert_eq!(
                            (s.n_layer_declared, s.layers.len()),
                            (declared, written),
                            "{what}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn every_t161_part_loads_and_writes_back_byte_for_byte() {
    for spec in specs() {
        for session in [true, false] {
            let (bytes, ins) = inspect(&spec, session);
            for part in &ins.parts {
                let what = format!(
                    "t161-{} ({}) {}",
                    spec.name,
                    ins.header.kind.name(),
                    part.role
                );
                if part.payload.streams.iter().all(|s| s.layers.is_empty()) {
                    // a part of no layer (LFM2's base cache) is cells only: no cache of its
                    // own holds it; the live memory below reads and writes it
                    continue;
                }
                let mut cache = cache_for(&spec, part);
                let n_stream = part.payload.streams.len() as u32;
                let opts = ReadOptions {
                    part: (ins.parts.len() > 1).then_some(part.role),
                    ..ReadOptions::default()
                };
                let seq = if session { -1 } else { spec.seq };
                let loaded = if session {
                    cache.load_session_bytes(&bytes, opts, None)
                } else {
                    cache.load_sequence_bytes(&bytes, seq, opts, None)
                };
                loaded.unwrap_or_else(|e| panic!("{what}: {e}"));
                let written = cache
                    .state_write(seq, Layout::StreamsRot, n_stream, None)
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                let original = part_bytes(&bytes, &ins, part);
                if part.role == PartRole::Recurrent {
                    // a one-memory cache declares its own layer count (those it writes, not all
                    // the model's): that one byte of n_layer is the only difference
                    assert_eq!(written.len(), original.len(), "{what}");
                    let diff: Vec<usize> = (0..original.len())
                        .filter(|&i| written[i] != original[i])
                        .collect();
                    let (declared, own) = recurrent_layers(&spec);
                    if declared == own as u32 {
                        assert!(diff.is_empty(), "{what}: bytes differ at {diff:?}");
                        continue;
                    }
                    assert_eq!(diff.len(), 1, "{what}: bytes differ at {diff:?}");
                    assert_eq!(
                        (u32::from(written[diff[0]]), u32::from(original[diff[0]])),
                        (own as u32, declared),
                        "{what}"
                    );
                } else {
                    assert!(written == original, "{what}: written back differently");
                }
            }
        }
    }
}

#[test]
fn regression_a_cell_less_file_declaring_huge_rows_is_refused_before_allocating() {
    // found by the fuzzer: a seed-layout session with 0 cells still declares K/V row sizes, and
    // converting it built a cache of that width (gigabytes from a few dozen bytes)
    let mut file = Vec::new();
    let u32s = |f: &mut Vec<u8>, vs: &[u32]| {
        vs.iter()
            .for_each(|v| f.extend_from_slice(&v.to_le_bytes()))
    };
    // 'ggsn' v9, no tokens, arch "llama"
    u32s(&mut file, &[0x6767_736E, 9, 0, 5]);
    file.extend_from_slice(b"llama");
    // outputs block: n_outputs 0, logits 0 (u64), embeddings 0 (u64)
    u32s(&mut file, &[0, 0, 0, 0, 0]);
    // seed KV payload: cell_count 0, v_trans 0, n_layer 1
    u32s(&mut file, &[0, 0, 1]);
    // layer 0: K f32 with a 1 GiB row, V f32 with a 1 GiB row, and no cells to fill them
    for _ in 0..2 {
        file.extend_from_slice(&0i32.to_le_bytes());
        file.extend_from_slice(&(1u64 << 30).to_le_bytes());
    }
    let e = llama_kv_cache::convert_bytes(&file, &llama_kv_cache::ConvertOptions::default())
        .unwrap_err();
    assert!(e.to_string().contains("bytes per cell"), "{e}");
}

#[test]
fn regression_an_empty_cache_payload_is_not_ambiguous_between_streams_and_streams_rot() {
    use llama_kv_cache::CacheParams;
    // empty streams have no data header, so the rotation fields never appear: one reading
    for layout in [Layout::Streams, Layout::StreamsRot] {
        let c = SeedCache::new(CacheParams::new(8, 1, 32, 32)).unwrap();
        let blob = c
            .state_write(-1, layout, 1, None)
            .unwrap_or_else(|e| panic!("{layout}: {e}"));
        let mut d = SeedCache::new(CacheParams::new(8, 1, 32, 32)).unwrap();
        let read = d.state_read(&blob, -1, ReadOptions::default(), None);
        assert_eq!(read.map(|s| s.cells), Ok(0), "{layout}");
        let opts = ReadOptions {
            part: Some(PartRole::Base),
            ..ReadOptions::default()
        };
        // an empty payload is no iSWA one either
        assert!(d.state_read(&blob, -1, opts, None).is_err(), "{layout}");
    }
}

#[test]
fn a_v11_session_larger_than_the_cache_is_no_space_and_changes_nothing() {
    use llama_kv_cache::KvError;
    let spec = specs().into_iter().find(|s| s.name == "h16-f16").unwrap();
    let (bytes, ins) = inspect(&spec, true);
    let mut p = params_for_payload(&ins.payload, false).unwrap();
    p.size = 4;
    let mut c = SeedCache::new(p).unwrap();
    let before = c.state_write(-1, Layout::StreamsRot, 1, None).unwrap();
    let e = c
        .load_session_bytes(&bytes, ReadOptions::default(), None)
        .unwrap_err();
    assert!(matches!(e, KvError::NoSpace(_)), "{e:?}");
    assert_eq!(
        c.state_write(-1, Layout::StreamsRot, 1, None).unwrap(),
        before
    );
}

/// The memory `KvCache.fromModel` builds for a fixture's context.
fn live_memory(spec: &Spec) -> Box<dyn Memory> {
    let info = ModelInfo::from_file(&models_dir().join(spec.model), false)
        .unwrap_or_else(|e| panic!("{e} (set-up: node scripts/setup.mjs)"));
    memory_for_model(&info, &spec.context_params())
        .unwrap_or_else(|e| panic!("t161-{}: {e}", spec.name))
}

#[test]
fn every_t161_file_of_a_live_memory_loads_into_what_from_model_builds_and_writes_back_byte_for_byte(
) {
    for spec in specs()
        .into_iter()
        .filter(|s| matches!(s.memory, "unified" | "recurrent" | "iswa" | "hybrid"))
    {
        for session in [true, false] {
            let (bytes, ins) = inspect(&spec, session);
            let what = format!("t161-{} ({})", spec.name, ins.header.kind.name());
            let payload = &bytes[ins.payload_offset..];
            let seq = if session { -1 } else { spec.seq };
            let mut memory = live_memory(&spec);
            let opts = ReadOptions {
                layout: Some(Layout::StreamsRot),
                ..ReadOptions::default()
            };
            memory
                .state_read(payload, seq, opts, None)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let again = memory
                .state_write(seq, &WriteOptions::of_layout(Layout::StreamsRot), None)
                .unwrap();
            assert!(again == payload, "{what}: written back differently");
            assert_eq!(memory.parts().len(), ins.parts.len().max(1), "{what}");
        }
    }
}

/// The payload of a fixture's sequence file.
fn sequence_payload(name: &str) -> Vec<u8> {
    let spec = specs().into_iter().find(|s| s.name == name).unwrap();
    let (bytes, ins) = inspect(&spec, false);
    bytes[ins.payload_offset..].to_vec()
}

#[test]
fn dsa_iswa_and_hybrid_idx_payloads_read_part_by_part_convert_back_and_are_stored() {
    use llama_kv_cache::state::files::{header_bytes, FileKind};
    use llama_kv_cache::{convert_bytes, ConvertOptions, MemoryKind, WriteOptions};
    // no tiny model of these exists for 0.1.161 (dots3note, glm5-next): their payloads are
    // built of real parts in llama.cpp's order. dsa-iswa: latent, indexer, window (all
    // without V); hybrid-idx: attention, recurrent, indexer.
    let dsa = sequence_payload("deepseek32-dsa");
    let mla = sequence_payload("deepseek2-mla");
    let jamba = sequence_payload("jamba");
    let jamba_ins =
        inspect_bytes(&[header_bytes(FileKind::Sequence, 4, &[1]), jamba.clone()].concat())
            .unwrap();
    let attention = &jamba[jamba_ins.parts[0].range.clone()];
    let cases = [
        (
            [dsa.as_slice(), &mla].concat(),
            MemoryKind::DsaIswa,
            vec![PartRole::Attention, PartRole::Indexer, PartRole::Swa],
        ),
        (
            [jamba.as_slice(), attention].concat(),
            MemoryKind::HybridIdx,
            vec![PartRole::Attention, PartRole::Recurrent, PartRole::Indexer],
        ),
    ];
    // the tokens of the fixtures' one sequence (jamba's and deepseek32's prompt)
    let tokens = specs()
        .into_iter()
        .find(|s| s.name == "jamba")
        .unwrap()
        .prompts[0]
        .clone();
    for (payload, memory, roles) in cases {
        let file = [header_bytes(FileKind::Sequence, 4, &tokens), payload].concat();
        let ins = inspect_bytes(&file).unwrap_or_else(|e| panic!("{}: {e}", memory.name()));
        assert_eq!(ins.memory, memory);
        assert_eq!(ins.parts.iter().map(|p| p.role).collect::<Vec<_>>(), roles);
        // every part through a cache of its own, in order: the same bytes
        let opts = ConvertOptions {
            write: WriteOptions {
                version: Some(4),
                layout: Layout::StreamsRot,
                n_stream: 1,
            },
            ..ConvertOptions::default()
        };
        let again =
            convert_bytes(&file, &opts).unwrap_or_else(|e| panic!("{}: {e}", memory.name()));
        assert!(again == file, "{}: converted differently", memory.name());
        // the prompt store keeps the indexer as dsa's (in blocks of its own), dsa-iswa's
        // window after it in checkpoints (as iSWA's window) and hybrid-idx's recurrent state in
        // checkpoints; a file the store writes for the same tokens is the ingested one, byte
        // for byte. dsa-iswa twice: its window cache whole, and only its last 4 positions (as
        // 0.1.161 saves a sequence of a window of 4)
        let mut stored = vec![file.clone()];
        if memory == MemoryKind::DsaIswa {
            let windowed = ConvertOptions {
                swa_window: Some(4),
                ..opts.clone()
            };
            let windowed = convert_bytes(&file, &windowed).unwrap();
            let w = inspect_bytes(&windowed).unwrap();
            assert_eq!(
                w.parts[2].payload.streams[0].cells.positions(),
                [6, 7, 8, 9]
            );
            stored.push(windowed);
        }
        for file in stored {
            let store = prompt_store::PromptStore::new(
                std::sync::Arc::new(prompt_store::MemoryBackend::new(None)),
                "indexed",
                16,
            )
            .unwrap();
            let put = store.put_bytes(&file, None).unwrap();
            assert_eq!(put.tokens, tokens.len() as u64, "{}", memory.name());
            let out =
                std::env::temp_dir().join(format!("{}-{}.ggsq", memory.name(), std::process::id()));
            let n = store
                .write_file(
                    &tokens,
                    &out,
                    &prompt_store::WriteFileOptions::default(),
                    None,
                )
                .unwrap();
            assert_eq!(n, tokens.len() as u64);
            let written = std::fs::read(&out).unwrap();
            let _ = std::fs::remove_file(&out);
            assert!(
                written == file,
                "{}: the store wrote another file",
                memory.name()
            );
            // a shorter prefix needs the recurrent state (the window) at its end, which only
            // the ingested length's checkpoint has
            assert_eq!(store.lookup(&tokens[..8]).unwrap(), 0);
        }
    }
}

#[test]
fn a_sequence_taken_out_of_a_session_with_the_models_window_is_the_peers_own_file() {
    use llama_kv_cache::{convert_bytes, ConvertOptions};
    // 0.1.161 saves a sequence's window cache without the cells its next token cannot see;
    // `swa_window` (the model's window, 4 for these tiny models) does the same
    for name in ["gemma3-swa", "gemma3-swa-q8_0-fa", "lfm2-swa"] {
        let spec = specs().into_iter().find(|s| s.name == name).unwrap();
        let window = ModelInfo::from_file(&models_dir().join(spec.model), false)
            .unwrap()
            .swa
            .unwrap()
            .window;
        assert_eq!(window, 4, "{name}");
        let session = read(&spec.session_path());
        let mut v4 = ConvertOptions {
            extract_seq: Some(spec.seq),
            swa_window: Some(window),
            ..ConvertOptions::default()
        };
        v4.write.version = Some(4);
        let ours = convert_bytes(&session, &v4).unwrap();
        assert!(
            ours == read(&spec.sequence_path()),
            "{name}: not the peer's file"
        );
        // without the window, every cell of the session's window cache is kept
        let mut all = v4.clone();
        all.swa_window = None;
        assert!(
            convert_bytes(&session, &all).unwrap().len() > ours.len(),
            "{name}"
        );
    }
}

#[test]
fn regression_a_sequence_taken_out_of_a_session_and_renamed_kept_the_cells_of_its_new_id() {
    use llama_kv_cache::{convert_bytes, ConvertOptions};
    // sequence 1 of a session of two, written as sequence 0: the session's own sequence 0
    // must not come along (the file held both, with positions twice, and 0.1.161 refused it)
    let spec = specs()
        .into_iter()
        .find(|s| s.name == "h16-f16-par2")
        .unwrap();
    let session = read(&spec.session_path());
    let mut opts = ConvertOptions {
        extract_seq: Some(1),
        as_seq: Some(0),
        ..ConvertOptions::default()
    };
    opts.write.version = Some(4);
    let ours = inspect_bytes(&convert_bytes(&session, &opts).unwrap()).unwrap();
    let stream = &ours.payload.streams[0];
    let n = spec.prompts[1].len();
    assert_eq!(stream.cells.len(), n);
    assert_eq!(stream.cells.positions(), (0..n as i32).collect::<Vec<_>>());
    assert!((0..n).all(|i| stream.cells.seq_ids(i) == [0]));
}

#[test]
fn regression_a_cell_naming_seq_id_i32_max_overflowed_the_sequence_count_of_a_conversion() {
    use llama_kv_cache::{convert_bytes, ConvertOptions};
    // found by the damaged-dsv4 test: the sequence count derived from a file's seq ids added 1
    // to i32::MAX (a panic in debug builds, a wrap to one sequence in release)
    let spec = specs().into_iter().find(|s| s.name == "h16-f16").unwrap();
    let (mut bytes, ins) = inspect(&spec, false);
    // streams layout: n_stream, cell_count, then cells of pos, n_seq_id (1), seq id: the
    // second cell's (the first names the file's sequence, which is checked first)
    let at = ins.payload_offset + 8 + 12 + 8;
    bytes[at..at + 4].copy_from_slice(&i32::MAX.to_le_bytes());
    // a sequence file's cells are its sequence's: the stray id is written as that one
    let out = convert_bytes(&bytes, &ConvertOptions::default()).unwrap();
    let cells = &inspect_bytes(&out).unwrap().payload.streams[0].cells;
    assert!((0..cells.len()).all(|i| cells.seq_ids(i) == [spec.seq]));
}
