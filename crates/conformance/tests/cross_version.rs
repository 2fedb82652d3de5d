//! Cross-version: files written by llama.node 1.7.15 (ggsn 9 / ggsq 2) and node-llama-cpp 3.22.1
//! (ggsq 3), converted by us to session v11 / sequence v4, load into llama.cpp 0.1.161, which
//! continues them with the greedy token the original peer produced (`then_token` of their
//! sidecars).

use conformance::models_dir;
use conformance::today::{fixtures_dir, run};
use llama_kv_cache::convert_bytes;
use llama_kv_cache::state::files::inspect_bytes;
use llama_kv_cache::{ConvertOptions, WriteOptions};
use serde_json::Value;

fn type_id(name: &str) -> i32 {
    match name {
        "f32" => 0,
        "f16" => 1,
        "q4_0" => 2,
        "q8_0" => 8,
        other => panic!("no ggml id for {other}"),
    }
}

#[test]
fn peer_files_converted_to_v11_and_v4_continue_in_llama_cpp_0_1_161() {
    let dir = fixtures_dir().join("..");
    let tmp = std::env::temp_dir().join(format!("today-cross-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let is_peer = name.starts_with("ln-") || name.starts_with("nlc-");
        if !is_peer || !(name.ends_with(".ggsn") || name.ends_with(".ggsq")) {
            continue;
        }
        let side: Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join(format!("{name}.json"))).unwrap(),
        )
        .unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let ins = inspect_bytes(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
        let session = name.ends_with(".ggsn");
        let n_seq = side["n_seq_max"].as_u64().unwrap() as u32;
        let unified = side["kv_unified"].as_bool().unwrap_or(false) || n_seq == 1;
        let recurrent = side["recurrent"].as_bool().unwrap_or(false);
        // the sequence the file holds, and how many cells it has
        let (seq, cells) = ins
            .payload
            .streams
            .iter()
            .enumerate()
            .find(|(_, s)| !s.cells.is_empty())
            .map(|(i, s)| {
                (
                    s.cells.seq_ids(0).first().copied().unwrap_or(i as i32),
                    s.cells.len(),
                )
            })
            .unwrap();
        let seq = if session { 0 } else { seq };
        let pos = if recurrent {
            ins.payload.streams[0].cells.positions()[0] as usize + 1
        } else {
            cells
        };
        let opts = ConvertOptions {
            write: WriteOptions {
                version: Some(if session { 11 } else { 4 }),
                n_stream: if unified || recurrent { 1 } else { n_seq },
                ..WriteOptions::default()
            },
            recurrent: Some(recurrent),
            ..ConvertOptions::default()
        };
        let converted = convert_bytes(&bytes, &opts).unwrap_or_else(|e| panic!("{name}: {e}"));
        let out = tmp.join(format!("{name}.v-today"));
        std::fs::write(&out, &converted).unwrap();
        let fa = matches!(&side["flash_attn"], Value::Bool(true))
            || side["flash_attn"].as_str() == Some("on");
        let mut args = vec![
            format!(
                "model={}",
                models_dir().join(side["model"].as_str().unwrap()).display()
            ),
            format!("ctx={}", side["n_ctx"]),
            format!("seqs={n_seq}"),
            format!("fa={}", fa as u8),
            format!("type_k={}", type_id(side["kv_type_k"].as_str().unwrap())),
            format!("type_v={}", type_id(side["kv_type_v"].as_str().unwrap())),
            format!("unified={}", unified as u8),
            format!("token={}", side["next_token"]["id"]),
            format!("pos={pos}"),
        ];
        if session {
            args.push(format!("session={}", out.display()));
        } else {
            args.push(format!("seq_file={}", out.display()));
            args.push(format!("dest={seq}"));
        }
        let answer = run("cont", &args).unwrap_or_else(|e| panic!("{name} as v11/v4: {e}"));
        assert_eq!(
            answer["next"], side["then_token"]["id"],
            "{name}: llama.cpp 0.1.161 continues our v11/v4 copy unlike {}",
            side["peer"]
        );
        checked += 1;
    }
    assert!(
        checked >= 15,
        "only {checked} peer fixtures found in {}",
        dir.display()
    );
    let _ = std::fs::remove_dir_all(&tmp);
}
