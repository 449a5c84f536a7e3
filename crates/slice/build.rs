//! Compiles bpf/slice_hold.bpf.c with clang into OUT_DIR so `cargo build` always embeds a fresh
//! object (include_bytes! in src/hold/queue.rs); nothing is read from disk at run time.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let src = manifest.join("../../bpf/slice_hold.bpf.c");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR")).join("slice_hold.bpf.o");
    println!("cargo:rerun-if-changed={}", src.display());
    let clang = std::env::var("CLANG").unwrap_or_else(|_| "clang".to_string());
    let status = Command::new(&clang)
        .args(["-O2", "-g", "-target", "bpf", "-Wall", "-Werror"])
        .arg("-I/usr/include/x86_64-linux-gnu")
        .arg("-c")
        .arg(&src)
        .arg("-o")
        .arg(&out)
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("{clang} failed ({s}) compiling {}", src.display()),
        Err(e) => panic!(
            "cannot run {clang} ({e}); install it with scripts/install-deps.sh (package clang)"
        ),
    }
}
