//! Configuration: the TOML file, parsed into raw serde types, validated once into a [`Snapshot`].
//!
//! Runs on the control thread at startup (and for `sluice check`), never on a worker's request
//! path. Takes the file's text; returns an immutable [`Snapshot`] that every worker holds as
//! `Rc<Snapshot>`, or every error found at once, each with the key path it concerns and that
//! key's line and column; warnings (valid but probably not meant) either way. Unknown keys are
//! errors. Backend host names are resolved here, once, so workers never make a blocking DNS call.
//!
//! The text is parsed once into a `toml_edit` document, which keeps spans; each section (each
//! entry of a map or array section) is deserialized on its own with `serde_path_to_error`, so one
//! bad section does not hide the others' errors, and every error's key path is looked up in the
//! document for its position.
//!
//! By job, one file each: [`raw`] (the serde types, what the file says), [`reader`] (the text
//! as a document with spans, sections read one by one, key paths and their positions),
//! [`resolve`] (validation: every raw section checked and turned into resolved types, with
//! [`resolve_clusters`] and [`resolve_routes`] for the two largest), [`snapshot`] (the resolved
//! types workers run on). This file is the entry point ([`load`], [`load_with_warnings`]) and the
//! error type; the other files are the sections with rules of their own (`limits`, `routing`,
//! `sticky`, `tls`, `dialect`, `redis_url`).

// The config loader resolves backend and listener names here, once, on the control thread.
#![allow(clippy::disallowed_methods)]

pub(crate) mod dialect;
pub(crate) mod limits;
mod raw;
mod reader;
mod redis_url;
#[cfg(test)]
mod reference;
mod resolve;
mod resolve_clusters;
mod resolve_routes;
pub(crate) mod routing;
pub(crate) mod saturation;
mod snapshot;
pub(crate) mod sticky;
pub(crate) mod tls;

use reader::*;
use resolve::*;
pub use snapshot::*;

pub(crate) use crate::http::HttpLimits;
pub(crate) use resolve::{connections_fitting, RESERVED_DESCRIPTORS};

/// What `sluice check --no-env` reads every environment variable as: 64 hex digits, a value of
/// the form every use of a variable takes (a credential, a password, the admin token of at
/// least 16 characters, a sticky key of 32 bytes in hex). Checks that compare a variable with
/// another value (a Redis password also in its URL) let it pass.
pub const ENV_PLACEHOLDER: &str =
    "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

use std::fmt;

/// One problem found in a config file, with the dotted path of the key it concerns (`server.listen`,
/// `clusters.a.backends[0].weight`, `pricing."gpt-4.1"`) and, where that key is in the file, its
/// line and column. Warnings use the same type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// Empty for a TOML syntax error, which has a position but no key.
    pub(crate) path: String,
    pub(crate) message: String,
    pub(crate) position: Option<Position>,
}

impl ConfigError {
    fn new(path: String, message: String) -> ConfigError {
        ConfigError {
            path,
            message,
            position: None,
        }
    }
}

/// A place in the config file: 1-based line, and 1-based column counted in characters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Position {
    pub(crate) line: usize,
    pub(crate) column: usize,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.path.is_empty(), self.position) {
            (false, Some(p)) => write!(
                f,
                "{} (line {}, column {}): {}",
                self.path, p.line, p.column, self.message
            ),
            (false, None) => write!(f, "{}: {}", self.path, self.message),
            (true, Some(p)) => write!(f, "line {}, column {}: {}", p.line, p.column, self.message),
            (true, None) => f.write_str(&self.message),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Loading
// ---------------------------------------------------------------------------------------------

/// Parse and validate a config file's text. `env` looks up environment variables (credentials),
/// so tests can pass their own instead of touching the process environment. Warnings are dropped;
/// [`load_with_warnings`] returns them too.
pub fn load(
    text: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Snapshot, Vec<ConfigError>> {
    load_with_warnings(text, env).snapshot
}

/// What [`load_with_warnings`] found: the snapshot or every error, and every warning (which do not
/// stop the load) either way.
#[derive(Debug)]
pub struct Loaded {
    pub snapshot: Result<Snapshot, Vec<ConfigError>>,
    pub warnings: Vec<ConfigError>,
}

/// [`load`], also returning the warnings: things that are valid but probably not meant, such as
/// a credential header no API knows. Errors and warnings are in file order, each with its line and
/// column where its key is in the file.
pub fn load_with_warnings(text: &str, env: &dyn Fn(&str) -> Option<String>) -> Loaded {
    // A syntax error stops the parse: it is the only error there can be.
    let doc = match toml_edit::ImDocument::parse(text) {
        Ok(doc) => doc,
        Err(e) => {
            let position = e.span().map(|span| position_at(text, span.start));
            return Loaded {
                snapshot: Err(vec![syntax_error(e.message(), position)]),
                warnings: Vec::new(),
            };
        }
    };
    let source = Source { text, doc };
    let mut errors = Vec::new();
    let mut warnings = Vec::new();
    let raw = read_sections(source.doc.as_table().clone(), &source, &mut errors);
    let read_errors = errors.len();
    let snapshot = validate(raw, env, &mut errors, &mut warnings);
    drop_echoes(&mut errors, read_errors);
    in_file_order(&mut errors, &source);
    in_file_order(&mut warnings, &source);
    Loaded {
        snapshot: match snapshot {
            Some(s) if errors.is_empty() => Ok(s),
            _ => Err(errors),
        },
        warnings,
    }
}

/// A key that could not be read is not checked again at its default: one error per key. The
/// first `read_errors` errors are the reading's; any after them about one of those keys (or a key
/// inside one) goes.
fn drop_echoes(errors: &mut Vec<ConfigError>, read_errors: usize) {
    let checked = errors.split_off(read_errors);
    let kept: Vec<ConfigError> = checked
        .into_iter()
        .filter(|e| !errors.iter().any(|u| is_under(&e.path, &u.path)))
        .collect();
    errors.extend(kept);
}

/// Give each problem its key's position and sort them in file order; those about keys that are
/// not in the file (a missing section) come last, in the order they were found.
fn in_file_order(problems: &mut [ConfigError], source: &Source) {
    for e in problems.iter_mut() {
        if e.position.is_none() {
            e.position = source.position(&e.path, Anchor::Value);
        }
    }
    problems.sort_by_key(|e| e.position.map_or((usize::MAX, 0), |p| (p.line, p.column)));
}

fn syntax_error(message: &str, position: Option<Position>) -> ConfigError {
    // toml's messages may run over lines ("invalid string\nexpected `\"`"); keep one line each.
    let message = message
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ");
    ConfigError {
        path: String::new(),
        message: format!("invalid TOML: {message}"),
        position,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::net::SocketAddr;
    use std::time::Duration;

    #[test]
    fn globs_match() {
        let p = ModelPattern::parse("gpt-4*");
        assert!(p.matches("gpt-4o"));
        assert!(p.matches("gpt-4"));
        assert!(!p.matches("gpt-3.5"));
        let p = ModelPattern::parse("*-mini");
        assert!(p.matches("gpt-4o-mini"));
        assert!(!p.matches("gpt-4o-mini-2"));
        let p = ModelPattern::parse("a*b*c");
        assert!(p.matches("abc"));
        assert!(p.matches("aXbYc"));
        assert!(!p.matches("aXbY"));
        assert!(!p.matches("ac"));
        let p = ModelPattern::parse("*");
        assert!(p.matches("anything"));
        let p = ModelPattern::parse("ab*ab");
        assert!(!p.matches("ab"));
        assert!(p.matches("abab"));
    }

    #[test]
    fn collects_all_errors_with_paths() {
        let text = r#"
            [server]
            listen = "nope"
            [clusters.a]
            backends = [{ base_url = "ftp://x", weight = 0 }]
            credential = { env = "MISSING_VAR" }
            [[routes]]
            model = "m"
            cluster = "b"
        "#;
        let errs = load(text, &|_| None).unwrap_err();
        let paths: Vec<_> = errs.iter().map(|e| e.path.as_str()).collect();
        assert!(paths.contains(&"server.listen"), "{paths:?}");
        assert!(
            paths.contains(&"clusters.a.backends[0].weight"),
            "{paths:?}"
        );
        assert!(
            paths.contains(&"clusters.a.backends[0].base_url"),
            "{paths:?}"
        );
        assert!(paths.contains(&"clusters.a.credential.env"), "{paths:?}");
        assert!(paths.contains(&"routes[0].cluster"), "{paths:?}");
    }

    #[test]
    fn a_password_in_a_base_url_is_refused_and_never_shown() {
        for url in [
            "http://user:s3cret@127.0.0.1:1/v1",
            "https://:s3cret@api.example.com/v1",
            "http://s3cret@127.0.0.1:1",
            "ftp://user:s3cret@x/v1",
        ] {
            let text = format!(
                "[clusters.a]\nbackends = [{{ base_url = \"{url}\" }}]\n\
                 [[routes]]\nmodel = \"m\"\ncluster = \"a\"\n"
            );
            let errs = load(&text, &|_| None).unwrap_err();
            let shown: Vec<String> = errs.iter().map(|e| e.to_string()).collect();
            assert!(!shown.join("\n").contains("s3cret"), "{url}: {shown:?}");
            assert!(
                errs.iter()
                    .any(|e| e.path == "clusters.a.backends[0].base_url"),
                "{url}: {shown:?}"
            );
        }
        assert_eq!(
            resolve_clusters::redact_userinfo("http://a:b@h:1/p@q"),
            "http://***@h:1/p@q"
        );
        assert_eq!(
            resolve_clusters::redact_userinfo("http://h/p"),
            "http://h/p"
        );
    }

    #[test]
    fn an_admin_listener_open_to_the_network_is_warned_of() {
        let with = |listen: &str| {
            let text = format!(
                "[clusters.a]\nbackends = [{{ base_url = \"http://127.0.0.1:1/v1\" }}]\n\
                 [[routes]]\nmodel = \"m\"\ncluster = \"a\"\n[admin]\nlisten = \"{listen}\"\n"
            );
            let loaded = load_with_warnings(&text, &|_| None);
            assert!(loaded.snapshot.is_ok(), "{listen}");
            loaded
                .warnings
                .iter()
                .filter(|w| w.path == "admin.listen")
                .count()
        };
        assert_eq!(with("0.0.0.0:9090"), 1);
        assert_eq!(with("[::]:9090"), 1);
        assert_eq!(with("127.0.0.1:9090"), 0);
        assert_eq!(with("[::1]:9090"), 0);
    }

    #[test]
    fn request_stream_usage_defaults_on() {
        let cluster = "[clusters.a]\nbackends = [{ base_url = \"http://127.0.0.1:1/v1\" }]\n\
                       [[routes]]\nmodel = \"*\"\ncluster = \"a\"\n";
        let s = load(cluster, &|_| None).unwrap();
        assert!(s.upstream.request_stream_usage);
        let off = format!("[upstream]\nrequest_stream_usage = false\n{cluster}");
        assert!(!load(&off, &|_| None).unwrap().upstream.request_stream_usage);
        let errs = load("[upstream]\nrequest_stream_usage = 1\n", &|_| None).unwrap_err();
        assert!(
            errs.iter()
                .any(|e| e.message.contains("expected a boolean")),
            "{errs:?}"
        );
    }

    #[test]
    fn the_upstream_cap_follows_the_client_side_and_the_pool_wait_is_bounded() {
        let cluster = "[clusters.a]\nbackends = [{ base_url = \"http://127.0.0.1:1/v1\" }]\n\
                       [[routes]]\nmodel = \"*\"\ncluster = \"a\"\n";
        let upstream = |text: &str| load(&format!("{text}\n{cluster}"), &|_| None);
        let s = upstream("").unwrap();
        assert_eq!(
            s.upstream.max_connections_per_backend,
            s.server.max_connections_per_worker
        );
        assert_eq!(s.upstream.pool_wait, Duration::from_millis(100));
        assert_eq!(
            s.server.max_requests_per_worker,
            s.server.max_connections_per_worker
        );
        let s = upstream("[server]\nmax_connections_per_worker = 5000").unwrap();
        assert_eq!(s.upstream.max_connections_per_backend, 5000);
        assert_eq!(s.server.max_requests_per_worker, 5000);
        let s = upstream("[server]\nmax_requests_per_worker = 7").unwrap();
        assert_eq!(s.server.max_requests_per_worker, 7);
        let s = upstream("[upstream]\nmax_connections_per_backend = 7\npool_wait_ms = 0").unwrap();
        assert_eq!(s.upstream.max_connections_per_backend, 7);
        assert_eq!(s.upstream.pool_wait, Duration::ZERO);
        let errs = upstream("[upstream]\nmax_connections_per_backend = 0\npool_wait_ms = 60001")
            .unwrap_err();
        let paths: Vec<&str> = errs.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "upstream.max_connections_per_backend",
                "upstream.pool_wait_ms"
            ],
            "{errs:?}"
        );
    }

    #[test]
    fn shutdown_grace_defaults_to_30_s_and_is_bounded() {
        let cluster = "[clusters.a]\nbackends = [{ base_url = \"http://127.0.0.1:1/v1\" }]\n\
                       [[routes]]\nmodel = \"*\"\ncluster = \"a\"\n";
        let grace = |server: &str| {
            load(&format!("[server]\n{server}\n{cluster}"), &|_| None)
                .map(|s| s.server.shutdown_grace)
        };
        assert_eq!(grace("").unwrap(), Duration::from_secs(30));
        assert_eq!(grace("shutdown_grace_ms = 0").unwrap(), Duration::ZERO);
        assert_eq!(
            grace("shutdown_grace_ms = 3600000").unwrap(),
            Duration::from_secs(3600)
        );
        let errs = grace("shutdown_grace_ms = 3600001").unwrap_err();
        assert_eq!(
            errs.iter().map(ToString::to_string).collect::<Vec<_>>(),
            ["server.shutdown_grace_ms (line 2, column 21): must be at most 3600000 (one hour)"]
        );
        let errs = grace("shutdown_grace_ms = -1").unwrap_err();
        assert_eq!(errs[0].path, "server.shutdown_grace_ms", "{errs:?}");
    }

    #[test]
    fn unknown_keys_rejected() {
        let errs = load("[server]\nlisten_typo = 1\n", &|_| None).unwrap_err();
        assert!(errs[0].message.contains("listen_typo"), "{errs:?}");
    }

    /// A valid cluster and route, for tests that care about other sections.
    const CLUSTER: &str = "[clusters.a]\nbackends = [{ base_url = \"http://127.0.0.1:1/v1\" }]\n\
                           [[routes]]\nmodel = \"*\"\ncluster = \"a\"\n";

    fn at(line: usize, column: usize) -> Option<Position> {
        Some(Position { line, column })
    }

    fn find<'a>(errs: &'a [ConfigError], path: &str) -> &'a ConfigError {
        errs.iter()
            .find(|e| e.path == path)
            .unwrap_or_else(|| panic!("no error at {path}: {errs:#?}"))
    }

    #[test]
    fn group_conditions_and_timeouts_are_checked() {
        let text = "[clusters.a]\nbackends = [{ base_url = \"http://127.0.0.1:1/v1\" }]\n\
                    [[routes]]\nmodel = \"m\"\ngroups = [\n\
                    { when = [\"timeout\"], targets = [{ cluster = \"a\" }] },\n\
                    { when = [], targets = [{ cluster = \"a\" }] },\n\
                    { when = [\"status_5xx\", \"5xx\", \"status_5xx\"], first_byte_timeout_ms = 0, \
                      targets = [{ cluster = \"a\" }] },\n]\n";
        let errs = load(text, &|_| None).unwrap_err();
        let msg = |path| find(&errs, path).message.clone();
        assert!(msg("routes[0].groups[0].when").contains("only a later group"));
        assert!(msg("routes[0].groups[1].when").contains("at least one failure"));
        assert!(msg("routes[0].groups[2].when[1]").contains("one of connect, timeout"));
        assert!(msg("routes[0].groups[2].when[2]").contains("listed twice"));
        assert!(msg("routes[0].groups[2].first_byte_timeout_ms").contains("at least 1 ms"));
        assert_eq!(errs.len(), 5, "{errs:#?}");

        let text = "[timeouts]\nupstream_first_byte_ms = 9000\n\
                    [clusters.a]\nbackends = [{ base_url = \"http://127.0.0.1:1/v1\" }]\n\
                    [[routes]]\nmodel = \"m\"\ngroups = [\n\
                    { targets = [{ cluster = \"a\" }], first_byte_timeout_ms = 250 },\n\
                    { when = [\"status_429\", \"timeout\"], targets = [{ cluster = \"a\" }] },\n]\n";
        let snapshot = load(text, &|_| None).unwrap();
        let groups = &snapshot.routes[0].groups;
        assert_eq!(groups[0].first_byte_timeout, Duration::from_millis(250));
        assert_eq!(groups[1].first_byte_timeout, Duration::from_millis(9000));
        assert_eq!(groups[0].when, None);
        let when = groups[1].when.unwrap();
        assert!(when.contains("status_429") && when.contains("timeout"));
        assert!(!when.contains("status_5xx") && !when.contains("connect"));
    }

    #[test]
    fn dialects_are_checked() {
        let cluster = |extra: &str| {
            format!(
                "[clusters.a]\nbackends = [{{ base_url = \"http://127.0.0.1:1/v1\" }}]\n{extra}\n\
                 [[routes]]\nmodel = \"*\"\ncluster = \"a\"\n"
            )
        };
        let errs = |extra: &str| load(&cluster(extra), &|_| None).unwrap_err();
        let e = errs("anthropic = { version = \"2023-06-01\" }");
        assert!(find(&e, "clusters.a.anthropic")
            .message
            .contains("dialect = \"anthropic\""));
        let e = errs("dialect = \"anthropic\"\nanthropic = { version = \"\", beta = \"a\\nb\", default_max_tokens = 0 }");
        assert!(find(&e, "clusters.a.anthropic.version")
            .message
            .contains("header value"));
        assert!(find(&e, "clusters.a.anthropic.beta")
            .message
            .contains("header value"));
        assert!(find(&e, "clusters.a.anthropic.default_max_tokens")
            .message
            .contains("at least 1"));
        let e = errs("dialect = \"gemini\"");
        assert!(e[0].path.starts_with("clusters.a.dialect"), "{e:?}");

        let ok = load(&cluster("dialect = \"anthropic\""), &|_| None).unwrap();
        let dialect::Dialect::Anthropic(a) = &ok.clusters[0].dialect else {
            panic!("not anthropic");
        };
        assert_eq!(a.version_line, b"anthropic-version: 2023-06-01\r\n");
        assert_eq!(a.beta_line, None);
        assert_eq!(a.default_max_tokens, 4096);
        let ok = load(&cluster(""), &|_| None).unwrap();
        assert_eq!(ok.clusters[0].dialect, dialect::Dialect::OpenAi);
    }

    #[test]
    fn probes_are_checked() {
        let cluster = |url: &str, probe: &str| {
            format!(
                "[clusters.a]\nbackends = [{{ base_url = \"{url}\" }}]\nprobe = {probe}\n\
                 [[routes]]\nmodel = \"*\"\ncluster = \"a\"\n"
            )
        };
        let errs = |text: String| load(&text, &|_| None).unwrap_err();
        let e = errs(cluster(
            "https://127.0.0.1:1/v1",
            "{ path = \"health\", expect_status = 99, interval_ms = 5, timeout_ms = 6, when = \"sometimes\" }",
        ));
        let msg = |path| find(&e, path).message.clone();
        assert!(msg("clusters.a.probe.path").contains("absolute path"));
        assert!(msg("clusters.a.probe.expect_status").contains("100 to 599"));
        assert!(msg("clusters.a.probe.type").contains("use type = \"tcp\""));
        assert!(msg("clusters.a.probe.interval_ms").contains("at least 10"));
        assert!(msg("clusters.a.probe.timeout_ms").contains("interval_ms"));
        assert!(msg("clusters.a.probe.when").contains("\"open\" or \"always\""));
        let e = errs(cluster(
            "http://127.0.0.1:1/v1",
            "{ type = \"tcp\", path = \"/health\" }",
        ));
        assert!(find(&e, "clusters.a.probe.path")
            .message
            .contains("only an http probe"));
        let e = errs(cluster("http://127.0.0.1:1/v1", "{ type = \"icmp\" }"));
        assert!(find(&e, "clusters.a.probe.type").message.contains("`icmp`"));

        let ok = load(
            &cluster(
                "https://127.0.0.1:1/v1",
                "{ type = \"tcp\", when = \"always\" }",
            ),
            &|_| None,
        )
        .unwrap();
        let probe = ok.clusters[0].probe.clone().unwrap();
        assert_eq!(probe.check, routing::ProbeCheck::Tcp);
        assert!(probe.always);
        let ok = load(&cluster("http://127.0.0.1:1/v1", "{}"), &|_| None).unwrap();
        let probe = ok.clusters[0].probe.clone().unwrap();
        assert_eq!(
            probe.check,
            routing::ProbeCheck::Http {
                path: "/health".into(),
                expect_status: 200
            }
        );
        assert_eq!(probe.interval, Duration::from_millis(2000));
        assert_eq!(probe.timeout, Duration::from_millis(1000));
        assert!(!probe.always);
    }

    #[test]
    fn unknown_field_names_the_key_with_line_and_column() {
        let text = format!("[server]\nlisten = \"127.0.0.1:0\"\nlistn = 1\n{CLUSTER}");
        let errs = load(&text, &|_| None).unwrap_err();
        assert_eq!(errs.len(), 1, "{errs:#?}");
        let e = &errs[0];
        assert_eq!(e.path, "server.listn");
        assert_eq!(e.position, at(3, 1));
        assert!(
            e.to_string().starts_with(
                "server.listn (line 3, column 1): unknown field `listn`, expected one of `listen`"
            ),
            "{e}"
        );
        // The nearest allowed name is said, for a key and for a table.
        assert!(e.to_string().ends_with("; did you mean `listen`?"), "{e}");
        let errs = load(&format!("[limit]\nbackend = \"local\"\n{CLUSTER}"), &|_| {
            None
        })
        .unwrap_err();
        assert!(
            errs[0].to_string().ends_with("; did you mean `limits`?"),
            "{errs:#?}"
        );
        // Nothing near: nothing suggested.
        let errs = load(&format!("[zzzzzzzz]\nx = 1\n{CLUSTER}"), &|_| None).unwrap_err();
        assert!(!errs[0].to_string().contains("did you mean"), "{errs:#?}");
        // A misspelled section is one error: what needs the section it meant is not reported
        // as well (no "at least one cluster", no "no cluster named" for the routes).
        let typo = "[cluster.main]\nbackends = [{ base_url = \"http://127.0.0.1:9/v1\" }]\n\
                    [[routes]]\nmodel = \"m\"\ncluster = \"main\"\n";
        let errs = load(typo, &|_| None).unwrap_err();
        assert_eq!(errs.len(), 1, "{errs:#?}");
        assert!(errs[0].to_string().ends_with("did you mean `clusters`?"));
        let typo = "[clusters.main]\nbackends = [{ base_url = \"http://127.0.0.1:9/v1\" }]\n\
                    [[route]]\nmodel = \"m\"\ncluster = \"main\"\n";
        let errs = load(typo, &|_| None).unwrap_err();
        assert_eq!(errs.len(), 1, "{errs:#?}");
        // Beside a [clusters] that is there, nothing is hidden: a route to a cluster that is
        // nowhere is still reported.
        let both = "[clusters.a]\nbackends = [{ base_url = \"http://127.0.0.1:9/v1\" }]\n\
                    [cluster.b]\nbackends = [{ base_url = \"http://127.0.0.1:9/v1\" }]\n\
                    [[routes]]\nmodel = \"m\"\ncluster = \"zzz\"\n";
        let errs = load(both, &|_| None).unwrap_err();
        assert_eq!(errs.len(), 2, "{errs:#?}");
        assert!(
            errs[1].to_string().contains("no cluster named `zzz`"),
            "{errs:#?}"
        );
        // A misspelled [limits] does not stop the keys being checked.
        let keys = format!(
            "[limit]\nbackend = \"local\"\n[[keys]]\nid = \"k\"\nsha256 = \"nothex\"\n{CLUSTER}"
        );
        let errs = load(&keys, &|_| None).unwrap_err();
        assert!(errs.iter().any(|e| e.path == "keys[0].sha256"), "{errs:#?}");
    }

    #[test]
    fn type_error_names_the_key_and_points_at_the_value() {
        let text = format!("[server]\nworkers = \"two\"\n{CLUSTER}");
        let errs = load(&text, &|_| None).unwrap_err();
        assert_eq!(
            errs.iter().map(ToString::to_string).collect::<Vec<_>>(),
            [
                r#"server.workers (line 2, column 11): invalid type: string "two", expected a whole number ≥ 0"#
            ]
        );
    }

    #[test]
    fn semantic_errors_get_line_and_column_too() {
        let text = format!("# comment\n[server]\n  listen = \"nope\"\n{CLUSTER}");
        let errs = load(&text, &|_| None).unwrap_err();
        assert_eq!(
            errs[0].to_string(),
            "server.listen (line 3, column 12): `nope` is not an address like 127.0.0.1:8080"
        );
        // A key that is not in the file points at the nearest part of its path that is.
        let errs = load(
            "[clusters.a]\n[[routes]]\nmodel = \"*\"\ncluster = \"a\"\n",
            &|_| None,
        )
        .unwrap_err();
        assert_eq!(find(&errs, "clusters.a.backends").position, at(1, 11));
        // One about a key that is nowhere in the file has no position, and comes last.
        let errs = load("[server]\nworkers = 1\n", &|_| None).unwrap_err();
        assert_eq!(find(&errs, "clusters").position, None);
        assert_eq!(errs.last().unwrap().position, None);
        assert_eq!(
            find(&errs, "routes").to_string(),
            "routes: at least one route is required"
        );
    }

    #[test]
    fn errors_in_every_section_are_reported_at_once() {
        let text = r#"
[server]
listen = "nope"
workerz = 2

[timeouts]
header_read_ms = 0

[http]
max_headers = "many"

[clusters.a]
backends = [{ base_url = "http://127.0.0.1:1/v1", weight = "heavy" }]

[clusters.b]
backends = [{ base_url = "ftp://x" }]

[clusters.c]
backends = 5

[[routes]]
model = "*"
cluster = "a"

[[routes]]
model = "m"

[pricing."gpt-4.1"]
input = -1.0
output = 1.0

[[keys]]
id = "k"
sha256 = "00"
colour = "red"

[bogus]
"#;
        let errs = load(text, &|_| None).unwrap_err();
        let shown: Vec<String> = errs.iter().map(ToString::to_string).collect();
        let expect = [
            ("server.listen", 3, 10),
            ("server.workerz", 4, 1),
            ("timeouts.header_read_ms", 7, 18),
            ("http.max_headers", 10, 15),
            ("clusters.a.backends[0].weight", 13, 60),
            ("clusters.b.backends[0].base_url", 16, 26),
            ("clusters.c.backends", 19, 12),
            ("routes[1]", 25, 1),
            ("pricing.\"gpt-4.1\"", 28, 10),
            ("keys[0].sha256", 34, 10),
            ("keys[0].colour", 35, 1),
            ("bogus", 37, 2),
        ];
        for (path, line, column) in expect {
            assert_eq!(find(&errs, path).position, at(line, column), "{shown:#?}");
        }
        // File order, and nothing else: a key left out for an error is not checked again at its
        // default (no "at least one backend" for clusters.c), and a route to cluster `a`, whose
        // bad weight was left out, is fine.
        let paths: Vec<&str> = errs.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(paths, expect.map(|(p, _, _)| p), "{shown:#?}");
        assert!(find(&errs, "routes[1]")
            .message
            .contains("a route needs `cluster`"));
        assert!(find(&errs, "bogus")
            .message
            .contains("unknown field `bogus`"));
    }

    #[test]
    fn syntax_error_has_line_and_column() {
        let errs = load("[server]\nworkers = 2\nlisten = \"127.0.0.1:0\n", &|_| None).unwrap_err();
        assert_eq!(errs.len(), 1, "{errs:#?}");
        assert_eq!(errs[0].path, "");
        assert_eq!(errs[0].position.map(|p| p.line), Some(3), "{errs:#?}");
        let shown = errs[0].to_string();
        assert!(shown.starts_with("line 3, column "), "{shown}");
        assert!(shown.contains("invalid TOML: "), "{shown}");
        assert!(!shown.contains('\n'), "{shown}");
    }

    #[test]
    fn admin_listen_must_not_take_the_server_port() {
        let errs = load(
            &format!("[server]\nlisten = \"127.0.0.1:8080\"\n[admin]\nlisten = \"127.0.0.1:8080\"\n{CLUSTER}"),
            &|_| None,
        )
        .unwrap_err();
        assert_eq!(errs.len(), 1, "{errs:#?}");
        assert_eq!(errs[0].path, "admin.listen");
        assert_eq!(errs[0].position, at(4, 10));
        // A wildcard covers the other address.
        let errs = load(
            &format!("[server]\nlisten = \"0.0.0.0:8080\"\n[admin]\nlisten = \"127.0.0.1:8080\"\n{CLUSTER}"),
            &|_| None,
        )
        .unwrap_err();
        assert_eq!(errs[0].path, "admin.listen");
        // Another port is fine.
        let s = load(
            &format!("[server]\nlisten = \"0.0.0.0:8080\"\n[admin]\nlisten = \"127.0.0.1:9090\"\n{CLUSTER}"),
            &|_| None,
        )
        .unwrap();
        assert_eq!(s.admin_listen.map(|a| a.port()), Some(9090));

        let addr = |s: &str| s.parse::<SocketAddr>().unwrap();
        assert!(listeners_clash(addr("[::]:80"), addr("127.0.0.1:80")));
        assert!(listeners_clash(addr("[::1]:80"), addr("[::]:80")));
        assert!(listeners_clash(
            addr("[::ffff:127.0.0.1]:80"),
            addr("127.0.0.1:80")
        ));
        assert!(!listeners_clash(addr("0.0.0.0:80"), addr("[::1]:80")));
        assert!(!listeners_clash(addr("127.0.0.1:80"), addr("127.0.0.2:80")));
        assert!(!listeners_clash(addr("127.0.0.1:0"), addr("127.0.0.1:0")));
    }

    #[test]
    fn unknown_credential_header_is_a_warning_unless_allowed() {
        let env = |_: &str| Some("sk-test".to_string());
        let text = "[clusters.openai]\nbackends = [{ base_url = \"http://127.0.0.1:1/v1\" }]\n\
                    credential = { env = \"KEY\", header = \"authorisation\" }\n\
                    [[routes]]\nmodel = \"*\"\ncluster = \"openai\"\n";
        let loaded = load_with_warnings(text, &env);
        let snapshot = loaded.snapshot.unwrap();
        // Still sent as configured: a warning, not an error.
        let credential = &snapshot.clusters[0].credentials[0];
        assert_eq!(credential.header_name, "authorisation");
        assert_eq!(loaded.warnings.len(), 1);
        assert_eq!(
            loaded.warnings[0].to_string(),
            "clusters.openai.credential.header (line 3, column 38): `authorisation` is not a \
             known credential header (authorization, x-api-key, api-key, x-goog-api-key); the \
             secret will be sent under it — set credential.allow_custom_header = true if that is \
             intended"
        );
        let allowed = text.replace(
            "header = \"authorisation\"",
            "header = \"authorisation\", allow_custom_header = true",
        );
        let loaded = load_with_warnings(&allowed, &env);
        assert!(loaded.snapshot.is_ok());
        assert_eq!(loaded.warnings, []);
        for known in ["X-Api-Key", "api-key", "x-goog-api-key", "authorization"] {
            let text = text.replace("authorisation", known);
            assert_eq!(load_with_warnings(&text, &env).warnings, [], "{known}");
        }
    }

    #[test]
    fn datetimes_read_through_the_path_tracking() {
        let sha = "ab".repeat(32);
        let text = format!(
            "{CLUSTER}[[keys]]\nid = \"k\"\nsha256 = \"{sha}\"\nexpires = 2030-01-01T00:00:00Z\n\
             plans = [{{ id = \"p\", tokens = 10, anchor = 2024-01-01T00:00:00Z }}]\n"
        );
        let s = load(&text, &|_| None).unwrap();
        assert_eq!(s.limits.keys[0].expires, Some(1_893_456_000));
        let errs = load(&text.replace("2030-01-01T00:00:00Z", "\"soon\""), &|_| None).unwrap_err();
        assert_eq!(errs[0].path, "keys[0].expires", "{errs:#?}");
        assert_eq!(errs[0].position, at(9, 11), "{errs:#?}");
    }

    #[test]
    fn key_paths_round_trip() {
        for (key, shown) in [
            ("a", "a"),
            ("gpt-4o", "gpt-4o"),
            ("gpt-4.1", "\"gpt-4.1\""),
            ("", "\"\""),
            ("a\"b\\c", r#""a\"b\\c""#),
        ] {
            assert_eq!(key_segment(key), shown);
            let path = format!("x.{shown}[3].y");
            assert_eq!(
                parse_path(&path),
                [
                    Segment::Key("x".into()),
                    Segment::Key(key.into()),
                    Segment::Index(3),
                    Segment::Key("y".into())
                ]
            );
        }
        assert_eq!(position_at("ab\nçd", 5), Position { line: 2, column: 2 });
    }

    #[test]
    fn routes_sorted_most_specific_first() {
        let text = r#"
            [clusters.a]
            backends = [{ base_url = "http://127.0.0.1:1/v1" }]
            [[routes]]
            model = "*"
            cluster = "a"
            [[routes]]
            model = "gpt-4o*"
            cluster = "a"
            [[routes]]
            model = "gpt-4o"
            cluster = "a"
        "#;
        let s = load(text, &|_| None).unwrap();
        let order: Vec<_> = s
            .routes
            .iter()
            .map(|r| match &r.pattern {
                ModelPattern::Exact(m) => m.clone(),
                ModelPattern::Glob { source, .. } => source.clone(),
            })
            .collect();
        assert_eq!(order, ["gpt-4o", "gpt-4o*", "*"]);
        assert_eq!(s.clusters[0].backends[0].base_path, "/v1");
        assert_eq!(s.clusters[0].backends[0].host_header, "127.0.0.1:1");
    }
}
