//! Facts about the host both sides need.

/// Total host RAM in bytes (`MemTotal` of `/proc/meminfo`), read once per
/// process.
pub fn memory_bytes() -> std::io::Result<u64> {
    static HOST_BYTES: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    if let Some(&bytes) = HOST_BYTES.get() {
        return Ok(bytes);
    }
    let meminfo = std::fs::read_to_string("/proc/meminfo")?;
    let bytes = parse_mem_total(&meminfo).ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "no MemTotal in /proc/meminfo",
        )
    })?;
    Ok(*HOST_BYTES.get_or_init(|| bytes))
}

fn parse_mem_total(meminfo: &str) -> Option<u64> {
    kib_field(meminfo, "MemTotal")?.checked_mul(1024)
}

/// The number of a `Key:   N kB` line of a /proc file (`/proc/meminfo`,
/// `/proc/PID/status`, `smaps_rollup`): kB for sizes, a count for the
/// few fields without a unit (`HugePages_*`). The one parser of them.
pub fn kib_field(text: &str, key: &str) -> Option<u64> {
    let mut lines = text.lines();
    let value = lines.find_map(|l| l.strip_prefix(key)?.strip_prefix(':'));
    value?.split_whitespace().next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_total_is_parsed_and_bounded() {
        assert_eq!(
            parse_mem_total("MemFree: 1 kB\nMemTotal:  2048 kB\n"),
            Some(2 << 20)
        );
        assert_eq!(parse_mem_total("MemFree: 1 kB\n"), None);
        assert_eq!(parse_mem_total("MemTotal: 99999999999999999999 kB"), None);
        assert!(memory_bytes().unwrap() > 0);
    }

    #[test]
    fn kib_fields_match_whole_keys() {
        let text = "Rss:  12 kB\nPss:   7 kB\nPss_Anon: 3 kB\nHugePages_Total:  4\n";
        assert_eq!(kib_field(text, "Pss"), Some(7));
        assert_eq!(kib_field(text, "Pss_Anon"), Some(3));
        assert_eq!(kib_field(text, "HugePages_Total"), Some(4));
        assert_eq!(kib_field(text, "Ps"), None);
        assert_eq!(kib_field("Pss: lots kB\n", "Pss"), None);
    }
}
