//! Builds the drivers of both llama.cpp eras with cmake, CPU only, from the llama.cpp source
//! shipped in the crates.io package `llama-cpp-sys-2` (fetched with `cargo fetch`; never
//! compiled as a Rust crate), each once into its own folder of the target directory:
//!
//! - the seed, 0.1.103: `kv-driver` (driver/seed/driver.cpp, the differential oracle) and
//!   `kv-bench` (driver/seed/kv-bench.cpp, llama.cpp's side of `npm run bench:llama`, path in
//!   `SEED_BENCH`), into `<target>/conformance-llama-0.1.103/`;
//! - today, 0.1.161: `today-driver` (driver/today/driver.cpp), into
//!   `<target>/conformance-llama-0.1.161/`.
//!
//! Never fails the build: when something is missing the reason goes into `SEED_DRIVER_ERROR` /
//! `TODAY_DRIVER_ERROR`, and the tests that need that driver fail with it (`src/driver.rs`).

include!("build/llama_cmake.rs");

fn main() {
    run_build_script(&[
        LlamaDriver {
            env: "SEED",
            what: "the llama.cpp 0.1.103 oracle",
            sources: "driver/seed",
            krate: "llama-cpp-sys-2-0.1.103",
            dir: "conformance-llama-0.1.103",
            target: "kv-driver",
            also: &[("kv-bench", "BENCH")],
            // the crate is a never-compiled dependency of this package, for `cargo fetch`
            fetch_manifest: manifest_dir().join("Cargo.toml"),
            extra: &[],
        },
        LlamaDriver {
            env: "TODAY",
            what: "the llama.cpp 0.1.161 peer",
            sources: "driver/today",
            krate: "llama-cpp-sys-2-0.1.161",
            dir: "conformance-llama-0.1.161",
            target: "today-driver",
            also: &[],
            fetch_manifest: manifest_dir().join("llama-src").join("Cargo.toml"),
            // 0.1.161 builds its tools, common library, app and OpenSSL support by default
            extra: &[
                "-DLLAMA_OPENSSL=OFF",
                "-DLLAMA_BUILD_TOOLS=OFF",
                "-DLLAMA_BUILD_COMMON=OFF",
                "-DLLAMA_BUILD_APP=OFF",
            ],
        },
    ]);
}
