//! Builds `today-driver` (driver/driver.cpp) against llama.cpp 0.1.161 as shipped in the
//! crates.io package `llama-cpp-sys-2` 0.1.161, into `<target>/today-llama-0.1.161/` (built
//! once). The crate is fetched through `llama-src/Cargo.toml`, a manifest with its own
//! workspace: cargo unifies semver-compatible versions, so differential's `=0.1.103` and
//! `=0.1.161` cannot both be dependencies inside this workspace. Never fails the build: the
//! reason goes into `TODAY_DRIVER_ERROR`, and the tests fail with it.

include!("../shared-build/llama_cmake.rs");

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=../shared-build/llama_cmake.rs");
    println!("cargo:rerun-if-changed=driver/driver.cpp");
    println!("cargo:rerun-if-changed=driver/CMakeLists.txt");
    println!("cargo:rerun-if-env-changed=TODAY_SKIP_BUILD");
    println!("cargo:rerun-if-env-changed=CMAKE");
    match build() {
        Ok(driver) => println!("cargo:rustc-env=TODAY_DRIVER={}", driver.display()),
        Err(msg) => {
            let msg = msg.replace(['\n', '\r'], " | ");
            println!("cargo:warning=today-peer: {msg}");
            println!("cargo:rustc-env=TODAY_DRIVER_ERROR={msg}");
        }
    }
}

fn build() -> Result<PathBuf, String> {
    if env::var_os("TODAY_SKIP_BUILD").is_some() {
        return Err("the llama.cpp 0.1.161 driver was not built (TODAY_SKIP_BUILD is set)".into());
    }
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").map_err(|e| e.to_string())?);
    build_driver(&LlamaDriver {
        krate: "llama-cpp-sys-2-0.1.161",
        dir: "today-llama-0.1.161",
        target: "today-driver",
        fetch_manifest: manifest.join("llama-src").join("Cargo.toml"),
        // 0.1.161 builds its tools, common library, app and OpenSSL support by default
        extra: &[
            "-DLLAMA_OPENSSL=OFF",
            "-DLLAMA_BUILD_TOOLS=OFF",
            "-DLLAMA_BUILD_COMMON=OFF",
            "-DLLAMA_BUILD_APP=OFF",
        ],
    })
}
