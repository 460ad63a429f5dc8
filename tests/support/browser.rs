//! A real browser for the tests: headless Chromium (Debian's `chromium`) loads a page from
//! disk, writes a screenshot and the DOM it built, and logs every console message to stderr,
//! where these helpers read them back.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Chromium's path: `AGENTRACE_CHROMIUM`, else `chromium` or `chromium-browser` on `PATH`.
pub fn chromium() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("AGENTRACE_CHROMIUM") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .flat_map(|dir| ["chromium", "chromium-browser"].map(|name| dir.join(name)))
        .find(|p| p.is_file())
}

/// What the browser made of a page.
#[derive(Debug)]
pub struct Rendered {
    /// The DOM after load, serialised.
    pub dom: String,
    /// Console messages (script errors included), as Chromium logged them.
    pub console: Vec<String>,
    /// Width and height of the screenshot, from its PNG header.
    pub screenshot_size: (u32, u32),
}

/// Loads `page` in headless Chromium with no network, no profile and no sandbox (the test
/// may run as root), at `width`×`height`; the screenshot goes to `screenshot`.
pub fn render(
    browser: &Path,
    page: &Path,
    screenshot: &Path,
    (width, height): (u32, u32),
) -> Rendered {
    let profile = tempfile::tempdir().expect("profile dir");
    let url = format!(
        "file://{}",
        page.canonicalize().expect("page path").display()
    );
    let child = Command::new(browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--hide-scrollbars",
            "--enable-logging=stderr",
            "--v=0",
            "--dump-dom",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg(format!("--window-size={width},{height}"))
        .arg(format!("--screenshot={}", screenshot.display()))
        .arg(&url)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", browser.display()));
    // A watchdog, not a synchronisation: the browser exits by itself once the page is done.
    let id = child.id();
    let watchdog = std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(120);
        while Instant::now() < deadline {
            std::thread::park_timeout(Duration::from_millis(200));
            if !Path::new(&format!("/proc/{id}")).exists() {
                return;
            }
        }
        let _ = Command::new("kill").arg(id.to_string()).status();
    });
    let out = child.wait_with_output().expect("chromium output");
    watchdog.thread().unpark();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "chromium failed ({}) on {url}:\n{stderr}",
        out.status
    );
    let png = std::fs::read(screenshot)
        .unwrap_or_else(|e| panic!("no screenshot at {}: {e}\n{stderr}", screenshot.display()));
    Rendered {
        dom: String::from_utf8_lossy(&out.stdout).into_owned(),
        console: stderr
            .lines()
            .filter(|l| l.contains(":CONSOLE"))
            .map(str::to_string)
            .collect(),
        screenshot_size: png_size(&png).expect("the screenshot is not a PNG"),
    }
}

fn png_size(png: &[u8]) -> Option<(u32, u32)> {
    if png.len() < 24 || &png[..8] != b"\x89PNG\r\n\x1a\n" || &png[12..16] != b"IHDR" {
        return None;
    }
    let be = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
    Some((be(&png[16..20]), be(&png[20..24])))
}

/// Values of every `name="…"` attribute in the DOM (`href`, `src`).
pub fn attributes<'a>(dom: &'a str, name: &str) -> Vec<&'a str> {
    let key = format!(" {name}=\"");
    dom.match_indices(&key)
        .filter_map(|(i, _)| {
            let rest = &dom[i + key.len()..];
            rest.find('"').map(|end| &rest[..end])
        })
        .collect()
}

/// What is wrong with a rendered page: console messages, links or sources that leave the
/// machine, and relative ones whose file does not exist next to `page`.
pub fn problems(page: &Path, rendered: &Rendered) -> Vec<String> {
    let mut found: Vec<String> = rendered
        .console
        .iter()
        .map(|l| format!("console: {l}"))
        .collect();
    let base = page.parent().expect("page dir");
    for target in attributes(&rendered.dom, "href")
        .into_iter()
        .chain(attributes(&rendered.dom, "src"))
    {
        if target.starts_with('#') {
            continue;
        }
        if target.contains("://") || target.starts_with("//") {
            found.push(format!("reaches off the page's directory: {target}"));
            continue;
        }
        let file = target.split(['#', '?']).next().unwrap_or(target);
        if !base.join(file).is_file() {
            found.push(format!("broken link: {target}"));
        }
    }
    found
}
