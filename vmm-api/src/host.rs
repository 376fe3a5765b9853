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
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
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
}
