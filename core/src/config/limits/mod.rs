//! The `[[keys]]`, `[[policies]]` and `[limits]` sections: raw serde types and their validation
//! into the typed [`LimitsConfig`] that workers read.
//!
//! Runs once per config load, inside [`crate::config::load`]. Takes the raw sections and the
//! worker count; returns a [`LimitsConfig`], pushing every problem found (with its key path) to
//! the caller's error list rather than stopping at the first. By job: `raw` (what serde reads),
//! `snapshot` (what workers read), `resolve` (keys, plans and policies), `redis` (the shared
//! state's address), `provider` (a provider's own limits), `checks` (the readers they share).

mod checks;
pub(super) mod provider;
pub(super) mod raw;
mod redis;
pub(super) mod resolve;
pub(super) mod snapshot;

pub(crate) use checks::{civil_year_month, days_from_civil, decode_hex};
pub(crate) use provider::{resolve_provider_limits, ProviderLimits, RawProviderLimits};
pub(crate) use raw::{RawKey, RawLimits, RawPolicy};
pub(crate) use resolve::resolve;
pub(crate) use snapshot::{
    ApiKey, Cidr, DownPolicy, KeyIdx, LimitsConfig, Per, Period, Plan, Policy, RateLimit,
    RedisSettings, SettleTokenizer, StableIds, SyncSettings, RECONNECT_BACKOFF_MAX,
};

/// Which limit a limiter policy checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LimitDimension {
    /// Requests per minute.
    Rpm,
    /// Tokens per minute.
    Tpm,
    /// Concurrent requests.
    Concurrency,
    /// Prepaid quota / budget.
    Quota,
}

impl LimitDimension {
    pub(crate) const ALL: [LimitDimension; 4] = [
        LimitDimension::Rpm,
        LimitDimension::Tpm,
        LimitDimension::Concurrency,
        LimitDimension::Quota,
    ];

    pub(crate) fn label(self) -> &'static str {
        match self {
            LimitDimension::Rpm => "rpm",
            LimitDimension::Tpm => "tpm",
            LimitDimension::Concurrency => "concurrency",
            LimitDimension::Quota => "quota",
        }
    }
}

/// The SHA-256 of a key, as stored in the config (`[[keys]] sha256`).
pub fn digest(key: &[u8]) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, key);
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

/// Equal in time independent of where the inputs differ (only their lengths tell): for
/// comparing a presented secret, or its digest, with a stored one (API keys, the admin token).
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |diff, (x, y)| diff | (x ^ y));
    std::hint::black_box(diff) == 0
}

/// Lowercase hex of a digest (what `sluice key hash` prints).
pub fn hex(digest: &[u8; 32]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(64);
    for b in digest {
        s.push(HEX[(b >> 4) as usize] as char);
        s.push(HEX[(b & 15) as usize] as char);
    }
    s
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::net::SocketAddr;
    use std::time::Duration;

    use super::snapshot::{Cidr, Reserve};
    use super::*;

    #[test]
    fn cidrs() {
        let c = Cidr::parse("10.0.0.0/8").unwrap();
        assert!(c.contains("10.1.2.3".parse().unwrap()));
        assert!(!c.contains("11.0.0.1".parse().unwrap()));
        assert!(c.contains("::ffff:10.0.0.1".parse().unwrap()));
        let c6 = Cidr::parse("2001:db8::/32").unwrap();
        assert!(c6.contains("2001:db8::1".parse().unwrap()));
        assert!(!c6.contains("2001:db9::1".parse().unwrap()));
        assert!(!c6.contains("10.0.0.1".parse().unwrap()));
        assert!(Cidr::parse("0.0.0.0/0")
            .unwrap()
            .contains("1.2.3.4".parse().unwrap()));
        assert!(Cidr::parse("::1").unwrap().contains("::1".parse().unwrap()));
        assert!(Cidr::parse("10.0.0.1/8").is_err());
        assert!(Cidr::parse("10.0.0.0/33").is_err());
        assert!(Cidr::parse("nonsense").is_err());
    }

    #[test]
    fn civil_dates_round_trip() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        for days in [0i64, 59, 60, 365, 11_016, 11_017, 20_000, 24_000] {
            let (y, m) = civil_year_month(days);
            assert!(days_from_civil(y, m, 1) <= days);
            let (ny, nm) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
            assert!(days_from_civil(ny, nm, 1) > days);
        }
    }

    #[test]
    fn paced_allowance() {
        let r = RateLimit {
            max: 600,
            window: Duration::from_secs(60),
            burst: 100,
        };
        assert_eq!(r.allowance(0, 0), 100);
        assert_eq!(r.allowance(0, 30_000), 400);
        assert_eq!(r.allowance(0, 60_000), 600);
        let plain = RateLimit { burst: 600, ..r };
        assert_eq!(plain.allowance(0, 0), 600);
    }

    /// `[limits.redis]` holding `section`, loaded with `env`: the settings, or every error as
    /// (path, message).
    fn redis(section: &str, env: &[(&str, &str)]) -> Result<RedisSettings, Vec<(String, String)>> {
        let text = format!(
            "[clusters.a]\nbackends = [{{ base_url = \"http://127.0.0.1:1/v1\" }}]\n\
             [[routes]]\nmodel = \"*\"\ncluster = \"a\"\n\
             [limits]\nbackend = \"redis\"\n[limits.redis]\n{section}"
        );
        let env = |k: &str| {
            env.iter()
                .find(|(name, _)| *name == k)
                .map(|(_, v)| v.to_string())
        };
        match crate::config::load(&text, &env) {
            Ok(s) => Ok(s.limits.sync.redis.clone().unwrap()),
            Err(errs) => Err(errs.into_iter().map(|e| (e.path, e.message)).collect()),
        }
    }

    fn errors(e: &[(String, String)]) -> Vec<(&str, &str)> {
        e.iter().map(|(p, m)| (p.as_str(), m.as_str())).collect()
    }

    #[test]
    fn a_redis_url_gives_user_password_and_db() {
        let r = redis("address = \"redis://sluice:p%40ss@127.0.0.1:6380/3\"", &[]).unwrap();
        assert_eq!(r.address, SocketAddr::from(([127, 0, 0, 1], 6380)));
        assert_eq!(r.username.as_deref(), Some("sluice"));
        assert_eq!(r.password.as_deref(), Some("p@ss"));
        assert_eq!(r.db, 3);
        assert_eq!(r.cluster_seeds, None);
        assert!(!format!("{r:?}").contains("p@ss"), "{r:?}");
        // Port 6379 and database 0 unless said; a plain host:port as always.
        let r = redis("address = \"redis://127.0.0.1\"", &[]).unwrap();
        assert_eq!(
            (r.address.port(), r.db, r.username, r.password),
            (6379, 0, None, None)
        );
        let r = redis("address = \"127.0.0.1:7000\"\ndb = 2", &[]).unwrap();
        assert_eq!((r.address.port(), r.db), (7000, 2));
    }

    #[test]
    fn url_and_keys_may_say_the_same_thing_or_share_the_work() {
        // The user in the URL, the password from the environment (kept out of the file).
        let r = redis(
            "address = \"redis://sluice@127.0.0.1/1\"\npassword_env = \"PW\"",
            &[("PW", "from-env")],
        )
        .unwrap();
        assert_eq!(r.username.as_deref(), Some("sluice"));
        assert_eq!(r.password.as_deref(), Some("from-env"));
        assert_eq!(r.db, 1);
        // Each given twice, the same both times.
        let r = redis(
            "address = \"redis://u:same@127.0.0.1/4\"\nusername = \"u\"\n\
             password_env = \"PW\"\ndb = 4",
            &[("PW", "same")],
        )
        .unwrap();
        assert_eq!(
            (r.username.as_deref(), r.password.as_deref(), r.db),
            (Some("u"), Some("same"), 4)
        );
    }

    /// A setting given in the URL and by its own key, differently, is an error for each, all at
    /// once, and no message shows either password.
    #[test]
    fn url_and_keys_that_differ_are_errors() {
        let errs = redis(
            "address = \"redis://a:urlsecret1@127.0.0.1/2\"\nusername = \"b\"\n\
             password_env = \"PW\"\ndb = 3",
            &[("PW", "envsecret2")],
        )
        .unwrap_err();
        assert_eq!(
            errors(&errs),
            [
                (
                    "limits.redis.username",
                    "`b` differs from the user in address (`a`); give it in one place"
                ),
                (
                    "limits.redis.password_env",
                    "`PW` holds a different password than the one in address; give it in one \
                     place"
                ),
                (
                    "limits.redis.db",
                    "3 differs from the database in address (/2); give it in one place"
                ),
            ]
        );
        for (_, m) in &errs {
            assert!(
                !m.contains("urlsecret1") && !m.contains("envsecret2"),
                "{m}"
            );
        }
    }

    #[test]
    fn a_user_needs_a_password() {
        let need = "a user name needs a password (redis://user:password@host, or password_env): \
                    Redis's AUTH takes both, and without it the connection would be the default \
                    user's";
        let errs = redis("address = \"redis://sluice@127.0.0.1\"", &[]).unwrap_err();
        assert_eq!(errors(&errs), [("limits.redis.address", need)]);
        let errs = redis("address = \"127.0.0.1:6379\"\nusername = \"u\"", &[]).unwrap_err();
        assert_eq!(errors(&errs), [("limits.redis.username", need)]);
        // An unset variable is its own error, not this one too.
        let errs = redis(
            "address = \"redis://sluice@127.0.0.1\"\npassword_env = \"NOPE\"",
            &[],
        )
        .unwrap_err();
        assert_eq!(
            errors(&errs),
            [(
                "limits.redis.password_env",
                "environment variable `NOPE` is not set"
            )]
        );
    }

    #[test]
    fn bad_addresses_are_reported_without_their_password() {
        let errs = redis("address = \"rediss://u:tlssecret@127.0.0.1/1\"", &[]).unwrap_err();
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert_eq!(errs[0].0, "limits.redis.address");
        assert!(
            errs[0]
                .1
                .starts_with("TLS to Redis is not supported yet (`rediss://`)"),
            "{errs:?}"
        );
        let errs = redis(
            "address = \"redis://u:dnssecret@no-such-host.invalid:6379/1\"",
            &[],
        )
        .unwrap_err();
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert_eq!(errs[0].0, "limits.redis.address");
        assert!(
            errs[0]
                .1
                .starts_with("`no-such-host.invalid:6379` does not resolve"),
            "{errs:?}"
        );
        assert!(!errs[0].1.contains("dnssecret"), "{errs:?}");
    }

    #[test]
    fn cluster_seeds_take_urls_without_credentials_and_only_db_0() {
        let r = redis(
            "address = \"redis://:pw@127.0.0.1:7000\"\ncluster = true\n\
             seeds = [\"redis://127.0.0.1:7001\", \"127.0.0.1:7002\", \"redis://127.0.0.1:7003/0\"]",
            &[],
        )
        .unwrap();
        let ports: Vec<u16> = r.cluster_seeds.unwrap().iter().map(|a| a.port()).collect();
        assert_eq!(ports, [7000, 7001, 7002, 7003]);
        assert_eq!(r.password.as_deref(), Some("pw"));
        let errs = redis(
            "address = \"redis://127.0.0.1:7000/1\"\ncluster = true\n\
             seeds = [\"redis://:pw@127.0.0.1:7001\", \"redis://127.0.0.1:7002/2\", \
             \"rediss://127.0.0.1:7003\"]",
            &[],
        )
        .unwrap_err();
        let errs = errors(&errs);
        assert_eq!(errs.len(), 4, "{errs:?}");
        assert_eq!(
            errs[0],
            (
                "limits.redis.address",
                "a Redis Cluster has only database 0"
            )
        );
        assert_eq!(
            errs[1],
            (
                "limits.redis.seeds[0]",
                "a seed takes no user or password: every node is reached with address's (or \
                 username / password_env)"
            )
        );
        assert_eq!(
            errs[2],
            (
                "limits.redis.seeds[1]",
                "a Redis Cluster has only database 0"
            )
        );
        assert_eq!(errs[3].0, "limits.redis.seeds[2]");
        assert!(errs[3].1.starts_with("TLS to Redis is not supported yet"));
    }

    #[test]
    fn reservations() {
        let r = Reserve::default();
        assert_eq!(r.tokens(100, Some(50), None), 150);
        assert_eq!(r.tokens(100, Some(50), Some(3)), 250);
        assert_eq!(r.tokens(100, Some(1 << 40), None), 100 + 16_384);
        assert_eq!(r.tokens(100, None, None), 612);
    }
}
