//! Inspecting a file reads its metadata only: the same description as inspecting its bytes, at
//! a cost in reads that does not grow with the K/V rows. Converting a file streams it (the
//! option matrix over the peer fixtures is in `convert_golden.rs`).

#[path = "common/fixtures.rs"]
mod fixtures;

use std::io::{Seek, SeekFrom, Write};

use llama_kv_cache::state::files::{inspect_bytes, inspect_file, inspect_source, Inspection};
use llama_kv_cache::state::source::ReadSource;
use llama_kv_cache::{
    convert_bytes, convert_file, CacheParams, ConvertOptions, KvCache, Layout, MemoryKind, Outputs,
    Tensor, UBatch, WriteOptions,
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
    let mut cache = KvCache::new(CacheParams::new(16, 2, 32, 32)).unwrap();
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
