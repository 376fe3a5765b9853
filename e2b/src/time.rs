//! RFC 3339 timestamps (E2B's `startedAt`, `endAt`, `timestamp`,
//! `startedAfter`) to and from torpor's [`Timestamp`] (ms since the epoch,
//! UTC). Days to civil dates by Howard Hinnant's algorithm.

use torpor_scheduler::model::Timestamp;

/// Days since 1970-01-01 to (year, month, day).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// (year, month, day) to days since 1970-01-01.
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// `2026-11-30T21:06:26.123Z`.
pub fn format(t: Timestamp) -> String {
    let ms = t.millis();
    let days = ms.div_euclid(86_400_000);
    let rest = ms.rem_euclid(86_400_000);
    let (y, mo, d) = civil_from_days(days);
    let (h, mi, s, milli) = (
        rest / 3_600_000,
        rest / 60_000 % 60,
        rest / 1000 % 60,
        rest % 1000,
    );
    format!("{y:04}-{mo:02}-{d:02}T{h:02}:{mi:02}:{s:02}.{milli:03}Z")
}

/// Parses `YYYY-MM-DDTHH:MM:SS[.fraction](Z|±HH:MM)` (`T` or a space).
pub fn parse(text: &str) -> Option<Timestamp> {
    let b = text.as_bytes();
    let num = |from: usize, len: usize| -> Option<i64> {
        let s = text.get(from..from + len)?;
        s.bytes()
            .all(|c| c.is_ascii_digit())
            .then(|| s.parse().ok())?
    };
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || !matches!(b[10], b'T' | b't' | b' ') {
        return None;
    }
    if b[13] != b':' || b[16] != b':' {
        return None;
    }
    let (y, mo, d) = (num(0, 4)?, num(5, 2)?, num(8, 2)?);
    let (h, mi, s) = (num(11, 2)?, num(14, 2)?, num(17, 2)?);
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || s > 60 {
        return None;
    }
    let mut i = 19;
    let mut millis = 0i64;
    if b.get(i) == Some(&b'.') {
        i += 1;
        let start = i;
        while b.get(i).is_some_and(u8::is_ascii_digit) {
            i += 1;
        }
        if i == start {
            return None;
        }
        let digits = &text[start..i.min(start + 3)];
        millis = digits.parse::<i64>().ok()? * 10i64.pow(3 - digits.len() as u32);
    }
    let offset_min = match &text[i..] {
        "Z" | "z" => 0,
        tz if tz.len() == 6
            && matches!(tz.as_bytes()[0], b'+' | b'-')
            && tz.as_bytes()[3] == b':' =>
        {
            let (oh, om) = (num(i + 1, 2)?, num(i + 4, 2)?);
            let sign = if tz.starts_with('-') { -1 } else { 1 };
            sign * (oh * 60 + om)
        }
        _ => return None,
    };
    let days = days_from_civil(y, mo as u32, d as u32);
    let secs = days * 86_400 + h * 3600 + mi * 60 + s - offset_min * 60;
    Some(Timestamp(secs * 1000 + millis))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_and_parses_round_trip() {
        assert_eq!(format(Timestamp(0)), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            format(Timestamp(1_796_159_186_123)),
            "2026-12-01T21:06:26.123Z"
        );
        assert_eq!(
            format(Timestamp(951_782_400_000)),
            "2000-02-29T00:00:00.000Z"
        );
        for ms in [
            0,
            1,
            951_782_400_000,
            1_796_159_186_123,
            253_402_300_799_999,
        ] {
            assert_eq!(parse(&format(Timestamp(ms))), Some(Timestamp(ms)), "{ms}");
        }
        assert_eq!(
            parse("2026-12-01T23:06:26.5+02:00"),
            Some(Timestamp(1_796_159_186_500))
        );
        assert_eq!(
            parse("2026-12-01T21:06:26.123456Z"),
            Some(Timestamp(1_796_159_186_123))
        );
        assert_eq!(
            parse("2026-12-01 16:06:26-05:00"),
            parse("2026-12-01T21:06:26Z")
        );
        for bad in [
            "",
            "2026-12-01",
            "2026-13-01T00:00:00Z",
            "2026-12-01T24:00:00Z",
            "2026-12-01T00:00:00",
            "2026-12-01T00:00:00.Z",
            "2026-12-01T00:00:00+0200",
            "2026-12-01T00:00:00Zjunk",
            "+026-12-01T00:00:00Z",
        ] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
    }
}
