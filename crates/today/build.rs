//! Builds `today-driver` (driver/driver.cpp) against llama.cpp 0.1.161 as shipped in the
//! crates.io package `llama-cpp-sys-2` 0.1.161, into `<target>/today-llama-0.1.161/` (built
//! once). The crate is fetched through `llama-src/Cargo.toml`, a manifest with its own
//! workspace: cargo unifies semver-compatible versions, so differential's `=0.1.103` and
//! `=0.1.161` cannot both be dependencies inside this workspace. Never fails the build: the
//! reason goes into `TODAY_DRIVER_ERROR`, and the tests fail with it.

include!("../shared-build/llama_cmake.rs");

fn main() {
    run_build_script(
        "TODAY",
        "the llama.cpp 0.1.161 peer",
        &LlamaDriver {
            krate: "llama-cpp-sys-2-0.1.161",
            dir: "today-llama-0.1.161",
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
    );
}
