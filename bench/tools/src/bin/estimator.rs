//! The prompt-token estimator's calibration, from the corpora in `bench/corpus/`: the figures of
//! perf/RESULTS.md, "Prompt-token estimator".
//!
//!   cargo run --release -p sluice-perf --bin estimator -- fit      # the weights, refitted
//!   cargo run --release -p sluice-perf --bin estimator -- report   # error and speed tables
//!
//! `fit` reproduces the weights in `core/src/openai/tokens.rs` (module `weights`); `report`
//! prints the held-out error against tiktoken, whole chat bodies against what the upstream
//! bills, and the speed of both counts. Each corpus is cut in half at a char boundary: weights
//! are fitted on the first halves, errors reported on the second, as the unit test
//! `estimate_tracks_tiktoken_on_held_out_halves` checks them.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use sluice::tokens::{
    class_of, class_weight, count_tokens, estimate_tokens, warm_up, Class, Encoding,
};

/// The corpora, in the order (and with the halves) of the unit tests in `tokens.rs`: four ASCII
/// ones (English, Rust, Python, a chat body), then Chinese and mixed scripts.
const CORPORA: [(&str, &str); 6] = [
    ("english", include_str!("../../../corpus/english.txt")),
    ("rust", include_str!("../../../corpus/rust.txt")),
    ("python", include_str!("../../../corpus/python.txt")),
    (
        "chat-json",
        include_str!("../../../corpus/chat-request.json"),
    ),
    ("chinese", include_str!("../../../corpus/chinese.txt")),
    ("mixed", include_str!("../../../corpus/mixed.txt")),
];

fn main() {
    match std::env::args().nth(1).as_deref() {
        Some("fit") => fit_weights(),
        Some("report") => report(),
        _ => {
            eprintln!("usage: estimator <fit|report>");
            std::process::exit(2);
        }
    }
}

/// The first half (fitted on) and second half (held out) of a corpus, cut at a char boundary.
fn halves(text: &str) -> (&str, &str) {
    let mut mid = text.len() / 2;
    while !text.is_char_boundary(mid) {
        mid += 1;
    }
    text.split_at(mid)
}

fn error_pct(estimate: u64, exact: usize) -> f64 {
    100.0 * (estimate as f64 / exact as f64 - 1.0)
}

/// Class counts of `bytes`, indexed by `Class as usize`.
fn class_counts(bytes: &[u8]) -> [f64; 10] {
    let mut counts = [0.0; 10];
    for &b in bytes {
        counts[class_of(b) as usize] += 1.0;
    }
    counts
}

/// `text` in pieces of about `len` bytes, cut at char boundaries.
fn chunks(text: &str, len: usize) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let mut end = len.min(rest.len());
        while !rest.is_char_boundary(end) {
            end += 1;
        }
        let (piece, tail) = rest.split_at(end);
        out.push(piece);
        rest = tail;
    }
    out
}

/// Least squares: the `w` minimising |A w - b|, by the normal equations (a handful of
/// unknowns, well conditioned).
fn least_squares(rows: &[Vec<f64>], rhs: &[f64]) -> Vec<f64> {
    let n = rows[0].len();
    let mut m = vec![vec![0.0; n + 1]; n];
    for (row, &y) in rows.iter().zip(rhs) {
        for i in 0..n {
            for j in 0..n {
                m[i][j] += row[i] * row[j];
            }
            m[i][n] += row[i] * y;
        }
    }
    for col in 0..n {
        let pivot = (col..n)
            .max_by(|&a, &b| m[a][col].abs().total_cmp(&m[b][col].abs()))
            .unwrap();
        m.swap(col, pivot);
        let pivot_row = m[col].clone();
        for (r, row) in m.iter_mut().enumerate() {
            if r != col {
                let f = row[col] / pivot_row[col];
                for (x, p) in row.iter_mut().zip(&pivot_row).skip(col) {
                    *x -= f * p;
                }
            }
        }
    }
    (0..n).map(|i| m[i][n] / m[i][i]).collect()
}

/// Reproduces the weights from the corpora: prints them in 1/1024 of a token.
fn fit_weights() {
    const CHUNK: usize = 384;
    let ascii = [
        Class::Letter,
        Class::Digit,
        Class::Punct,
        Class::Space,
        Class::Newline,
    ];
    let leads = [Class::Lead2, Class::Lead3];
    let lead4 = f64::from(class_weight(Class::Lead4)) / 1024.0;
    let both = |text: &str| {
        let (cl, o2) = (
            count_tokens(Encoding::Cl100k, text),
            count_tokens(Encoding::O200k, text),
        );
        (cl as f64, o2 as f64)
    };

    // 1. ASCII classes on English, code and JSON, against the mean of the encodings; each
    //    row divided by its target so the fit minimises relative error.
    let (mut rows, mut rhs) = (Vec::new(), Vec::new());
    for (_, text) in &CORPORA[..4] {
        for piece in chunks(halves(text).0, CHUNK) {
            let (cl, o2) = both(piece);
            let target = (cl + o2) / 2.0;
            let counts = class_counts(piece.as_bytes());
            rows.push(ascii.iter().map(|&c| counts[c as usize] / target).collect());
            rhs.push(1.0);
        }
    }
    let mut w_ascii = least_squares(&rows, &rhs);

    // 2. Scale up until no fitted half is under-estimated against either encoding.
    let ascii_estimate = |w: &[f64], counts: &[f64; 10]| -> f64 {
        ascii
            .iter()
            .zip(w)
            .map(|(&c, w)| counts[c as usize] * w)
            .sum()
    };
    let scale = CORPORA[..4]
        .iter()
        .map(|(_, text)| {
            let fit = halves(text).0;
            let (cl, o2) = both(fit);
            cl.max(o2) / ascii_estimate(&w_ascii, &class_counts(fit.as_bytes()))
        })
        .fold(1.0, f64::max);
    w_ascii.iter_mut().for_each(|w| *w *= scale);

    // 3. Lead bytes on Chinese and mixed scripts, against the geometric mean of the
    //    encodings, with the ASCII weights and the hand-set 4-byte weight held fixed.
    let (mut rows, mut rhs) = (Vec::new(), Vec::new());
    for (_, text) in &CORPORA[4..] {
        for piece in chunks(halves(text).0, CHUNK) {
            let (cl, o2) = both(piece);
            let target = (cl * o2).sqrt();
            let counts = class_counts(piece.as_bytes());
            let fixed = ascii_estimate(&w_ascii, &counts) + counts[Class::Lead4 as usize] * lead4;
            rows.push(leads.iter().map(|&c| counts[c as usize] / target).collect());
            rhs.push((target - fixed) / target);
        }
    }
    let w_leads = least_squares(&rows, &rhs);

    println!("ASCII scale-up {scale:.3}");
    for (class, w) in ascii.iter().zip(&w_ascii).chain(leads.iter().zip(&w_leads)) {
        let units = (w * 1024.0).round();
        println!("{class:?}: {w:.4} tokens = {units} / 1024");
    }
}

/// `text` with every non-ASCII character written as a JSON `\uXXXX` escape, as JSON
/// encoders that default to ASCII output (Python's `json.dumps`) send it.
fn ascii_escaped(text: &str) -> String {
    let mut out = String::with_capacity(text.len() * 2);
    for ch in text.chars() {
        if ch.is_ascii() {
            out.push(ch);
        } else {
            let mut units = [0u16; 2];
            for unit in ch.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{unit:04x}"));
            }
        }
    }
    out
}

/// What OpenAI bills as prompt tokens for a chat body's messages: 3 per message, plus role
/// and content, plus 3 that prime the reply.
fn billed_prompt(encoding: Encoding, body: &str) -> usize {
    let value: serde_json::Value = serde_json::from_str(body).unwrap();
    let messages = value["messages"].as_array().unwrap();
    3 + messages
        .iter()
        .map(|m| {
            let role = m["role"].as_str().unwrap();
            let content = m["content"].as_str().unwrap();
            3 + count_tokens(encoding, role) + count_tokens(encoding, content)
        })
        .sum::<usize>()
}

fn best_of<F: FnMut()>(runs: usize, mut f: F) -> std::time::Duration {
    (0..runs)
        .map(|_| {
            let start = std::time::Instant::now();
            f();
            start.elapsed()
        })
        .min()
        .unwrap()
}

/// The calibration and speed tables in perf/RESULTS.md.
fn report() {
    let encodings = [Encoding::Cl100k, Encoding::O200k];
    for encoding in encodings {
        warm_up(encoding);
    }
    println!(
        "Held-out halves (the second half of each corpus; weights were fitted on the first):\n"
    );
    println!("| corpus | bytes | encoding | tiktoken | estimate | error | tiktoken µs/KB |");
    println!("| --- | ---: | --- | ---: | ---: | ---: | ---: |");
    for (name, text) in CORPORA {
        let (_, held_out) = halves(text);
        let estimate = estimate_tokens(held_out.as_bytes());
        for encoding in encodings {
            let exact = count_tokens(encoding, held_out);
            let time = best_of(5, || {
                std::hint::black_box(count_tokens(encoding, std::hint::black_box(held_out)));
            });
            let us_per_kb = time.as_secs_f64() * 1e6 / (held_out.len() as f64 / 1024.0);
            println!(
                "| {name} | {} | {} | {exact} | {estimate} | {:+.1}% | {us_per_kb:.1} |",
                held_out.len(),
                encoding.name(),
                error_pct(estimate, exact)
            );
        }
    }

    // The chat corpus as sent, and a body whose user turn is the Chinese corpus; each also
    // with non-ASCII escaped.
    let chat = CORPORA[3].1;
    let chinese_chat = serde_json::json!({
        "model": "gpt-4o",
        "messages": [
            {"role": "system", "content": "你是一个乐于助人的助手。"},
            {"role": "user", "content": CORPORA[4].1},
        ],
    })
    .to_string();
    println!("\nWhole chat bodies against what the upstream bills for their messages:\n");
    println!(
        "| body | bytes | encoding | tiktoken (body) | billed prompt | estimate | vs billed |"
    );
    println!("| --- | ---: | --- | ---: | ---: | ---: | ---: |");
    for (label, body, text) in [
        ("chat-request.json", chat, chat.to_string()),
        ("chat-request.json, \\uXXXX", chat, ascii_escaped(chat)),
        ("Chinese user turn", &chinese_chat, chinese_chat.clone()),
        (
            "Chinese user turn, \\uXXXX",
            &chinese_chat,
            ascii_escaped(&chinese_chat),
        ),
    ] {
        let estimate = estimate_tokens(text.as_bytes());
        for encoding in encodings {
            let billed = billed_prompt(encoding, body);
            println!(
                "| {label} | {} | {} | {} | {billed} | {estimate} | {:+.1}% |",
                text.len(),
                encoding.name(),
                count_tokens(encoding, &text),
                error_pct(estimate, billed)
            );
        }
    }

    // Speed over 64 KiB of all corpora, so every class is exercised.
    let mut buffer = Vec::with_capacity(64 * 1024);
    while buffer.len() < 64 * 1024 {
        for (_, text) in CORPORA {
            buffer.extend_from_slice(text.as_bytes());
        }
    }
    buffer.truncate(64 * 1024);
    const REPS: u32 = 200;
    let time = best_of(20, || {
        for _ in 0..REPS {
            std::hint::black_box(estimate_tokens(std::hint::black_box(&buffer)));
        }
    });
    let ns_per_kb = time.as_secs_f64() * 1e9 / f64::from(REPS) / 64.0;
    println!("\nestimate_tokens: {ns_per_kb:.0} ns/KB over a 64 KiB buffer (best of 20 × {REPS})");
}
