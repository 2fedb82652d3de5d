//! The llama.cpp build script (`build/llama_cmake.rs`, which builds both eras' drivers) must
//! find a cmake that appears after a build without one: `cargo test` run before `npm test`'s
//! set-up used to cache "cmake is not installed" until a `cargo clean`.
//!
//! A throwaway crate laid out like ours (`crates/<pkg>/build.rs` including
//! `build/llama_cmake.rs`, `interop/.venv/bin/cmake` where the set-up puts it) is built twice: without any cmake, then with a stand-in cmake in the venv that "builds" the
//! driver by creating it. The second build must hand the driver's path to the crate.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

const SHARED_BUILD: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/build/llama_cmake.rs");

fn write(path: &Path, text: &str) {
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, text).unwrap();
}

/// PATH without any folder that holds a `cmake`.
fn path_without_cmake() -> String {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let kept: Vec<PathBuf> = std::env::split_paths(&path)
        .filter(|dir| !dir.join("cmake").exists())
        .collect();
    std::env::join_paths(kept).unwrap().into_string().unwrap()
}

/// Builds and runs the fixture; returns what its binary prints.
fn build_and_run(root: &Path) -> String {
    let cargo = env!("CARGO");
    let out = Command::new(cargo)
        .args(["run", "--quiet", "--offline", "--manifest-path"])
        .arg(root.join("crates/fixture/Cargo.toml"))
        .env("CARGO_TARGET_DIR", root.join("target"))
        .env("PATH", path_without_cmake())
        .env_remove("CMAKE")
        .env_remove("FIXTURE_SKIP_BUILD")
        .output()
        .expect("cargo runs");
    assert!(
        out.status.success(),
        "fixture build failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn regression_a_cmake_installed_after_a_failed_build_is_found_without_cargo_clean() {
    let root = std::env::temp_dir().join(format!("cmake-found-later-{}", std::process::id()));
    let _ = fs::remove_dir_all(&root);
    fs::create_dir_all(root.join("crates/fixture/build")).unwrap();
    fs::copy(
        SHARED_BUILD,
        root.join("crates/fixture/build/llama_cmake.rs"),
    )
    .unwrap();
    write(
        &root.join("crates/fixture/Cargo.toml"),
        "[package]\nname = \"fixture\"\nversion = \"0.0.0\"\nedition = \"2021\"\n\n[workspace]\n",
    );
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
    write(
        &root.join("crates/fixture/build.rs"),
        &format!(
            r#"include!("build/llama_cmake.rs");
fn main() {{
    run_build_script(&[LlamaDriver {{
        env: "FIXTURE",
        what: "the fixture driver",
        sources: "driver",
        krate: "llama-cpp-sys-2-0.1.103",
        dir: "fixture-driver",
        target: "fixture-driver-bin",
        also: &[],
        fetch_manifest: PathBuf::from({manifest:?}),
        extra: &[],
    }}]);
}}
"#
        ),
    );
    write(
        &root.join("crates/fixture/driver/driver.cpp"),
        "// stand-in\n",
    );
    write(
        &root.join("crates/fixture/src/main.rs"),
        r#"fn main() {
    match option_env!("FIXTURE_DRIVER") {
        Some(p) => println!("driver {p}"),
        None => println!("error {}", option_env!("FIXTURE_DRIVER_ERROR").unwrap_or("?")),
    }
}
"#,
    );

    let first = build_and_run(&root);
    assert!(
        first.starts_with("error ") && first.contains("cmake is not installed"),
        "{first}"
    );

    // the set-up installs cmake into the venv: a stand-in that configures nothing and
    // "builds" the driver by creating it
    let cmake = root.join("interop/.venv/bin/cmake");
    write(
        &cmake,
        "#!/bin/sh\n\
         if [ \"$1\" = --build ]; then touch \"$2/fixture-driver-bin\"; fi\n\
         exit 0\n",
    );
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&cmake, fs::Permissions::from_mode(0o755)).unwrap();
    }

    let second = build_and_run(&root);
    let _ = fs::remove_dir_all(&root);
    assert!(
        second.starts_with("driver ") && second.trim_end().ends_with("fixture-driver-bin"),
        "the build script did not run again once cmake appeared: {second}"
    );
}
