//! The small readers and checks the resolvers share: datetimes, periods, digests, ids.

use std::collections::BTreeMap;

use super::snapshot::Period;

/// Unix seconds of a TOML datetime with a date, a time and an offset.
pub(super) fn unix_seconds(dt: &toml::value::Datetime) -> Result<u64, String> {
    let (Some(date), Some(time)) = (dt.date, dt.time) else {
        return Err(format!(
            "`{dt}` needs a date and a time, like 2027-01-01T00:00:00Z"
        ));
    };
    let offset_minutes: i64 = match dt.offset {
        Some(toml::value::Offset::Z) => 0,
        Some(toml::value::Offset::Custom { minutes }) => i64::from(minutes),
        None => {
            return Err(format!(
                "`{dt}` needs a UTC offset, like 2027-01-01T00:00:00Z"
            ))
        }
    };
    let days = days_from_civil(
        i64::from(date.year),
        u32::from(date.month),
        u32::from(date.day),
    );
    let secs = days * 86_400
        + i64::from(time.hour) * 3600
        + i64::from(time.minute) * 60
        + i64::from(time.second)
        - offset_minutes * 60;
    u64::try_from(secs).map_err(|_| format!("`{dt}` is before 1970"))
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
pub(crate) fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// (year, month) of a day count since 1970-01-01.
pub(crate) fn civil_year_month(days: i64) -> (i64, u32) {
    let z = days + 719_468;
    let era = if z >= 0 { z } else { z - 146_096 } / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m)
}

pub(super) fn parse_period(s: &str) -> Result<Period, String> {
    match s {
        "once" => Ok(Period::Once),
        "monthly" => Ok(Period::Monthly),
        _ => s
            .strip_suffix('d')
            .and_then(|n| n.parse::<u32>().ok())
            .filter(|n| (1..=3660).contains(n))
            .map(Period::Days)
            .ok_or_else(|| format!("`{s}` is not \"once\", \"monthly\" or \"<N>d\" (N ≥ 1)")),
    }
}

pub(super) fn parse_digest(s: &str) -> Option<[u8; 32]> {
    decode_hex(s)?.try_into().ok()
}

/// Lower- or upper-case hex to bytes; `None` when it is not hex (digits only: no sign).
pub(crate) fn decode_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    s.as_bytes()
        .chunks(2)
        .map(|p| Some(digit(p[0])? << 4 | digit(p[1])?))
        .collect()
}

/// Ids end up in Redis keys, metric labels and log lines: keep them plain.
pub(super) fn check_id(s: &str) -> Result<(), String> {
    if s.is_empty() || s.len() > 64 {
        return Err("must be 1 to 64 characters".into());
    }
    if !s
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    {
        return Err(format!(
            "`{s}` may only hold letters, digits, `-`, `_` and `.`"
        ));
    }
    Ok(())
}

/// Check an id (see [`check_id`]) and that no earlier entry of its list, whose ids are in
/// `seen`, has it; `duplicate` words that error, given the earlier entry's index.
pub(super) fn check_unique_id(
    id: &str,
    index: usize,
    seen: &mut BTreeMap<String, usize>,
    path: &str,
    err: &mut dyn FnMut(String, String),
    duplicate: impl FnOnce(usize) -> String,
) {
    if let Err(e) = check_id(id) {
        err(format!("{path}.id"), e);
    }
    if let Some(prev) = seen.insert(id.to_string(), index) {
        err(format!("{path}.id"), duplicate(prev));
    }
}
