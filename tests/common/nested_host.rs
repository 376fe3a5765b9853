//! What stops the nested host `torpor serve` leaves running in its data
//! directory (by design: a restarted serve re-attaches to it) when a test
//! or a bench ends; on its own, so that the benches include it too.

/// Stops the nested host serve left running in DATA_DIR (its record names
/// the QEMU) when the test ends, whatever happened.
pub struct StopNestedHost(pub std::path::PathBuf);

impl Drop for StopNestedHost {
    fn drop(&mut self) {
        let Ok(text) = std::fs::read_to_string(self.0.join("nested-host.json")) else {
            return;
        };
        let record: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
        let Some(pid) = record["host"]["process"]["pid"].as_u64() else {
            return;
        };
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).contains("qemu") {
            // SAFETY: kill(2) of the test's own nested host's QEMU.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        }
    }
}
