//! Builds `kv-driver` (driver/driver.cpp) against llama.cpp 0.1.103 as shipped in the crates.io
//! package `llama-cpp-sys-2` 0.1.103, with cmake, CPU only, into `<target>/differential-llama-0.1.103/`
//! (built once, reused by every profile). Never fails the build: when something is missing the
//! reason goes into `DIFFERENTIAL_DRIVER_ERROR`, and the tests fail with it.

use std::env;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

const CRATE: &str = "llama-cpp-sys-2-0.1.103";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=driver/driver.cpp");
    println!("cargo:rerun-if-changed=driver/CMakeLists.txt");
    println!("cargo:rerun-if-env-changed=LLAMA_CPP_SRC");
    println!("cargo:rerun-if-env-changed=DIFFERENTIAL_SKIP_BUILD");
    println!("cargo:rerun-if-env-changed=CMAKE");
    match build() {
        Ok(driver) => println!("cargo:rustc-env=DIFFERENTIAL_DRIVER={}", driver.display()),
        Err(msg) => {
            let msg = msg.replace(['\n', '\r'], " | ");
            println!("cargo:warning=differential: {msg}");
            println!("cargo:rustc-env=DIFFERENTIAL_DRIVER_ERROR={msg}");
        }
    }
}

fn build() -> Result<PathBuf, String> {
    if env::var_os("DIFFERENTIAL_SKIP_BUILD").is_some() {
        return Err("the llama.cpp driver was not built (DIFFERENTIAL_SKIP_BUILD is set)".into());
    }
    let src = llama_src()?;
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").map_err(|e| e.to_string())?);
    let out = PathBuf::from(env::var("OUT_DIR").map_err(|e| e.to_string())?);
    // OUT_DIR is <target>/[<triple>/]<profile>/build/<pkg>-<hash>/out
    let target = out.ancestors().nth(4).unwrap_or(&out).to_path_buf();
    let dir = target.join("differential-llama-0.1.103");
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;

    let cmake = cmake_program(&manifest);
    if Command::new(&cmake)
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .is_err()
    {
        return Err(
            "cmake is not installed; the llama.cpp oracle needs it and a C++ compiler: \
             `npm test` installs cmake from PyPI into interop/.venv (or: apt-get install -y cmake g++)"
                .into(),
        );
    }
    let log = dir.join("build.log");
    let run = |args: &[String], what: &str| -> Result<(), String> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .map_err(|e| e.to_string())?;
        let status = Command::new(&cmake)
            .args(args)
            .stdout(file.try_clone().map_err(|e| e.to_string())?)
            .stderr(file)
            .status()
            .map_err(|e| format!("cmake {what}: {e}"))?;
        if status.success() {
            Ok(())
        } else {
            Err(format!(
                "cmake {what} failed ({status}); see {}: {}",
                log.display(),
                tail(&log)
            ))
        }
    };
    let _ = std::fs::remove_file(&log);
    run(
        &[
            "-S".into(),
            manifest.join("driver").display().to_string(),
            "-B".into(),
            dir.display().to_string(),
            format!("-DLLAMA_CPP_SRC={}", src.display()),
            "-DCMAKE_BUILD_TYPE=Release".into(),
            "-DGGML_NATIVE=OFF".into(),
            "-DGGML_OPENMP=OFF".into(),
            "-DLLAMA_CURL=OFF".into(),
            "-DLLAMA_BUILD_TESTS=OFF".into(),
            "-DLLAMA_BUILD_EXAMPLES=OFF".into(),
            "-DLLAMA_BUILD_SERVER=OFF".into(),
            "-DBUILD_SHARED_LIBS=OFF".into(),
        ],
        "configure",
    )?;
    let jobs = env::var("NUM_JOBS").unwrap_or_else(|_| "2".into());
    run(
        &[
            "--build".into(),
            dir.display().to_string(),
            "--target".into(),
            "kv-driver".into(),
            "-j".into(),
            jobs,
        ],
        "build",
    )?;
    let driver = dir.join("kv-driver");
    if !driver.exists() {
        return Err(format!(
            "cmake finished but {} is missing",
            driver.display()
        ));
    }
    Ok(driver)
}

/// The cmake to run: `CMAKE` as for the cmake crate, else the one `npm test`'s set-up installs from
/// PyPI into `interop/.venv` (so no system package is needed), else `cmake` on the PATH.
fn cmake_program(manifest: &Path) -> String {
    if let Ok(cmake) = env::var("CMAKE") {
        return cmake;
    }
    let venv = manifest.join("../../interop/.venv/bin/cmake");
    if venv.exists() {
        return venv.display().to_string();
    }
    "cmake".into()
}

fn tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(8)..].join(" | ")
}

/// The `llama.cpp/` folder of llama-cpp-sys-2 0.1.103 in cargo's registry, fetched with
/// `cargo fetch` when it is not there yet.
fn llama_src() -> Result<PathBuf, String> {
    if let Some(p) = env::var_os("LLAMA_CPP_SRC") {
        return Ok(PathBuf::from(p));
    }
    if let Some(p) = find_in_registry() {
        return Ok(p);
    }
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let manifest =
        Path::new(&env::var("CARGO_MANIFEST_DIR").unwrap_or_default()).join("Cargo.toml");
    let status = Command::new(cargo)
        .args(["fetch", "--manifest-path"])
        .arg(&manifest)
        .status()
        .map_err(|e| format!("cargo fetch: {e}"))?;
    if !status.success() {
        return Err(format!(
            "cargo fetch failed ({status}): {CRATE} is needed for llama.cpp's source; run `cargo fetch` with network access"
        ));
    }
    find_in_registry()
        .ok_or_else(|| format!("{CRATE} is not in cargo's registry after `cargo fetch`"))
}

fn find_in_registry() -> Option<PathBuf> {
    let home = env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))?;
    let src = home.join("registry").join("src");
    for entry in std::fs::read_dir(src).ok()?.flatten() {
        let p = entry.path().join(CRATE).join("llama.cpp");
        if p.join("CMakeLists.txt").exists() {
            return Some(p);
        }
    }
    None
}
