//! Sets `PREFIX_BATCHER_VERSION` for `prefix_batcher::VERSION`: the crate's version with the
//! commit it is built from as build metadata (`0.1.0+1a2b3c4d5e6f`, from `git rev-parse
//! --short=12 HEAD`), followed by `.modified` when tracked files differ from that commit (`git
//! status --porcelain --untracked-files=no`: a build of uncommitted changes), or the crate's
//! version alone outside a git checkout or without git. It is what `--version`, the `build_info`
//! metric and `status` show, so that the instances of a rolling upgrade can be told apart.

use std::path::Path;
use std::process::Command;

fn main() {
    let commit = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    let modified = !commit.is_empty()
        && Command::new("git")
            .args(["status", "--porcelain", "--untracked-files=no"])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .is_some_and(|o| !o.stdout.is_empty());
    let crate_version = std::env::var("CARGO_PKG_VERSION").unwrap_or_default();
    let version = match (commit.is_empty(), modified) {
        (true, _) => crate_version,
        (false, false) => format!("{crate_version}+{commit}"),
        (false, true) => format!("{crate_version}+{commit}.modified"),
    };
    println!("cargo:rustc-env=PREFIX_BATCHER_VERSION={version}");
    // Built again when HEAD moves: to another branch (HEAD) or to a new commit (the ref it names).
    println!("cargo:rerun-if-changed=build.rs");
    // Again when the sources change (committed or not), for `.modified`.
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-changed=Cargo.toml");
    let head = Path::new(".git/HEAD");
    if head.exists() {
        println!("cargo:rerun-if-changed=.git/HEAD");
        if let Some(reference) = std::fs::read_to_string(head).ok().and_then(|h| h.strip_prefix("ref: ").map(|r| r.trim().to_owned())) {
            println!("cargo:rerun-if-changed=.git/{reference}");
        }
        println!("cargo:rerun-if-changed=.git/packed-refs");
    }
}
