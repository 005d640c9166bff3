//! The crate's map stays whole: every Cargo feature and every top-level module is
//! named in `src/lib.rs`'s crate docs, every module in docs/ARCHITECTURE.md's module
//! table, and every feature in the README's feature table. A module or feature added
//! without its line fails here, so the map the next reader starts from cannot drift.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::path::Path;

fn read(path: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(path)).unwrap()
}

/// The keys of `[features]` in the manifest, `default` aside.
fn features() -> Vec<String> {
    let manifest: toml::Table = read("Cargo.toml").parse().unwrap();
    let features = manifest["features"].as_table().unwrap();
    let names: Vec<String> = features
        .keys()
        .filter(|k| *k != "default")
        .cloned()
        .collect();
    assert!(names.len() >= 6, "features read: {names:?}");
    names
}

/// The modules `src/lib.rs` declares: (name, public).
fn modules() -> Vec<(String, bool)> {
    let lib = read("src/lib.rs");
    let mods: Vec<(String, bool)> = lib
        .lines()
        .filter_map(|line| {
            let line = line.trim();
            let (public, rest) = match line.strip_prefix("pub mod ") {
                Some(rest) => (true, rest),
                None => (false, line.strip_prefix("mod ")?),
            };
            Some((rest.strip_suffix(';')?.to_owned(), public))
        })
        .collect();
    assert!(mods.len() >= 15, "modules read: {mods:?}");
    mods
}

/// The text of the crate docs' section `## title`, up to the next heading.
fn crate_doc_section(title: &str) -> String {
    let docs: String = read("src/lib.rs")
        .lines()
        .filter_map(|l| l.strip_prefix("//!"))
        .map(|l| format!("{}\n", l.strip_prefix(' ').unwrap_or(l)))
        .collect();
    let start = docs
        .find(&format!("## {title}\n"))
        .unwrap_or_else(|| panic!("src/lib.rs has no section `## {title}`"));
    let body = &docs[start + title.len() + 4..];
    body[..body.find("\n## ").unwrap_or(body.len())].to_owned()
}

#[test]
fn every_feature_is_in_the_crate_docs_and_the_readme() {
    let listed = crate_doc_section("Features");
    let readme = read("README.md");
    let missing: Vec<String> = features()
        .into_iter()
        .filter(|f| {
            !listed.contains(&format!("- `{f}`:")) || !readme.contains(&format!("| `{f}` |"))
        })
        .collect();
    assert!(
        missing.is_empty(),
        "features missing from src/lib.rs's `## Features` list (`- `name`: …`) or the \
         README's feature table (`| `name` |`): {missing:?}"
    );
}

#[test]
fn every_public_module_is_in_the_crate_docs_map() {
    let map = crate_doc_section("What is here");
    let missing: Vec<String> = modules()
        .into_iter()
        .filter(|(m, public)| *public && !map.contains(&format!("`{m}`")))
        .map(|(m, _)| m)
        .collect();
    assert!(
        missing.is_empty(),
        "public modules missing from src/lib.rs's `## What is here`: {missing:?}"
    );
}

#[test]
fn every_module_is_in_the_architecture_table() {
    let architecture = read("docs/ARCHITECTURE.md");
    // The first column of the module table: `| `a`, `b` (…) | job | uses |`.
    let firsts: Vec<&str> = architecture
        .lines()
        .filter(|l| l.starts_with("| `"))
        .filter_map(|l| l.split(" | ").next())
        .collect();
    let missing: Vec<String> = modules()
        .into_iter()
        .filter(|(m, _)| !firsts.iter().any(|f| f.contains(&format!("`{m}`"))))
        .map(|(m, _)| m)
        .collect();
    assert!(
        missing.is_empty(),
        "modules missing from docs/ARCHITECTURE.md's module table: {missing:?}"
    );
}
