//! `convert` of every peer fixture under a matrix of options, pinned to the bytes the
//! cache-based converter (before conversion streamed layer by layer) wrote: each output's
//! BLAKE3 hash, or the kind of error it refused with, is in `tests/convert-golden.txt`.
//! `UPDATE_CONVERT_GOLDEN=1 cargo test --test convert_golden` rewrites that file; it was written
//! by the converter of commit cc00482, so a difference means the output changed.

#[path = "common/fixtures.rs"]
mod fixtures;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use llama_kv_cache::state::parts::PartRole;
use llama_kv_cache::{convert_bytes, convert_file, ConvertOptions};
use llama_kv_cache::{FileKind, GgmlType, KvError, Layout};

/// The option sets every fixture is converted with.
fn matrix() -> Vec<(&'static str, ConvertOptions)> {
    let mut m: Vec<(&'static str, ConvertOptions)> = Vec::new();
    let with = |f: &dyn Fn(&mut ConvertOptions)| {
        let mut o = ConvertOptions::default();
        f(&mut o);
        o
    };
    m.push(("default", ConvertOptions::default()));
    for (name, v) in [
        ("v9", 9),
        ("v10", 10),
        ("v11", 11),
        ("v2", 2),
        ("v3", 3),
        ("v4", 4),
    ] {
        m.push((name, with(&|o| o.write.version = Some(v))));
    }
    m.push(("seed", with(&|o| o.write.layout = Layout::Seed)));
    m.push(("rot", with(&|o| o.write.layout = Layout::StreamsRot)));
    m.push(("n_stream2", with(&|o| o.write.n_stream = 2)));
    m.push(("seq0", with(&|o| o.extract_seq = Some(0))));
    m.push(("seq1", with(&|o| o.extract_seq = Some(1))));
    m.push((
        "seq0-v4",
        with(&|o| {
            o.extract_seq = Some(0);
            o.write.version = Some(4);
        }),
    ));
    m.push(("as_seq3", with(&|o| o.as_seq = Some(3))));
    m.push(("to-session", with(&|o| o.to = Some(FileKind::Session))));
    m.push(("to-sequence", with(&|o| o.to = Some(FileKind::Sequence))));
    m.push(("recurrent", with(&|o| o.recurrent = Some(true))));
    m.push(("transformer", with(&|o| o.recurrent = Some(false))));
    m.push((
        "f32",
        with(&|o| {
            o.type_k = Some(GgmlType::F32);
            o.type_v = Some(GgmlType::F32);
        }),
    ));
    m.push((
        "f16-v11",
        with(&|o| {
            o.type_k = Some(GgmlType::F16);
            o.type_v = Some(GgmlType::F16);
            o.write.version = Some(11);
        }),
    ));
    m.push((
        "q8_0",
        with(&|o| {
            o.type_k = Some(GgmlType::Q8_0);
            o.type_v = Some(GgmlType::Q8_0);
        }),
    ));
    m.push(("q8_0-k", with(&|o| o.type_k = Some(GgmlType::Q8_0))));
    m.push((
        "q4_0-rot",
        with(&|o| {
            o.type_k = Some(GgmlType::Q4_0);
            o.type_v = Some(GgmlType::Q4_0);
            o.n_rot_k = Some(16);
            o.n_rot_v = Some(16);
            o.write.layout = Layout::StreamsRot;
        }),
    ));
    m.push((
        "bf16-rot-v",
        with(&|o| {
            o.type_v = Some(GgmlType::Bf16);
            o.n_rot_v = Some(16);
            o.write.layout = Layout::StreamsRot;
        }),
    ));
    m.push((
        "unrotate",
        with(&|o| {
            o.n_rot_k = Some(0);
            o.n_rot_v = Some(0);
        }),
    ));
    for (name, role) in [
        ("base", PartRole::Base),
        ("swa", PartRole::Swa),
        ("attention", PartRole::Attention),
        ("recurrent-part", PartRole::Recurrent),
    ] {
        m.push((name, with(&|o| o.part = Some(role))));
    }
    m.push((
        "base-v10",
        with(&|o| {
            o.part = Some(PartRole::Base);
            o.write.version = Some(10);
        }),
    ));
    m
}

fn kind(e: &KvError) -> &'static str {
    match e {
        KvError::InvalidArg(_) => "InvalidArg",
        KvError::OutOfRange(_) => "OutOfRange",
        KvError::Unsupported(_) => "Unsupported",
        KvError::InvalidState(_) => "InvalidState",
        KvError::InvalidModel(_) => "InvalidModel",
        KvError::Io(_) => "Io",
        KvError::Backend(_) => "Backend",
        KvError::NoSpace(_) => "NoSpace",
        KvError::Aborted(_) => "Aborted",
    }
}

fn outcome(r: Result<Vec<u8>, KvError>) -> String {
    match r {
        Ok(bytes) => format!("ok {}", blake3::hash(&bytes).to_hex()),
        Err(e) => format!("err {}", kind(&e)),
    }
}

fn golden_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/convert-golden.txt")
}

fn name_of(p: &Path) -> String {
    p.strip_prefix(fixtures::fixture_dir())
        .unwrap()
        .to_string_lossy()
        .into_owned()
}

#[test]
fn convert_writes_the_bytes_the_cache_based_converter_wrote() {
    let mut now = BTreeMap::new();
    let tmp = std::env::temp_dir().join(format!("kv-golden-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    for path in fixtures::all_fixtures() {
        let bytes = std::fs::read(&path).unwrap();
        for (opt_name, opts) in matrix() {
            let key = format!("{} {opt_name}", name_of(&path));
            let in_memory = outcome(convert_bytes(&bytes, &opts));
            // the streaming file path writes the same bytes, or refuses alike and writes nothing
            let out = tmp.join("out.bin");
            let streamed = outcome(
                convert_file(&path, &out, &opts, None)
                    .and_then(|()| std::fs::read(&out).map_err(|e| KvError::Io(e.to_string()))),
            );
            if streamed.starts_with("err") {
                assert!(
                    !out.exists(),
                    "{key}: a failed convert left {}",
                    out.display()
                );
            }
            let _ = std::fs::remove_file(&out);
            assert_eq!(
                streamed, in_memory,
                "{key}: file and in-memory convert differ"
            );
            now.insert(key, in_memory);
        }
    }
    let leftovers: Vec<_> = std::fs::read_dir(&tmp).unwrap().collect();
    assert!(leftovers.is_empty(), "litter in {}", tmp.display());
    std::fs::remove_dir_all(&tmp).unwrap();
    let text: String = now.iter().map(|(k, v)| format!("{k} {v}\n")).collect();
    if std::env::var_os("UPDATE_CONVERT_GOLDEN").is_some() {
        std::fs::write(golden_path(), &text).unwrap();
        return;
    }
    let golden = std::fs::read_to_string(golden_path()).unwrap();
    // each line: fixture, option set, outcome ("ok HASH" or "err KIND")
    let want: BTreeMap<String, &str> = golden
        .lines()
        .map(|l| {
            let mut it = l.splitn(3, ' ');
            let (name, opt) = (it.next().unwrap(), it.next().unwrap());
            (format!("{name} {opt}"), it.next().unwrap())
        })
        .collect();
    let mut diffs = Vec::new();
    for (k, v) in &now {
        match want.get(k) {
            Some(w) if w == v => {}
            other => diffs.push(format!("{k}: now {v}, golden {other:?}")),
        }
    }
    assert_eq!(now.len(), want.len(), "the matrix changed size");
    assert!(
        diffs.is_empty(),
        "{} differences:\n{}",
        diffs.len(),
        diffs.join("\n")
    );
    let ok = now.values().filter(|v| v.starts_with("ok")).count();
    assert!(
        ok > 300,
        "only {ok} conversions succeeded: the matrix tests too little"
    );
}
