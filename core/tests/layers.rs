//! The crate's layers, enforced: each module may name (`crate::…`, in code, tests included) only
//! the layers its own layer is allowed to import. A forbidden edge fails this test with the file,
//! line and the rule it breaks. The rules are docs/architecture.md's; change both together.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

/// (layer, the layers it may import besides itself). Order is bottom-up, for the report only.
const RULES: &[(&str, &[&str])] = &[
    ("sys", &[]),
    ("http", &[]),
    ("openai", &["http", "sys"]),
    ("config", &["http", "openai", "sys"]),
    ("limits", &["config", "http", "openai", "sys"]),
    ("upstream", &["config", "http", "openai", "sys"]),
    ("telemetry", &["config", "http", "openai", "sys"]),
    (
        "gateway",
        &[
            "config",
            "http",
            "openai",
            "sys",
            "limits",
            "upstream",
            "telemetry",
        ],
    ),
    (
        "runtime",
        &[
            "config",
            "http",
            "openai",
            "sys",
            "limits",
            "upstream",
            "telemetry",
            "gateway",
        ],
    ),
    // The fuzz targets' bodies: the parsers of untrusted input, below the gateway.
    ("fuzzing", &["config", "http", "openai", "sys"]),
];

/// Which layer a file under `core/src` belongs to: its first path component (`lib.rs` and
/// `main.rs` are the crate's roots and belong to none).
fn layer_of(relative: &Path) -> Option<String> {
    let first = relative.components().next()?.as_os_str().to_str()?;
    let name = first.strip_suffix(".rs").unwrap_or(first);
    (name != "lib" && name != "main").then(|| name.to_string())
}

/// Every `crate::NAME` in the code of `text` (comments skipped), with its 1-based line.
fn crate_paths(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let code = match line.find("//") {
            Some(at) => &line[..at],
            None => line,
        };
        let mut rest = code;
        while let Some(at) = rest.find("crate::") {
            let preceded_by_ident = rest[..at]
                .chars()
                .next_back()
                .is_some_and(|c| c.is_alphanumeric() || c == '_');
            rest = &rest[at + "crate::".len()..];
            if preceded_by_ident {
                continue; // e.g. `sluice_crate::`, not ours
            }
            // `crate::{a, b::c}` names several.
            if let Some(group) = rest.strip_prefix('{') {
                let end = group.find('}').unwrap_or(group.len());
                for part in group[..end].split(',') {
                    let name: String = part
                        .trim()
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    if !name.is_empty() {
                        out.push((i + 1, name));
                    }
                }
                continue;
            }
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                out.push((i + 1, name));
            }
        }
    }
    out
}

/// Every forbidden edge in the sources `files` ((path relative to core/src, text)).
fn violations(files: &[(PathBuf, String)]) -> Vec<String> {
    let mut found = Vec::new();
    for (path, text) in files {
        let Some(layer) = layer_of(path) else {
            continue;
        };
        let Some((_, allowed)) = RULES.iter().find(|(l, _)| *l == layer) else {
            found.push(format!(
                "{}: in no layer; add `{layer}` to the rules (and docs/architecture.md)",
                path.display()
            ));
            continue;
        };
        for (line, target) in crate_paths(text) {
            if target == layer || allowed.contains(&target.as_str()) {
                continue;
            }
            found.push(format!(
                "{}:{line}: `{layer}` may not import `{target}` (allowed: {allowed:?})",
                path.display()
            ));
        }
    }
    found
}

fn sources(dir: &Path, root: &Path, out: &mut Vec<(PathBuf, String)>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, root, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&path).unwrap();
            out.push((path.strip_prefix(root).unwrap().to_path_buf(), text));
        }
    }
}

#[test]
fn no_module_imports_a_layer_above_its_own() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&root, &root, &mut files);
    assert!(files.len() > 30, "only {} source files found", files.len());
    let found = violations(&files);
    assert!(
        found.is_empty(),
        "{} forbidden import(s):\n{}",
        found.len(),
        found.join("\n")
    );
}

/// The checker itself: a forbidden edge added anywhere is caught, in code and in `use` groups,
/// and comments or allowed edges are not.
#[test]
fn a_forbidden_import_is_caught() {
    let file = |path: &str, text: &str| (PathBuf::from(path), text.to_string());
    let found = violations(&[
        file(
            "http/request.rs",
            "use crate::gateway::error::GatewayError;\n// crate::runtime in a comment\n",
        ),
        file(
            "openai/inspect.rs",
            "use crate::{http, config::Snapshot};\n",
        ),
        file(
            "limits/shard.rs",
            "fn f() { crate::telemetry::metrics::x(); }\n",
        ),
        file(
            "gateway/relay.rs",
            "use crate::{http, upstream, runtime::conn};\n",
        ),
        file("config/mod.rs", "use crate::openai::inspect;\n"),
        file("lib.rs", "use crate::runtime;\n"),
    ]);
    let expect = [
        "http/request.rs:1: `http` may not import `gateway`",
        "openai/inspect.rs:1: `openai` may not import `config`",
        "limits/shard.rs:1: `limits` may not import `telemetry`",
        "gateway/relay.rs:1: `gateway` may not import `runtime`",
    ];
    assert_eq!(found.len(), expect.len(), "{found:#?}");
    for (got, want) in found.iter().zip(expect) {
        assert!(got.starts_with(want), "{got} (expected {want})");
    }
    let unknown = violations(&[file("newlayer/x.rs", "")]);
    assert_eq!(unknown.len(), 1, "a module outside every layer is reported");
}
