//! `docs/config.md` checked against the code, so the reference cannot drift (its top says how,
//! for readers).
//!
//! Each `## ` heading of the page names a section, and [`sections`] says which raw serde struct
//! reads it. The struct's key names are serde's own: its derived `Deserialize` hands
//! `deserialize_struct` the list of field names, which [`field_names`] catches. Defaults are what
//! the struct holds when read with only its required keys, serialized back to TOML (the raw
//! structs derive `Serialize` in tests only), plus the few the resolvers apply later, taken from
//! the constants they use ([`applied_later`]).

use std::collections::{BTreeMap, BTreeSet};

use serde::de::{DeserializeOwned, Visitor};
use serde::Serialize;

use super::dialect::RawAnthropic;
use super::limits::provider::RawProviderLimits;
use super::limits::raw::{
    RawKey, RawLimits, RawPlan, RawPolicy, RawRedis, RawReserve, DEFAULT_REDIS_DB,
};
use super::limits::resolve::DEFAULT_WINDOW_SECS;
use super::limits::snapshot::Reserve;
use super::raw::{
    RawAccessLog, RawAdmin, RawBackend, RawCluster, RawCredential, RawGroup, RawHttp, RawPrice,
    RawRoute, RawServer, RawTarget, RawTimeouts, RawUpstream, SECTIONS,
};
use super::routing::{RawProbe, RawRouting};
use super::saturation::{RawClass, RawSaturation};
use super::sticky::{RawPrefix, RawSticky, RawStickyKey, RawStickyRule};
use super::tls::{RawCertificate, RawTls};

/// One documented section and the struct that reads it.
struct Section {
    heading: &'static str,
    /// The struct's name (for the check that every raw struct is documented).
    type_name: &'static str,
    fields: &'static [&'static str],
    /// The section with only its required keys, as a TOML inline table.
    minimal: &'static str,
    /// Read a table as the struct and serialize what it then holds.
    read: fn(toml::Table) -> Result<toml::Table, String>,
    /// The (heading, key) of the row in the enclosing section that this section details.
    parent: Option<(&'static str, &'static str)>,
}

fn section<T: DeserializeOwned + Serialize>(
    heading: &'static str,
    minimal: &'static str,
    parent: Option<(&'static str, &'static str)>,
) -> Section {
    Section {
        heading,
        type_name: std::any::type_name::<T>(),
        fields: field_names::<T>(),
        minimal,
        read: read_as::<T>,
        parent,
    }
}

fn sections() -> Vec<Section> {
    const CLUSTER: &str = "[clusters.<name>]";
    vec![
        section::<RawServer>("[server]", "{}", None),
        section::<RawHttp>("[http]", "{}", None),
        section::<RawTimeouts>("[timeouts]", "{}", None),
        section::<RawUpstream>("[upstream]", "{}", None),
        section::<RawCluster>(CLUSTER, "{}", None),
        section::<RawBackend>(
            "clusters.<name>.backends[]",
            r#"{ base_url = "http://x/v1" }"#,
            Some((CLUSTER, "backends")),
        ),
        section::<RawCredential>(
            "clusters.<name>.credential",
            r#"{ env = "X" }"#,
            Some((CLUSTER, "credential")),
        ),
        section::<RawProbe>("clusters.<name>.probe", "{}", Some((CLUSTER, "probe"))),
        section::<RawAnthropic>(
            "clusters.<name>.anthropic",
            "{}",
            Some((CLUSTER, "anthropic")),
        ),
        section::<RawProviderLimits>(
            "clusters.<name>.provider_limits",
            "{}",
            Some((CLUSTER, "provider_limits")),
        ),
        section::<RawRoute>("[[routes]]", r#"{ model = "m" }"#, None),
        section::<RawGroup>("routes[].groups[]", "{}", Some(("[[routes]]", "groups"))),
        section::<RawTarget>(
            "routes[].groups[].targets[]",
            r#"{ cluster = "c" }"#,
            Some(("routes[].groups[]", "targets")),
        ),
        section::<RawStickyRule>("routes[].sticky", "{}", Some(("[[routes]]", "sticky"))),
        section::<RawPrefix>(
            "routes[].sticky.prefix",
            "{}",
            Some(("routes[].sticky", "prefix")),
        ),
        section::<RawRouting>("[routing]", "{}", None),
        section::<RawSaturation>("[saturation]", "{}", None),
        section::<RawClass>(
            "saturation.classes[]",
            r#"{ name = "a" }"#,
            Some(("[saturation]", "classes")),
        ),
        section::<RawSticky>("[sticky]", "{}", None),
        section::<RawStickyKey>(
            "sticky.keys[]",
            r#"{ id = 1, env = "K" }"#,
            Some(("[sticky]", "keys")),
        ),
        section::<RawAdmin>("[admin]", r#"{ listen = "127.0.0.1:9090" }"#, None),
        section::<RawTls>("[tls]", r#"{ listen = "0.0.0.0:8443" }"#, None),
        section::<RawCertificate>(
            "tls.certificates[]",
            r#"{ cert = "c.pem", key = "k.pem" }"#,
            Some(("[tls]", "certificates")),
        ),
        section::<RawAccessLog>("[access_log]", r#"{ dir = "/tmp" }"#, None),
        section::<RawPrice>(
            "[pricing.\"<model>\"]",
            "{ input = 1.0, output = 1.0 }",
            None,
        ),
        section::<RawLimits>("[limits]", "{}", None),
        section::<RawReserve>("[limits.reserve]", "{}", Some(("[limits]", "reserve"))),
        section::<RawRedis>(
            "[limits.redis]",
            r#"{ address = "127.0.0.1:6379" }"#,
            Some(("[limits]", "redis")),
        ),
        section::<RawKey>("[[keys]]", r#"{ id = "k", sha256 = "x" }"#, None),
        section::<RawPlan>(
            "keys[].plans[]",
            r#"{ id = "p" }"#,
            Some(("[[keys]]", "plans")),
        ),
        section::<RawPolicy>("[[policies]]", r#"{ id = "p" }"#, None),
        section::<RawReserve>(
            "policies[].reserve",
            "{}",
            Some(("[[policies]]", "reserve")),
        ),
    ]
}

/// Defaults the resolvers apply after reading (the raw struct holds nothing for them), from
/// the constants they use.
fn applied_later() -> BTreeMap<(&'static str, &'static str), toml::Value> {
    let reserve = Reserve::default();
    BTreeMap::from([
        (
            ("[limits.reserve]", "coefficient"),
            value(reserve.coefficient),
        ),
        (("[limits.reserve]", "offset"), value(reserve.offset)),
        (
            ("[limits.reserve]", "max_tokens_cap"),
            value(reserve.max_tokens_cap),
        ),
        (("[limits.redis]", "db"), value(DEFAULT_REDIS_DB)),
        (
            ("[[policies]]", "requests_window_secs"),
            value(DEFAULT_WINDOW_SECS),
        ),
        (
            ("[[policies]]", "tokens_window_secs"),
            value(DEFAULT_WINDOW_SECS),
        ),
        (
            ("clusters.<name>.provider_limits", "window_secs"),
            value(DEFAULT_WINDOW_SECS),
        ),
    ])
}

/// A value as TOML.
fn value<T: Serialize>(v: T) -> toml::Value {
    toml::Value::try_from(v).unwrap_or_else(|e| panic!("to TOML: {e}"))
}

/// The key names serde's derive gives `T`: its `deserialize_struct` call carries them.
fn field_names<T: DeserializeOwned>() -> &'static [&'static str] {
    struct Names<'a>(&'a mut Option<&'static [&'static str]>);

    impl<'de> serde::Deserializer<'de> for Names<'_> {
        type Error = serde::de::value::Error;

        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
            Err(serde::de::Error::custom("not a struct"))
        }

        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _name: &'static str,
            fields: &'static [&'static str],
            _visitor: V,
        ) -> Result<V::Value, Self::Error> {
            *self.0 = Some(fields);
            Err(serde::de::Error::custom("only the names were wanted"))
        }

        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
            option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
            ignored_any
        }
    }

    let mut names = None;
    let _ = T::deserialize(Names(&mut names));
    names.unwrap_or_else(|| panic!("{} is not read as a struct", std::any::type_name::<T>()))
}

fn read_as<T: DeserializeOwned + Serialize>(table: toml::Table) -> Result<toml::Table, String> {
    let value: T = toml::Value::Table(table)
        .try_into()
        .map_err(|e: toml::de::Error| e.message().to_string())?;
    match toml::Value::try_from(&value) {
        Ok(toml::Value::Table(t)) => Ok(t),
        other => panic!("{} serialized as {other:?}", std::any::type_name::<T>()),
    }
}

/// A TOML value as written after `v = ` (an inline table, a literal).
fn toml_value(text: &str) -> Result<toml::Value, String> {
    let mut table: toml::Table =
        toml::from_str(&format!("v = {text}")).map_err(|e| e.message().to_string())?;
    table.remove("v").ok_or_else(|| "no value".into())
}

/// A row of the page: the key and its default cell.
struct Row {
    key: String,
    default: String,
}

/// The page's sections: each `## ` heading in backticks, with the rows of its table (lines
/// starting with a backticked key).
fn documented(text: &str) -> BTreeMap<String, Vec<Row>> {
    let mut sections: BTreeMap<String, Vec<Row>> = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        if let Some(heading) = line.strip_prefix("## ") {
            current = heading
                .strip_prefix('`')
                .and_then(|h| h.strip_suffix('`'))
                .map(str::to_string);
            if let Some(h) = &current {
                assert!(
                    sections.insert(h.clone(), Vec::new()).is_none(),
                    "docs/config.md has the section {h} twice"
                );
            }
            continue;
        }
        let (Some(section), Some(row)) = (&current, line.strip_prefix("| `")) else {
            continue;
        };
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        assert!(cells.len() >= 4, "docs/config.md: a short row: {line}");
        let key = cells[0].trim_end_matches('`').to_string();
        let rows = sections.get_mut(section).unwrap_or_else(|| unreachable!());
        assert!(
            !rows.iter().any(|r| r.key == key),
            "docs/config.md lists {section} {key} twice"
        );
        rows.push(Row {
            key,
            default: cells[2].to_string(),
        });
    }
    sections
}

fn page() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/config.md");
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// Every heading of the page is a section the code reads, and every section the code reads
    /// is on the page: the top-level ones (`SECTIONS`) and every raw struct of the config module.
    #[test]
    fn the_page_documents_every_section_and_no_other() {
        let doc = documented(&page());
        let sections = sections();
        let mapped: BTreeSet<&str> = sections.iter().map(|s| s.heading).collect();
        let on_page: BTreeSet<&str> = doc.keys().map(String::as_str).collect();
        assert_eq!(
            on_page, mapped,
            "docs/config.md's `## ` headings and the sections the test knows differ"
        );
        let top = |heading: &str| {
            heading
                .trim_start_matches('[')
                .split(['.', '[', ']'])
                .next()
                .unwrap_or_default()
                .to_string()
        };
        let tops: BTreeSet<String> = mapped.iter().map(|h| top(h)).collect();
        let code: BTreeSet<String> = SECTIONS.iter().map(|s| s.to_string()).collect();
        assert_eq!(tops, code, "top-level sections: documented vs read");
        let sources = [
            include_str!("raw.rs"),
            include_str!("limits/raw.rs"),
            include_str!("limits/provider.rs"),
            include_str!("tls.rs"),
            include_str!("routing.rs"),
            include_str!("sticky.rs"),
            include_str!("saturation.rs"),
            include_str!("dialect.rs"),
        ];
        let raw_structs: BTreeSet<&str> = sources
            .iter()
            .flat_map(|src| src.split("struct ").skip(1))
            .map(|rest| {
                let end = rest
                    .find(|c: char| !c.is_alphanumeric() && c != '_')
                    .unwrap_or(rest.len());
                &rest[..end]
            })
            .filter(|name| name.starts_with("Raw") && *name != "RawConfig")
            .collect();
        let documented_types: BTreeSet<&str> = sections
            .iter()
            .map(|s| s.type_name.rsplit("::").next().unwrap_or_default())
            .collect();
        assert_eq!(
            raw_structs, documented_types,
            "raw config structs vs the ones docs/config.md documents"
        );
    }

    /// Each section's rows are exactly the keys its struct reads, and each default and `required` the page gives is the code's.
    #[test]
    fn the_page_lists_every_key_with_the_code_s_default() {
        let doc = documented(&page());
        let later = applied_later();
        let sections = sections();
        let mut problems = Vec::new();
        for s in &sections {
            let rows = &doc[s.heading];
            let fields: BTreeSet<&str> = s.fields.iter().copied().collect();
            let listed: BTreeSet<&str> = rows.iter().map(|r| r.key.as_str()).collect();
            for missing in fields.difference(&listed) {
                problems.push(format!(
                    "{} {missing}: read by the code, not on the page",
                    s.heading
                ));
            }
            for extra in listed.difference(&fields) {
                problems.push(format!(
                    "{} {extra}: on the page, not read by the code",
                    s.heading
                ));
            }
            let minimal = match toml_value(s.minimal) {
                Ok(toml::Value::Table(t)) => t,
                other => panic!("{}: minimal {other:?}", s.heading),
            };
            let defaults = (s.read)(minimal.clone())
                .unwrap_or_else(|e| panic!("{}: reading {} failed: {e}", s.heading, s.minimal));
            // The minimal table's keys are exactly the required ones.
            let mut required = BTreeSet::new();
            for key in minimal.keys() {
                let mut without = minimal.clone();
                without.remove(key);
                match (s.read)(without) {
                    Err(e) if e.contains(&format!("missing field `{key}`")) => {
                        required.insert(key.as_str());
                    }
                    other => panic!("{}: {key} is not required: {other:?}", s.heading),
                }
            }
            for row in rows.iter().filter(|r| fields.contains(r.key.as_str())) {
                let at = format!("{} {}", s.heading, row.key);
                let details = sections
                    .iter()
                    .any(|d| d.parent == Some((s.heading, &row.key)));
                let applied = later.get(&(s.heading, row.key.as_str()));
                if details {
                    if !row.default.starts_with('—') {
                        problems.push(format!("{at}: detailed below, so its default is `— (…)`"));
                    }
                } else if row.default == "required" {
                    if !required.contains(row.key.as_str()) {
                        problems.push(format!(
                            "{at}: documented required, the code reads it without"
                        ));
                    }
                } else if let Some(literal) = row.default.strip_prefix('`') {
                    let literal = literal.split('`').next().unwrap_or_default();
                    let documented = toml_value(literal)
                        .unwrap_or_else(|e| panic!("{at}: default `{literal}` is not TOML: {e}"));
                    let code = if required.contains(row.key.as_str()) {
                        None
                    } else {
                        applied.or(defaults.get(&row.key))
                    };
                    if code != Some(&documented) {
                        problems.push(format!(
                            "{at}: documented default {documented}, the code's {code:?}"
                        ));
                    }
                } else if row.default.starts_with('—') {
                    if let Some(v) = applied.or(defaults.get(&row.key)) {
                        problems.push(format!("{at}: the code defaults to {v}; document it"));
                    }
                } else {
                    problems.push(format!(
                        "{at}: a default is `required`, a `TOML value` or `— (words)`, not {:?}",
                        row.default
                    ));
                }
                if required.contains(row.key.as_str()) && row.default != "required" {
                    problems.push(format!(
                        "{at}: required by the code, documented {:?}",
                        row.default
                    ));
                }
                if applied.is_some() && defaults.contains_key(&row.key) {
                    problems.push(format!("{at}: in applied_later and filled in when read"));
                }
            }
        }
        assert!(
            problems.is_empty(),
            "docs/config.md vs the code:\n{}",
            problems.join("\n")
        );
    }

    /// The checks catch what they are for: a field serde reads, a default, `required`.
    #[test]
    fn the_checks_see_what_they_check() {
        assert_eq!(
            field_names::<RawBackend>(),
            ["base_url", "weight"],
            "field names from serde's derive"
        );
        let defaults =
            read_as::<RawBackend>(toml::from_str("base_url = \"http://x/v1\"").unwrap()).unwrap();
        assert_eq!(defaults.get("weight"), Some(&toml::Value::Integer(1)));
        let err = read_as::<RawBackend>(toml::Table::new()).unwrap_err();
        assert!(err.contains("missing field `base_url`"), "{err}");
        // A row for a key no struct reads, or a missing row, is seen.
        let doc = documented("## `[x]`\n| key | t | d | m |\n| --- |\n| `a` | int | `1` | … |\n");
        assert_eq!(doc["[x]"].len(), 1);
        assert_eq!(
            (doc["[x]"][0].key.as_str(), doc["[x]"][0].default.as_str()),
            ("a", "`1`")
        );
    }
}
