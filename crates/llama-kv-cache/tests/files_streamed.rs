//! Inspecting a file reads its metadata only: the same description as inspecting its bytes, at
//! a cost in reads that does not grow with the K/V rows. Converting a file streams it (the
//! option matrix over the peer fixtures is in `convert_golden.rs`).

#[path = "common/fixtures.rs"]
mod fixtures;

use std::io::{Seek, SeekFrom, Write};

use llama_kv_cache::state::files::{inspect_bytes, inspect_file, inspect_source, Inspection};
use llama_kv_cache::state::source::ReadSource;
use llama_kv_cache::{
    convert_bytes, convert_file, CacheParams, ConvertOptions, KvError, Layout, MemoryKind, Outputs,
    ReadOptions, SeedCache, Tensor, UBatch, WriteOptions,
};

/// An inspection with the outputs block's values dropped (a file inspection does not read them).
fn without_output_values(mut ins: Inspection) -> Inspection {
    if let Some(o) = ins.outputs.as_mut() {
        o.logits.clear();
        o.embeddings.clear();
    }
    ins
}

#[test]
fn inspecting_a_file_describes_it_as_inspecting_its_bytes_does() {
    let dir = std::env::temp_dir().join(format!("kv-inspect-eq-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let seed = dir.join("seed-with-outputs.ggsn");
    std::fs::write(&seed, seed_session_with_outputs()).unwrap();
    let mut with_outputs = 0;
    for path in fixtures::all_fixtures().into_iter().chain([seed]) {
        let bytes = std::fs::read(&path).unwrap();
        let from_bytes = inspect_bytes(&bytes).unwrap();
        with_outputs += from_bytes
            .outputs
            .as_ref()
            .is_some_and(|o| !o.logits.is_empty()) as usize;
        let from_file = inspect_file(&path).unwrap();
        assert_eq!(
            from_file,
            without_output_values(from_bytes),
            "{}",
            path.display()
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(
        with_outputs, 1,
        "the seed session's outputs block was not read"
    );
}

/// A seed-era session (ggsn 9, seed layout) with an outputs block of two outputs.
fn seed_session_with_outputs() -> Vec<u8> {
    let mut cache = SeedCache::new(CacheParams::new(16, 2, 32, 32)).unwrap();
    cache
        .find_slot(&UBatch::sequence(0, 0, 4))
        .unwrap()
        .unwrap();
    cache
        .write_rows_f32(0, Tensor::K, 0, &[0.5; 4 * 32])
        .unwrap();
    let outputs = Outputs {
        output_pos: vec![2, 3],
        logits: (0..20).map(|i| i as f32).collect(),
        embeddings: vec![1.0; 8],
    };
    let opts = WriteOptions {
        version: Some(9),
        layout: Layout::Seed,
        n_stream: 1,
    };
    cache
        .session_file_bytes(&[1, 2, 3, 4], "llama", Some(&outputs), opts, None)
        .unwrap()
}

#[test]
fn inspecting_a_file_refuses_what_inspecting_its_bytes_refuses() {
    let dir = std::env::temp_dir().join(format!("kv-inspect-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = std::fs::read(&fixtures::all_fixtures()[0]).unwrap();
    for (i, cut) in [0, 3, 11, good.len() / 2, good.len() - 1]
        .into_iter()
        .enumerate()
    {
        let path = dir.join(format!("cut{i}.ggsn"));
        std::fs::write(&path, &good[..cut]).unwrap();
        let a = inspect_bytes(&good[..cut]).unwrap_err();
        let b = inspect_file(&path).unwrap_err();
        assert_eq!(a, b, "cut at {cut}");
    }
    let missing = inspect_file(&dir.join("missing.ggsq")).unwrap_err();
    assert!(
        matches!(&missing, llama_kv_cache::KvError::Io(m) if m.contains("missing.ggsq")),
        "{missing:?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A sequence file (ggsq v3, one stream) of `cells` cells and 2 layers of f16 rows of `row`
/// bytes, K and V: only the header, the cells and the per-layer headers are written; the rows are
/// a hole (sparse on disk).
fn sparse_sequence_file(path: &std::path::Path, cells: u32, row: u64) -> u64 {
    let mut f = std::fs::File::create(path).unwrap();
    let mut head = Vec::new();
    for v in [0x6767_7371u32, 3, 2, 11, 22, 1, cells] {
        head.extend_from_slice(&v.to_le_bytes());
    }
    for i in 0..cells {
        for v in [i, 1, 0] {
            head.extend_from_slice(&v.to_le_bytes());
        }
    }
    head.extend_from_slice(&0u32.to_le_bytes()); // v_trans
    head.extend_from_slice(&2u32.to_le_bytes()); // n_layer
    f.write_all(&head).unwrap();
    let block = row * u64::from(cells);
    let mut at = head.len() as u64;
    for _ in 0..4 {
        // layer header (type f16, row size), then the rows as a hole
        f.seek(SeekFrom::Start(at)).unwrap();
        f.write_all(&1i32.to_le_bytes()).unwrap();
        f.write_all(&row.to_le_bytes()).unwrap();
        at += 12 + block;
    }
    f.set_len(at).unwrap();
    at
}

#[test]
fn inspecting_a_sparse_4_gib_file_reads_a_few_kib() {
    let dir = std::env::temp_dir().join(format!("kv-inspect-sparse-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("big.ggsq");
    let len = sparse_sequence_file(&path, 16, 64 << 20);
    assert!(len > 4 << 30);
    let src = ReadSource::open(&path).unwrap();
    let ins = inspect_source(&src, false).unwrap();
    let read = src.bytes_read();
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(read <= 64 << 10, "read {read} bytes of a {len}-byte file");
    assert_eq!(ins.bytes as u64, len);
    assert_eq!(ins.memory, MemoryKind::Unified);
    let stream = &ins.payload.streams[0];
    assert_eq!(stream.cells.len(), 16);
    assert_eq!(stream.layers.len(), 2);
    assert_eq!(stream.layers[1].k_row_size, 64 << 20);
    assert_eq!(ins.header.tokens, vec![11, 22]);
}

#[test]
fn convert_keeps_a_seed_sessions_outputs_block_byte_for_byte() {
    let dir = std::env::temp_dir().join(format!("kv-convert-outputs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bytes = seed_session_with_outputs();
    let (input, output) = (dir.join("in.ggsn"), dir.join("out.ggsn"));
    std::fs::write(&input, &bytes).unwrap();
    let mut opts = ConvertOptions::default();
    opts.write.layout = Layout::Seed;
    let mut calls = 0;
    let mut progress = |_: u64, _: u64| {
        calls += 1;
        true
    };
    convert_file(&input, &output, &opts, Some(&mut progress)).unwrap();
    let streamed = std::fs::read(&output).unwrap();
    assert_eq!(streamed, bytes, "the seed session did not round-trip");
    assert_eq!(convert_bytes(&bytes, &opts).unwrap(), bytes);
    assert!(calls >= 4, "{calls} progress calls for 2 layers");
    // today's layout drops the block
    let today = convert_bytes(&bytes, &ConvertOptions::default()).unwrap();
    assert!(inspect_bytes(&today).unwrap().outputs.is_none());
    // a progress callback that says stop: Aborted, no file, no litter
    let mut stop = |_: u64, _: u64| false;
    let e = convert_file(&input, &dir.join("x.ggsn"), &opts, Some(&mut stop)).unwrap_err();
    assert!(matches!(e, llama_kv_cache::KvError::Aborted(_)), "{e:?}");
    let mut left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    left.sort();
    assert_eq!(left, ["in.ggsn", "out.ggsn"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Writes `bytes` into a FIFO at `path` from another thread, once a reader opens it.
#[cfg(unix)]
fn serve_fifo(path: &std::path::Path, bytes: Vec<u8>) -> std::thread::JoinHandle<()> {
    let status = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .unwrap();
    assert!(status.success(), "mkfifo failed");
    let path = path.to_path_buf();
    std::thread::spawn(move || std::fs::write(&path, &bytes).unwrap())
}

#[cfg(unix)]
#[test]
fn a_pipe_is_inspected_and_converted_as_a_file_is() {
    let dir = std::env::temp_dir().join(format!("kv-fifo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = fixtures::fixture_dir().join("nlc-h16-f16.ggsq");
    let bytes = std::fs::read(&file).unwrap();
    let fifo = dir.join("state.fifo");
    let writer = serve_fifo(&fifo, bytes.clone());
    assert_eq!(inspect_file(&fifo).unwrap(), inspect_bytes(&bytes).unwrap());
    writer.join().unwrap();
    std::fs::remove_file(&fifo).unwrap();
    let writer = serve_fifo(&fifo, bytes.clone());
    let out = dir.join("out.ggsq");
    convert_file(&fifo, &out, &ConvertOptions::default(), None).unwrap();
    writer.join().unwrap();
    let want = convert_bytes(&bytes, &ConvertOptions::default()).unwrap();
    assert_eq!(std::fs::read(&out).unwrap(), want);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Everything a load can change: the cells, head, n and the live rows.
fn observable(c: &SeedCache) -> (llama_kv_cache::cells::Cells, u32, u32, Vec<u8>) {
    // the layout that records everything, rotation included
    let rows = c.state_write(-1, Layout::StreamsRot, 1, None).unwrap();
    (c.cells().clone(), c.head(), c.n(), rows)
}

/// A cache for `path`'s payload (a few more cells than it holds, two sequences), or `None`
/// when no single cache shape fits it.
fn cache_for(path: &std::path::Path) -> Option<SeedCache> {
    let ins = inspect_file(path).ok()?;
    let mut p =
        llama_kv_cache::state::files::params_for(&ins, ins.recurrent() == Some(true)).ok()?;
    p.size += 8;
    p.n_seq_max = p.n_seq_max.max(2);
    SeedCache::new(p).ok()
}

/// `load_sequence_file` streams a file of one memory from disk and reads any other whole: for
/// every peer fixture, into sequence 1, the same outcome as `load_sequence_bytes` of its bytes
/// (the same summary, cells and rows; or the same error and an unchanged cache).
#[test]
fn loading_a_sequence_file_from_its_path_equals_loading_its_bytes_for_every_fixture() {
    let mut compared = 0;
    for path in fixtures::all_fixtures() {
        let bytes = std::fs::read(&path).unwrap();
        if !bytes.starts_with(b"qsgg") {
            continue;
        }
        let (Some(mut from_file), Some(mut from_bytes)) = (cache_for(&path), cache_for(&path))
        else {
            continue;
        };
        let before = observable(&from_file);
        let opts = ReadOptions::default();
        let a = from_file.load_sequence_file(&path, 1, opts, None);
        let b = from_bytes.load_sequence_bytes(&bytes, 1, opts, None);
        match (&a, &b) {
            (Ok(a), Ok(b)) => assert_eq!(a, b, "{}", path.display()),
            (Err(a), Err(b)) => {
                assert_eq!(a.to_string(), b.to_string(), "{}", path.display());
                assert_eq!(observable(&from_file), before, "{}", path.display());
            }
            _ => panic!("{}: {a:?} against {b:?}", path.display()),
        }
        assert_eq!(
            observable(&from_file),
            observable(&from_bytes),
            "{}",
            path.display()
        );
        compared += 1;
    }
    assert!(compared >= 10, "only {compared} sequence fixtures compared");
}

/// A 24 MiB payload streams in several pieces, for both V layouts; a load aborted after the
/// first piece, and a truncated file, leave the cache as it was.
#[test]
fn a_large_file_streams_in_pieces_and_an_abort_or_a_truncation_changes_nothing() {
    let dir = std::env::temp_dir().join(format!("kv-load-file-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for flash_attn in [false, true] {
        let params = || {
            let mut p = CacheParams::new(2048, 3, 1024, 1024);
            p.flash_attn = flash_attn;
            p.n_seq_max = 2;
            p
        };
        let mut src = SeedCache::new(params()).unwrap();
        src.find_slot(&UBatch::sequence(0, 0, 1500))
            .unwrap()
            .unwrap();
        for il in 0..3 {
            for which in [Tensor::K, Tensor::V] {
                let rows: Vec<u8> = (0..1500 * 2048).map(|i| (i * 7 + il) as u8).collect();
                src.write_rows(il as u32, which, 0, &rows).unwrap();
            }
        }
        let path = dir.join(format!("big-{flash_attn}.ggsq"));
        let tokens: Vec<i32> = (0..1500).collect();
        for version in [2, 4] {
            let opts = WriteOptions {
                version: Some(version),
                ..WriteOptions::default()
            };
            src.save_sequence_file(&path, 0, &tokens, opts, None)
                .unwrap();
            let bytes = std::fs::read(&path).unwrap();
            assert!(bytes.len() > 16 << 20);
            let (mut a, mut b) = (
                SeedCache::new(params()).unwrap(),
                SeedCache::new(params()).unwrap(),
            );
            let mut calls = Vec::new();
            let mut record = |done: u64, total: u64| {
                calls.push((done, total));
                true
            };
            let loaded = a
                .load_sequence_file(&path, 1, ReadOptions::default(), Some(&mut record))
                .unwrap();
            // progress by pieces of 8 MiB of the payload: the file was streamed
            let payload = (bytes.len() - 12 - 4 * tokens.len()) as u64;
            let pieces: Vec<(u64, u64)> = (0..payload.div_ceil(8 << 20))
                .map(|i| (i * (8 << 20), payload))
                .collect();
            assert_eq!(calls, pieces, "version {version}");
            let want = b
                .load_sequence_bytes(&bytes, 1, ReadOptions::default(), None)
                .unwrap();
            assert_eq!(loaded, want);
            assert_eq!(observable(&a), observable(&b), "version {version}");

            let before = observable(&a);
            let mut pieces = 0;
            let mut stop_after_one = |_: u64, _: u64| {
                pieces += 1;
                pieces < 2
            };
            let e = a
                .load_sequence_file(&path, 0, ReadOptions::default(), Some(&mut stop_after_one))
                .unwrap_err();
            assert!(matches!(e, KvError::Aborted(_)), "{e}");
            assert_eq!(observable(&a), before, "aborted, version {version}");

            std::fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
            let e = a
                .load_sequence_file(&path, 0, ReadOptions::default(), None)
                .unwrap_err();
            let from_bytes = a
                .load_sequence_bytes(&bytes[..bytes.len() - 100], 0, ReadOptions::default(), None)
                .unwrap_err();
            assert_eq!(e.to_string(), from_bytes.to_string());
            assert_eq!(observable(&a), before, "truncated, version {version}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
