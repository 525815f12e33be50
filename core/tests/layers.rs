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
    // What the `sluice` command needs beyond loading and running: nothing of a worker's.
    ("cli", &[]),
];

/// Which layer a file under `core/src` belongs to: its first path component (`lib.rs` and
/// `main.rs` are the crate's roots and belong to none).
fn layer_of(relative: &Path) -> Option<String> {
    let first = relative.components().next()?.as_os_str().to_str()?;
    let name = first.strip_suffix(".rs").unwrap_or(first);
    (name != "lib" && name != "main").then(|| name.to_string())
}

/// Every `crate::NAME` in the code of `text` (comments skipped, unit tests included), with its
/// 1-based line: the first segment of each path [`named_modules`] finds.
fn crate_paths(text: &str) -> Vec<(usize, String)> {
    let lines: Vec<(usize, &str)> = text.lines().enumerate().map(|(i, l)| (i + 1, l)).collect();
    named_modules(&[], &lines)
        .into_iter()
        .filter_map(|(line, mut path)| (!path.is_empty()).then(|| (line, path.swap_remove(0))))
        .collect()
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

/// A module's path inside the crate from its file's path under `core/src`
/// (`gateway/relay/strip.rs` → `gateway::relay::strip`; a `mod.rs` is its folder's module).
fn module_of(relative: &Path) -> Vec<String> {
    let mut parts: Vec<String> = relative
        .with_extension("")
        .components()
        .filter_map(|c| c.as_os_str().to_str().map(str::to_string))
        .collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    parts
}

/// `text` without its unit-test modules (`#[cfg(test)]` then `mod … {` at the start of a line,
/// to the `}` that closes it at the start of a line): a test may drive its module through a
/// sibling above it without that being a ring of the build's code.
fn without_test_modules(text: &str) -> Vec<(usize, &str)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        if lines[i].starts_with("#[cfg(test)]") {
            let mut j = i + 1;
            while j < lines.len() && (lines[j].starts_with("#[") || lines[j].starts_with("//")) {
                j += 1;
            }
            if j < lines.len() && lines[j].starts_with("mod ") && lines[j].ends_with('{') {
                while j < lines.len() && lines[j] != "}" {
                    j += 1;
                }
                i = j + 1;
                continue;
            }
        }
        out.push((i + 1, lines[i]));
        i += 1;
    }
    out
}

/// The module paths the code `lines` ((1-based line, text)) name (`crate::a::b`, `super::c`
/// resolved from `module`; `{…}` groups expanded one level; comments skipped), each with its
/// line.
fn named_modules(module: &[String], lines: &[(usize, &str)]) -> Vec<(usize, Vec<String>)> {
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    let mut out = Vec::new();
    for &(line_no, line) in lines {
        let code = line.find("//").map_or(line, |at| &line[..at]);
        for (prefix, base) in [("crate::", 0), ("super::", 1)] {
            let mut rest = code;
            while let Some(at) = rest.find(prefix) {
                let preceded = rest[..at]
                    .chars()
                    .next_back()
                    .is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':');
                rest = &rest[at + prefix.len()..];
                if preceded || base > module.len() {
                    continue;
                }
                let mut path: Vec<String> = module[..module.len() - base].to_vec();
                if base == 0 {
                    path.clear();
                }
                let mut tail = rest;
                loop {
                    let name = ident(tail);
                    if name.is_empty() {
                        break;
                    }
                    tail = &tail[name.len()..];
                    path.push(name);
                    match tail.strip_prefix("::") {
                        Some(more) => tail = more,
                        None => break,
                    }
                }
                if let Some(group) = tail.strip_prefix('{') {
                    let end = group.find('}').unwrap_or(group.len());
                    for part in group[..end].split(',') {
                        let mut member = path.clone();
                        member.extend(
                            part.trim()
                                .split("::")
                                .map(ident)
                                .take_while(|n| !n.is_empty()),
                        );
                        out.push((line_no, member));
                    }
                } else if !path.is_empty() {
                    out.push((line_no, path));
                }
            }
        }
    }
    out
}

/// Every ring between sibling modules (files or folders of one folder): for each, its folder,
/// its members and one `file:line` per edge.
fn rings(files: &[(PathBuf, String)]) -> Vec<String> {
    use std::collections::{BTreeMap, BTreeSet};
    // The sibling modules of each folder, from the files present.
    let modules: BTreeSet<Vec<String>> = files.iter().map(|(p, _)| module_of(p)).collect();
    let is_module = |path: &[String]| {
        modules
            .iter()
            .any(|m| m.len() >= path.len() && m[..path.len()] == *path)
    };
    // folder → from → to → where.
    type Edges = BTreeMap<String, BTreeMap<String, String>>;
    let mut graph: BTreeMap<Vec<String>, Edges> = BTreeMap::new();
    for (path, text) in files {
        let from = module_of(path);
        for (line, to) in named_modules(&from, &without_test_modules(text)) {
            let shared = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
            if shared == 0 || shared >= from.len() || shared >= to.len() {
                continue; // another layer (the layer rules' business), itself, or its parent
            }
            if !is_module(&to[..=shared]) {
                continue; // an item of the folder's own module, not a sibling
            }
            graph
                .entry(from[..shared].to_vec())
                .or_default()
                .entry(from[shared].clone())
                .or_default()
                .entry(to[shared].clone())
                .or_insert_with(|| format!("{}:{line}", path.display()));
        }
    }
    let mut found = Vec::new();
    for (folder, edges) in &graph {
        for ring in strongly_connected(edges) {
            let mut report = format!("ring in {}: {}", folder.join("/"), ring.join(", "));
            for from in &ring {
                for (to, at) in &edges[from] {
                    if ring.contains(to) {
                        report.push_str(&format!("\n    {from} -> {to} ({at})"));
                    }
                }
            }
            found.push(report);
        }
    }
    found
}

/// The strongly connected components of more than one node (Tarjan), each sorted.
fn strongly_connected(
    edges: &std::collections::BTreeMap<String, std::collections::BTreeMap<String, String>>,
) -> Vec<Vec<String>> {
    struct State<'a> {
        edges: &'a std::collections::BTreeMap<String, std::collections::BTreeMap<String, String>>,
        index: std::collections::HashMap<&'a str, (usize, usize)>,
        stack: Vec<&'a str>,
        next: usize,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a str) {
        s.index.insert(v, (s.next, s.next));
        s.next += 1;
        s.stack.push(v);
        let targets: Vec<&'a str> = s
            .edges
            .get(v)
            .map(|t| t.keys().map(String::as_str).collect())
            .unwrap_or_default();
        for w in targets {
            if !s.index.contains_key(w) {
                visit(s, w);
                let low = s.index[w].1.min(s.index[v].1);
                s.index.get_mut(v).unwrap().1 = low;
            } else if s.stack.contains(&w) {
                let low = s.index[w].0.min(s.index[v].1);
                s.index.get_mut(v).unwrap().1 = low;
            }
        }
        if s.index[v].0 == s.index[v].1 {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                component.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                s.out.push(component);
            }
        }
    }
    let mut state = State {
        edges,
        index: std::collections::HashMap::new(),
        stack: Vec::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in edges.keys() {
        if !state.index.contains_key(v.as_str()) {
            visit(&mut state, v);
        }
    }
    state.out
}

#[test]
fn no_files_of_one_folder_import_each_other_in_a_ring() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&root, &root, &mut files);
    let found = rings(&files);
    assert!(
        found.is_empty(),
        "{} import ring(s) inside a folder:\n{}",
        found.len(),
        found.join("\n")
    );
}

/// The ring checker itself: a two-file ring (by `crate::` or `super::`), a three-file ring and
/// one through a sub-folder are caught; a chain, a child naming its parent's items and test
/// modules are not.
#[test]
fn a_ring_inside_a_folder_is_caught() {
    let file = |path: &str, text: &str| (PathBuf::from(path), text.to_string());
    let found = rings(&[
        file("gateway/a.rs", "use crate::gateway::b::X;\n"),
        file("gateway/b.rs", "use crate::gateway::{c, a::Y};\n"),
        file("gateway/c.rs", "fn f() { crate::gateway::d::z(); }\n"),
        file("gateway/d.rs", "use crate::config::Snapshot;\n"),
        file("sys/clock.rs", "use super::deadlines::Wait;\n"),
        file("sys/deadlines.rs", "use super::clock::Mono;\n"),
        file("sys/time.rs", "use super::clock::Mono;\n"),
        file("http/mod.rs", "pub(crate) struct Name;\n"),
        file(
            "http/lines.rs",
            "use super::Name;\nuse crate::http::request::R;\n",
        ),
        file(
            "http/request.rs",
            "#[cfg(test)]\nmod tests {\n    use crate::http::lines::L;\n}\n",
        ),
        file("runtime/conn.rs", "use crate::runtime::worker::W;\n"),
        file("runtime/worker/mod.rs", "use crate::runtime::conn::C;\n"),
        file("runtime/worker/state.rs", ""),
    ]);
    assert_eq!(found.len(), 3, "{found:#?}");
    assert!(
        found[0].starts_with("ring in gateway: a, b\n"),
        "{}",
        found[0]
    );
    assert!(found[0].contains("a -> b (gateway/a.rs:1)"), "{}", found[0]);
    assert!(
        found[1].starts_with("ring in runtime: conn, worker"),
        "{}",
        found[1]
    );
    assert!(
        found[2].starts_with("ring in sys: clock, deadlines\n"),
        "{}",
        found[2]
    );
}
