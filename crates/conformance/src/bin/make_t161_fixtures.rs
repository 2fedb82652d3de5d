//! Regenerates the llama.cpp 0.1.161 fixtures (`__test__/fixtures/t161/`): for each spec the
//! peer decodes the prompts, saves a session and a sequence file, and the answers go into the
//! JSON sidecar. Needs the models of `interop/make_models.py`.
//!
//! `cargo run -p conformance --bin make-t161-fixtures [name...]` (names without `t161-`: only
//! those specs; none: all of them)

fn main() {
    let only: Vec<String> = std::env::args().skip(1).collect();
    for spec in conformance::today::specs()
        .into_iter()
        .chain(conformance::today::kshift_specs())
        .chain(conformance::today::dsv4_specs())
        .filter(|s| only.is_empty() || only.iter().any(|n| n == s.name))
    {
        match spec.generate() {
            Ok(sidecar) => {
                let text = serde_json::to_string_pretty(&sidecar).expect("a JSON value serialises");
                if let Err(e) = std::fs::write(spec.sidecar_path(), text + "\n") {
                    eprintln!("{}: {e}", spec.sidecar_path().display());
                    std::process::exit(1);
                }
                println!(
                    "t161-{}: next {} next2 {}",
                    spec.name, sidecar["next"], sidecar["next2"]
                );
            }
            Err(e) => {
                eprintln!("t161-{}: {e}", spec.name);
                std::process::exit(1);
            }
        }
    }
}
