//! No function on the request path is longer than [`MAX_LINES`] lines, from `fn` to its closing
//! brace. The request path is every layer a worker runs per request (everything under
//! `core/src` but the config reader, the process's start-up and the fuzz harness); unit-test
//! modules (`#[cfg(test)] mod …`) and test helpers are left out. A longer function fails this
//! test with its file, line and length; split it into steps that each read at once
//! (docs/architecture.md, "Functions and their length").
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

/// The longest a request-path function may be.
const MAX_LINES: usize = 100;

/// Files and folders under `core/src` off the request path: read at start-up or reload, on the
/// control thread, or only by tests and the fuzz targets.
const OFF_PATH: &[&str] = &[
    "config",
    "main.rs",
    "fuzzing.rs",
    "http/testing.rs",
    "runtime/server.rs",
    "runtime/control.rs",
];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `text` with comments, string, byte-string and char literals blanked (newlines kept), so
/// braces and `fn` are found only in code.
fn code_only(text: &str) -> Vec<u8> {
    let s = text.as_bytes();
    let mut out = s.to_vec();
    let blank = |out: &mut Vec<u8>, from: usize, to: usize| {
        for b in &mut out[from..to.min(s.len())] {
            if *b != b'\n' {
                *b = b' ';
            }
        }
    };
    let mut i = 0;
    while i < s.len() {
        let rest = &s[i..];
        if rest.starts_with(b"//") {
            let end = rest
                .iter()
                .position(|&b| b == b'\n')
                .map_or(s.len(), |p| i + p);
            blank(&mut out, i, end);
            i = end;
        } else if rest.starts_with(b"/*") {
            let (mut depth, mut j) = (0usize, i);
            while j < s.len() {
                if s[j..].starts_with(b"/*") {
                    depth += 1;
                    j += 2;
                } else if s[j..].starts_with(b"*/") {
                    depth -= 1;
                    j += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    j += 1;
                }
            }
            blank(&mut out, i, j);
            i = j;
        } else if let Some(end) = raw_string_end(s, i) {
            blank(&mut out, i, end);
            i = end;
        } else if s[i] == b'"' {
            let mut j = i + 1;
            while j < s.len() && s[j] != b'"' {
                j += if s[j] == b'\\' { 2 } else { 1 };
            }
            blank(&mut out, i, j + 1);
            i = j + 1;
        } else if s[i] == b'\'' {
            // A char literal ('x', '\n', '\u{1F600}', a multi-byte char) or a lifetime ('a).
            let close = if rest.get(1) == Some(&b'\\') {
                rest.iter().skip(2).position(|&b| b == b'\'').map(|p| p + 2)
            } else {
                let width = std::str::from_utf8(&rest[1..rest.len().min(5)])
                    .ok()
                    .or_else(|| std::str::from_utf8(&rest[1..2]).ok())
                    .and_then(|t| t.chars().next())
                    .map_or(1, char::len_utf8);
                (rest.get(1 + width) == Some(&b'\'')).then_some(1 + width)
            };
            match close {
                Some(c) => {
                    blank(&mut out, i, i + c + 1);
                    i += c + 1;
                }
                None => i += 1,
            }
        } else {
            i += 1;
        }
    }
    out
}

/// Where a raw string literal (`r"…"`, `r#"…"#`, `br#"…"#`) starting at `i` ends, if one does.
fn raw_string_end(s: &[u8], i: usize) -> Option<usize> {
    if i > 0 && (s[i - 1].is_ascii_alphanumeric() || s[i - 1] == b'_') {
        return None;
    }
    let mut j = i;
    if s.get(j) == Some(&b'b') {
        j += 1;
    }
    if s.get(j) != Some(&b'r') {
        return None;
    }
    j += 1;
    let hashes = s[j..].iter().take_while(|&&b| b == b'#').count();
    j += hashes;
    if s.get(j) != Some(&b'"') {
        return None;
    }
    let mut closing = vec![b'"'];
    closing.extend(std::iter::repeat_n(b'#', hashes));
    let from = j + 1;
    s[from..]
        .windows(closing.len())
        .position(|w| w == closing.as_slice())
        .map(|p| from + p + closing.len())
}

/// The index of the brace that closes the one at `open`.
fn matching_brace(code: &[u8], open: usize) -> usize {
    let mut depth = 0usize;
    for (k, &b) in code.iter().enumerate().skip(open) {
        match b {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return k;
                }
            }
            _ => {}
        }
    }
    code.len()
}

fn is_word(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// Every function with a body in `code`, outside `#[cfg(test)]` modules: (its name, the line of
/// its `fn`, its length in lines).
fn functions(code: &[u8]) -> Vec<(String, usize, usize)> {
    let line_of = |at: usize| code[..at].iter().filter(|&&b| b == b'\n').count() + 1;
    let mut found = Vec::new();
    let mut i = 0;
    while i + 2 < code.len() {
        if code[i..].starts_with(b"#[cfg(test)]") {
            // Skip the test module (or item) it marks, to its closing brace or semicolon.
            let next = code[i..]
                .iter()
                .position(|&b| b == b'{' || b == b';')
                .map_or(code.len(), |p| i + p);
            i = if code.get(next) == Some(&b'{') {
                matching_brace(code, next) + 1
            } else {
                next + 1
            };
            continue;
        }
        let starts_fn = code[i..].starts_with(b"fn ")
            && (i == 0 || !is_word(code[i - 1]))
            && code.get(i + 3).is_some_and(|&b| is_word(b));
        if !starts_fn {
            i += 1;
            continue;
        }
        let name_end = (i + 3..code.len())
            .find(|&k| !is_word(code[k]))
            .unwrap_or(code.len());
        let name = String::from_utf8_lossy(&code[i + 3..name_end]).into_owned();
        // The body's brace: the first `{` (or `;`, for a declaration) outside the signature's
        // parentheses.
        let mut parens = 0i32;
        let mut k = name_end;
        while k < code.len() {
            match code[k] {
                b'(' => parens += 1,
                b')' => parens -= 1,
                b'{' | b';' if parens == 0 => break,
                _ => {}
            }
            k += 1;
        }
        if code.get(k) == Some(&b'{') {
            let close = matching_brace(code, k);
            found.push((name, line_of(i), line_of(close) - line_of(i) + 1));
        }
        i = name_end;
    }
    found
}

fn on_request_path(relative: &Path, test_only: &[PathBuf]) -> bool {
    !OFF_PATH.iter().any(|off| relative.starts_with(off))
        && !test_only.iter().any(|t| relative.starts_with(t))
}

/// The files of modules declared `#[cfg(test)] mod NAME;` in `relative` (code in `code`): the
/// module's file or folder, relative to `core/src`.
fn test_only_modules(relative: &Path, code: &[u8]) -> Vec<PathBuf> {
    let text = String::from_utf8_lossy(code);
    let stem = relative.file_stem().and_then(|s| s.to_str()).unwrap_or("");
    let parent = relative.parent().unwrap_or(Path::new(""));
    let dir = if matches!(stem, "lib" | "main" | "mod") {
        parent.to_path_buf()
    } else {
        parent.join(stem)
    };
    let mut found = Vec::new();
    let mut rest = text.as_ref();
    while let Some(at) = rest.find("#[cfg(test)]") {
        rest = rest[at + "#[cfg(test)]".len()..].trim_start();
        let Some(decl) = rest.strip_prefix("mod ") else {
            continue;
        };
        let name: String = decl
            .chars()
            .take_while(|&c| c.is_alphanumeric() || c == '_')
            .collect();
        if decl[name.len()..].trim_start().starts_with(';') {
            found.push(dir.join(format!("{name}.rs")));
            found.push(dir.join(&name));
        }
    }
    found
}

#[test]
fn no_request_path_function_is_longer_than_the_limit() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    files.sort();
    let code: Vec<(&Path, Vec<u8>)> = files
        .iter()
        .map(|f| {
            let text = std::fs::read_to_string(f).unwrap();
            (f.strip_prefix(&root).unwrap(), code_only(&text))
        })
        .collect();
    let test_only: Vec<PathBuf> = code
        .iter()
        .flat_map(|(relative, code)| test_only_modules(relative, code))
        .collect();
    let mut lengths = Vec::new();
    for (relative, code) in &code {
        if !on_request_path(relative, &test_only) {
            continue;
        }
        for (name, line, len) in functions(code) {
            lengths.push((len, format!("{}:{line} fn {name}", relative.display())));
        }
    }
    lengths.sort_by_key(|(len, _)| std::cmp::Reverse(*len));
    // The longest five, for docs/architecture.md (`--nocapture` shows them).
    for (len, at) in lengths.iter().take(5) {
        eprintln!("{len:4} lines  {at}");
    }
    let too_long: Vec<String> = lengths
        .iter()
        .filter(|(len, _)| *len > MAX_LINES)
        .map(|(len, at)| format!("{at}: {len} lines"))
        .collect();
    assert!(
        too_long.is_empty(),
        "request-path functions over {MAX_LINES} lines (split them):\n{}",
        too_long.join("\n")
    );
}

/// The reader this test stands on finds what it must and nothing else.
#[test]
fn the_reader_finds_functions_and_skips_literals_comments_and_tests() {
    let text = concat!(
        "fn a() {\n",
        "    let s = \"fn fake() { {\";\n",
        "    let c = '{'; let r = r#\"}\"#; // fn nope() {\n",
        "    /* { /* nested */ } */\n",
        "}\n",
        "fn b<'x>(f: impl FnMut(&'x [u8]) -> bool) -> u8 where u8: Copy {\n",
        "    0\n",
        "}\n",
        "trait T { fn decl(&self); }\n",
        "#[cfg(test)]\n",
        "mod tests {\n",
        "    fn in_tests() {}\n",
        "}\n",
    );
    let found = functions(&code_only(text));
    let want = [("a".to_string(), 1, 5), ("b".to_string(), 6, 3)];
    assert_eq!(found, want);
}
