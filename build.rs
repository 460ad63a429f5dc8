//! Stamps the commit into `--version`, so a bug report names the exact source. A build from a
//! tarball (no git, or no repository) says `unknown commit` instead of failing.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (!text.is_empty()).then_some(text)
}

fn main() {
    // A container build has no .git in its context and passes the commit in instead.
    println!("cargo:rerun-if-env-changed=AGENTRACE_GIT_COMMIT");
    let given = std::env::var("AGENTRACE_GIT_COMMIT")
        .ok()
        .filter(|c| !c.is_empty() && c != "unknown")
        .map(|c| c.chars().take(12).collect());
    let commit = given.or_else(|| git(&["rev-parse", "--short=12", "HEAD"]));
    println!(
        "cargo:rustc-env=AGENTRACE_GIT_COMMIT={}",
        commit.as_deref().unwrap_or("unknown commit")
    );
    // Rebuild when HEAD moves: HEAD itself (a checkout) and the refs it may point to (a commit).
    // A path that does not exist would rerun this script on every build, so only existing ones.
    let dir = git(&["rev-parse", "--git-dir"]);
    let common = git(&["rev-parse", "--git-common-dir"]);
    let watched = [
        dir.map(|d| format!("{d}/HEAD")),
        common.as_ref().map(|c| format!("{c}/refs/heads")),
        common.map(|c| format!("{c}/packed-refs")),
    ];
    for path in watched.into_iter().flatten() {
        if std::path::Path::new(&path).exists() {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    println!("cargo:rerun-if-changed=build.rs");
}
