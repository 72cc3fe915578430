//! The kinds of limit a rule may hold, beside its first token bucket.
//!
//! Owns [`LimitKind`] (a token bucket, a quota of requests per window, or
//! a number of requests in flight at once)
//! and [`Window`] (a calendar minute, hour, day or month, or a fixed
//! window of any length, all on UTC boundaries), with the arithmetic the
//! gateway needs of them: when a window ends, and how a window is named in
//! the rules, in `RateLimit-Policy` and to the Redis script. The script
//! computes window ends itself from Redis's clock; [`Window::end_ms`] is
//! the same arithmetic for the in-memory store of the tests.

use std::num::NonZeroU32;

/// Most limits in force for one request: a route rule's and the tenant's
/// tenant-wide rule's together.
pub const MAX_LIMITS: usize = 8;

/// Milliseconds in a day.
const DAY_MS: u64 = 86_400_000;

/// The window of a quota.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Window {
    /// A calendar minute.
    Minute,
    /// A calendar hour (UTC).
    Hour,
    /// A calendar day (UTC).
    Day,
    /// A calendar month (UTC).
    Month,
    /// A fixed window of this many seconds, counted from the Unix epoch.
    Seconds(NonZeroU32),
}

impl Window {
    /// Reads `minute`, `hour`, `day` or `month`.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "minute" => Some(Self::Minute),
            "hour" => Some(Self::Hour),
            "day" => Some(Self::Day),
            "month" => Some(Self::Month),
            _ => None,
        }
    }

    /// The calendar name, or `None` for a window given in seconds.
    pub fn name(self) -> Option<&'static str> {
        match self {
            Self::Minute => Some("minute"),
            Self::Hour => Some("hour"),
            Self::Day => Some("day"),
            Self::Month => Some("month"),
            Self::Seconds(_) => None,
        }
    }

    /// How the Redis script names the window: `m`, `h`, `d`, `M`, or `s`
    /// followed by the seconds.
    pub fn script_code(self) -> String {
        match self {
            Self::Minute => "m".to_owned(),
            Self::Hour => "h".to_owned(),
            Self::Day => "d".to_owned(),
            Self::Month => "M".to_owned(),
            Self::Seconds(s) => format!("s{s}"),
        }
    }

    /// The window's length in seconds, for `RateLimit-Policy`'s `w` (a
    /// month counts 30 days).
    pub fn nominal_seconds(self) -> u64 {
        match self {
            Self::Minute => 60,
            Self::Hour => 3_600,
            Self::Day => 86_400,
            Self::Month => 30 * 86_400,
            Self::Seconds(s) => u64::from(s.get()),
        }
    }

    /// When the window holding `now_ms` (Unix milliseconds) ends.
    pub fn end_ms(self, now_ms: u64) -> u64 {
        let fixed = |len: u64| (now_ms / len + 1) * len;
        match self {
            Self::Minute => fixed(60_000),
            Self::Hour => fixed(3_600_000),
            Self::Day => fixed(DAY_MS),
            Self::Seconds(s) => fixed(u64::from(s.get()) * 1000),
            Self::Month => {
                let (year, month) = civil_month(now_ms / DAY_MS);
                let (year, month) = if month == 12 {
                    (year + 1, 1)
                } else {
                    (year, month + 1)
                };
                days_from_civil(year, month) * DAY_MS
            }
        }
    }
}

/// The year and month (1–12) of `days` since 1970-01-01.
fn civil_month(days: u64) -> (u64, u64) {
    // Days since 0000-03-01, in 400-year eras (the proleptic Gregorian
    // calendar repeats every 146,097 days).
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month)
}

/// Days since 1970-01-01 of the first day of `month` (1–12) in `year`
/// (at least 1970).
fn days_from_civil(year: u64, month: u64) -> u64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y / 400;
    let yoe = y - era * 400;
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// One limit of a rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitKind {
    /// A token bucket.
    Bucket {
        /// Burst size in tokens.
        capacity: NonZeroU32,
        /// Tokens added per second.
        refill_per_second: NonZeroU32,
    },
    /// At most `quota` requests (of cost 1) per window.
    Quota {
        /// Requests per window.
        quota: NonZeroU32,
        /// The window.
        window: Window,
    },
    /// At most `slots` requests in flight at once, across the cluster.
    Concurrent {
        /// Requests in flight at most.
        slots: NonZeroU32,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Unix milliseconds of a UTC date and time.
    fn at(year: u64, month: u64, day: u64, hour: u64) -> u64 {
        (days_from_civil(year, month) + day - 1) * DAY_MS + hour * 3_600_000
    }

    #[test]
    fn calendar_dates_round_trip() {
        assert_eq!(days_from_civil(1970, 1), 0);
        assert_eq!(days_from_civil(2000, 3), 11_017);
        for days in [0, 59, 60, 365, 11_016, 11_017, 19_000, 20_423, 30_000] {
            let (year, month) = civil_month(days);
            let first = days_from_civil(year, month);
            assert!(first <= days && days - first < 31, "{days}: {year}-{month}");
        }
    }

    #[test]
    fn windows_end_on_utc_boundaries() {
        let t = at(2026, 12, 1, 5) + 61_500;
        assert_eq!(Window::Minute.end_ms(t), at(2026, 12, 1, 5) + 120_000);
        assert_eq!(Window::Hour.end_ms(t), at(2026, 12, 1, 6));
        assert_eq!(Window::Day.end_ms(t), at(2026, 12, 2, 0));
        assert_eq!(Window::Month.end_ms(t), at(2027, 1, 1, 0));
        assert_eq!(Window::Month.end_ms(at(2028, 2, 29, 23)), at(2028, 3, 1, 0));
        assert_eq!(Window::Month.end_ms(at(2026, 1, 31, 0)), at(2026, 2, 1, 0));
        let thirty = Window::Seconds(NonZeroU32::new(30).unwrap());
        assert_eq!(thirty.end_ms(29_999), 30_000);
        assert_eq!(thirty.end_ms(30_000), 60_000);
    }
}
