//! Every relative link of the README and the book resolves, to a file that exists and, when
//! it names one, to a `#anchor` that a heading of that file produces (mdBook's own build does
//! not check anchors). Every `{{#include}}` names a file that exists, and every page of the
//! book is in its SUMMARY.

mod support;

use std::collections::{BTreeSet, HashMap};
use std::path::{Component, Path, PathBuf};

use support::docs::{book_pages, read, root};

/// Text outside fenced code blocks and inline code spans.
fn prose(text: &str) -> String {
    let mut out = String::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            let mut in_code = false;
            for part in line.split('`') {
                if !in_code {
                    out.push_str(part);
                }
                in_code = !in_code;
            }
            out.push('\n');
        }
    }
    out
}

/// The anchor mdBook (and GitHub) give a heading: lower case, spaces to `-`, only
/// alphanumerics, `-` and `_` kept; a repeated one gets `-1`, `-2`, ….
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut out = BTreeSet::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        let Some(title) = line.strip_prefix('#').filter(|_| !fenced) else {
            continue;
        };
        let title = title.trim_start_matches('#').trim();
        let id: String = title
            .chars()
            .filter_map(|c| {
                if c.is_whitespace() {
                    Some('-')
                } else if c.is_alphanumeric() || c == '-' || c == '_' {
                    Some(c.to_lowercase().next().unwrap())
                } else {
                    None
                }
            })
            .collect();
        let n = seen.entry(id.clone()).or_default();
        out.insert(if *n == 0 {
            id.clone()
        } else {
            format!("{id}-{n}")
        });
        *n += 1;
    }
    out
}

/// Targets of `[text](target)` links in prose.
fn links(text: &str) -> Vec<String> {
    let prose = prose(text);
    let mut out = Vec::new();
    let mut rest = prose.as_str();
    while let Some(i) = rest.find("](") {
        rest = &rest[i + 2..];
        if let Some(end) = rest.find(')') {
            out.push(rest[..end].trim().to_string());
        }
    }
    out
}

fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            c => out.push(c),
        }
    }
    out
}

fn pages() -> Vec<(PathBuf, String)> {
    let mut pages = vec![
        (PathBuf::from("README.md"), read("README.md")),
        (PathBuf::from("CHANGELOG.md"), read("CHANGELOG.md")),
    ];
    pages.extend(book_pages());
    pages
}

#[test]
fn every_relative_link_and_anchor_resolves() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for (page, text) in pages() {
        let dir = page.parent().unwrap_or(Path::new(""));
        for target in links(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (file, anchor) = match target.split_once('#') {
                Some((f, a)) => (f, Some(a)),
                None => (target.as_str(), None),
            };
            let resolved = if file.is_empty() {
                page.clone()
            } else {
                normalize(&dir.join(file))
            };
            checked += 1;
            let full = root().join(&resolved);
            if !full.exists() {
                broken.push(format!(
                    "{}: {target} (no {})",
                    page.display(),
                    resolved.display()
                ));
                continue;
            }
            if let Some(anchor) = anchor {
                let text = std::fs::read_to_string(&full).unwrap_or_default();
                if !anchors(&text).contains(anchor) {
                    broken.push(format!(
                        "{}: {target} (no heading gives #{anchor})",
                        page.display()
                    ));
                }
            }
        }
    }
    assert!(checked >= 50, "only {checked} links checked");
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn every_include_names_a_file_that_exists() {
    let mut missing = Vec::new();
    for (page, text) in book_pages() {
        let dir = page.parent().unwrap();
        for part in text.split("{{#include ").skip(1) {
            let target = part
                .split("}}")
                .next()
                .unwrap()
                .split(':')
                .next()
                .unwrap()
                .trim();
            if !root().join(normalize(&dir.join(target))).is_file() {
                missing.push(format!("{}: {target}", page.display()));
            }
        }
    }
    assert!(missing.is_empty(), "includes of missing files: {missing:?}");
}

#[test]
fn every_book_page_is_in_the_summary_with_its_title_as_h1() {
    let summary = read("docs/src/SUMMARY.md");
    let mut problems = Vec::new();
    let mut listed = BTreeSet::new();
    for line in summary.lines() {
        let Some((title, rest)) = line.split_once("](") else {
            continue;
        };
        let title = title.rsplit('[').next().unwrap();
        let file = rest.trim_end_matches(')');
        listed.insert(format!("docs/src/{file}"));
        let page = read(&format!("docs/src/{file}"));
        let h1 = page.lines().find(|l| l.starts_with("# ")).unwrap_or("");
        if h1 != format!("# {title}") {
            problems.push(format!(
                "docs/src/{file}: H1 {h1:?}, SUMMARY says {title:?}"
            ));
        }
        let h1s = prose(&page).lines().filter(|l| l.starts_with("# ")).count();
        if h1s != 1 {
            problems.push(format!("docs/src/{file}: {h1s} H1 headings"));
        }
    }
    for (page, _) in book_pages() {
        let page = page.display().to_string();
        if !page.ends_with("SUMMARY.md") && !listed.contains(&page) {
            problems.push(format!("{page} is not in SUMMARY.md"));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
