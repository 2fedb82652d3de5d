// Builds small C++ drivers against llama.cpp from `llama-cpp-sys-2` crates' source with cmake,
// CPU only, each into `<target>/<dir>/` (built once, reused by every profile and by every
// checkout sharing the target directory: a driver's sources are copied into `<dir>/driver-src`
// so cmake's cache never names a checkout). Included by build.rs (`include!`). Never fails the
// build: the caller turns an error into an env var the tests report.

use std::env;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// One driver to build.
struct LlamaDriver<'a> {
    /// Prefix of the env vars the crate gets: `<env>_DRIVER` (or `<env>_DRIVER_ERROR`), and
    /// `<env>_SKIP_BUILD` skips the build.
    env: &'a str,
    /// What the driver is, for messages.
    what: &'a str,
    /// The driver's sources (a cmake project), relative to the package.
    sources: &'a str,
    /// `llama-cpp-sys-2-<version>`: the registry folder whose `llama.cpp/` is built.
    krate: &'a str,
    /// Folder under the target directory.
    dir: &'a str,
    /// The cmake target (and binary name) of the driver.
    target: &'a str,
    /// More programs of the same cmake project: `(target, name)`, each handed to the crate as
    /// `<env>_<name>`.
    also: &'a [(&'a str, &'a str)],
    /// The manifest `cargo fetch` downloads the crate with when it is not in the registry.
    fetch_manifest: PathBuf,
    /// cmake options beyond the shared ones.
    extra: &'a [&'a str],
}

/// The whole build script: builds each driver unless `<env>_SKIP_BUILD` is set, and hands its
/// path to the crate as `<env>_DRIVER` (or why there is none as `<env>_DRIVER_ERROR`).
fn run_build_script(drivers: &[LlamaDriver<'_>]) {
    for file in ["build.rs", "build/llama_cmake.rs"] {
        println!("cargo:rerun-if-changed={file}");
    }
    println!("cargo:rerun-if-env-changed=CMAKE");
    let mut watch_for_cmake = false;
    for driver in drivers {
        let (env_prefix, what) = (driver.env, driver.what);
        println!("cargo:rerun-if-changed={}", driver.sources);
        println!("cargo:rerun-if-env-changed={env_prefix}_SKIP_BUILD");
        let built = if env::var_os(format!("{env_prefix}_SKIP_BUILD")).is_some() {
            Err(format!("{what} was not built ({env_prefix}_SKIP_BUILD is set)"))
        } else {
            build_driver(driver)
        };
        match built {
            Ok(path) => {
                println!("cargo:rustc-env={env_prefix}_DRIVER={}", path.display());
                for (target, name) in driver.also {
                    let program = path.with_file_name(target);
                    println!("cargo:rustc-env={env_prefix}_{name}={}", program.display());
                }
            }
            Err(msg) => {
                watch_for_cmake = true;
                let msg = msg.replace(['\n', '\r'], " | ");
                println!("cargo:warning={what}: {msg}");
                println!("cargo:rustc-env={env_prefix}_DRIVER_ERROR={msg}");
            }
        }
    }
    if watch_for_cmake {
        // a cmake provided later (the set-up installs one into the venv) must be found
        // without a `cargo clean`: watch where it will appear (a path that does not exist
        // yet makes cargo run this script again at every build until it does) and PATH
        println!(
            "cargo:rerun-if-changed={}",
            venv_cmake(&manifest_dir()).display()
        );
        println!("cargo:rerun-if-env-changed=PATH");
    }
}

/// The package's own folder.
fn manifest_dir() -> PathBuf {
    PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap_or_default())
}

fn build_driver(d: &LlamaDriver<'_>) -> Result<PathBuf, String> {
    let src = llama_src(d)?;
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").map_err(|e| e.to_string())?);
    let out = PathBuf::from(env::var("OUT_DIR").map_err(|e| e.to_string())?);
    // OUT_DIR is <target>/[<triple>/]<profile>/build/<pkg>-<hash>/out
    let target = out.ancestors().nth(4).unwrap_or(&out).to_path_buf();
    let dir = target.join(d.dir);
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let driver_src = dir.join("driver-src");
    std::fs::create_dir_all(&driver_src)
        .map_err(|e| format!("cannot create {}: {e}", driver_src.display()))?;
    let sources = manifest.join(d.sources);
    let files = std::fs::read_dir(&sources)
        .map_err(|e| format!("cannot list {}: {e}", sources.display()))?;
    for entry in files.flatten().filter(|e| e.path().is_file()) {
        let from = entry.path();
        let to = driver_src.join(entry.file_name());
        // copy only on change, so an unchanged driver is not rebuilt
        if std::fs::read(&from).ok() != std::fs::read(&to).ok() {
            std::fs::copy(&from, &to)
                .map_err(|e| format!("cannot copy {}: {e}", from.display()))?;
        }
    }
    let cmake = cmake_program(&manifest);
    if Command::new(&cmake)
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .is_err()
    {
        return Err(
            "cmake is not installed; building llama.cpp needs it and a C++ compiler: \
             `npm test` installs cmake from PyPI into interop/.venv (or: apt-get install -y cmake g++)"
                .into(),
        );
    }
    forget_a_cache_made_elsewhere(&dir)?;
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
            driver_src.display().to_string(),
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
        ]
        .into_iter()
        .chain(d.extra.iter().map(|s| s.to_string()))
        .collect::<Vec<_>>(),
        "configure",
    )?;
    let jobs = env::var("NUM_JOBS").unwrap_or_else(|_| "2".into());
    let mut build = vec!["--build".to_string(), dir.display().to_string(), "--target".into()];
    build.push(d.target.into());
    build.extend(d.also.iter().map(|(target, _)| target.to_string()));
    build.extend(["-j".into(), jobs]);
    run(&build, "build")?;
    let driver = dir.join(d.target);
    if !driver.exists() {
        return Err(format!(
            "cmake finished but {} is missing",
            driver.display()
        ));
    }
    Ok(driver)
}

/// A target directory copied from another checkout holds a cmake cache that names the other
/// folder, and cmake refuses to configure over it: start that build afresh.
fn forget_a_cache_made_elsewhere(dir: &Path) -> Result<(), String> {
    let cache = std::fs::read_to_string(dir.join("CMakeCache.txt")).unwrap_or_default();
    let made_in = cache
        .lines()
        .find_map(|l| l.strip_prefix("CMAKE_CACHEFILE_DIR:INTERNAL="));
    match made_in {
        Some(made_in) if Path::new(made_in) != dir => {
            let _ = std::fs::remove_file(dir.join("CMakeCache.txt"));
            match std::fs::remove_dir_all(dir.join("CMakeFiles")) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(format!(
                    "cannot remove the cmake files {} copied from {made_in}: {e}",
                    dir.display()
                )),
                _ => Ok(()),
            }
        }
        _ => Ok(()),
    }
}

/// The cmake to run: `CMAKE` as for the cmake crate, else the one `npm test`'s set-up installs
/// from PyPI into `interop/.venv` (so no system package is needed), else `cmake` on the PATH.
fn cmake_program(manifest: &Path) -> String {
    if let Ok(cmake) = env::var("CMAKE") {
        return cmake;
    }
    let venv = venv_cmake(manifest);
    if venv.exists() {
        return venv.display().to_string();
    }
    "cmake".into()
}

/// Where `npm test`'s set-up installs cmake (PyPI's `cmake`, into `interop/.venv`).
fn venv_cmake(manifest: &Path) -> PathBuf {
    manifest.join("../../interop/.venv/bin/cmake")
}

fn tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(8)..].join(" | ")
}

/// The crate's `llama.cpp/` folder in cargo's registry, fetched with `cargo fetch` when it is
/// not there yet.
fn llama_src(d: &LlamaDriver<'_>) -> Result<PathBuf, String> {
    if let Some(p) = find_in_registry(d.krate) {
        return Ok(p);
    }
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .args(["fetch", "--manifest-path"])
        .arg(&d.fetch_manifest)
        .status()
        .map_err(|e| format!("cargo fetch: {e}"))?;
    if !status.success() {
        return Err(format!(
            "cargo fetch failed ({status}): {} is needed for llama.cpp's source; run `cargo fetch` with network access",
            d.krate
        ));
    }
    find_in_registry(d.krate)
        .ok_or_else(|| format!("{} is not in cargo's registry after `cargo fetch`", d.krate))
}

fn find_in_registry(krate: &str) -> Option<PathBuf> {
    let home = env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))?;
    let src = home.join("registry").join("src");
    for entry in std::fs::read_dir(src).ok()?.flatten() {
        let p = entry.path().join(krate).join("llama.cpp");
        if p.join("CMakeLists.txt").exists() {
            return Some(p);
        }
    }
    None
}
