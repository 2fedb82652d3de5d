//! Builds `kv-driver` (driver/driver.cpp, the oracle) and `kv-bench` (driver/kv-bench.cpp,
//! llama.cpp's side of `npm run bench:llama`, path in `DIFFERENTIAL_BENCH`) against llama.cpp 0.1.103 as shipped in the crates.io
//! package `llama-cpp-sys-2` 0.1.103, with cmake, CPU only, into `<target>/differential-llama-0.1.103/`
//! (built once, reused by every profile). Never fails the build: when something is missing the
//! reason goes into `DIFFERENTIAL_DRIVER_ERROR`, and the tests fail with it.

include!("../shared-build/llama_cmake.rs");

fn main() {
    run_build_script(
        "DIFFERENTIAL",
        "the llama.cpp 0.1.103 oracle",
        &LlamaDriver {
            krate: "llama-cpp-sys-2-0.1.103",
            dir: "differential-llama-0.1.103",
            target: "kv-driver",
            also: &[("kv-bench", "BENCH")],
            // the crate is a never-compiled dependency of this package, for `cargo fetch`
            fetch_manifest: manifest_dir().join("Cargo.toml"),
            extra: &[],
        },
    );
}
