//! What each event costs on a host: create, wake and hibernate latencies,
//! snapshot size per dirty MiB, the disk's write bandwidth (which the
//! snapshot writes of concurrent hibernations share) and a fresh
//! sandbox's memory. Measured by
//! `torpor plan calibrate` with real VMMs (through a live `torpor serve`),
//! stored as JSON; or the built-in default, clearly labelled as such.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// File name of a calibration in the data directory.
pub const FILE_NAME: &str = "plan-calibration.json";
/// Largest calibration file read.
const MAX_FILE: u64 = 64 * 1024;
/// Largest latency a calibration may state: 10 minutes.
const MAX_MS: f64 = 600_000.0;
/// Most wake samples a calibration keeps.
pub const MAX_SPREAD: usize = 1000;
/// The built-in disk write bandwidth (MiB/s): the rate the built-in
/// hibernation figures imply (1 ms more per dirty MiB, a MiB of snapshot
/// per dirty MiB), a local NVMe disk's. A network volume gives far less
/// (a cloud disk's baseline may be 125-250 MiB/s): measure it, or give
/// it to `torpor plan --disk-mib-s`.
pub const BUILTIN_DISK_WRITE_MIB_S: f64 = 1000.0;
/// Largest disk write bandwidth a calibration may state (MiB/s).
pub const MAX_DISK_WRITE_MIB_S: f64 = 1e6;

/// The costs a plan charges, and where they come from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Calibration {
    /// `builtin` or `measured`.
    pub source: String,
    /// What was measured, on what (free text shown in the plan).
    pub description: String,
    /// When it was measured (ms since the epoch; 0 for the built-in).
    pub measured_at_ms: i64,
    /// Samples per figure.
    pub samples: u32,
    /// Create, as the API answers it: admission to running (p50, ms).
    pub create_ms: f64,
    /// Wake of a hibernated sandbox, as a request sees it (p50, ms).
    pub wake_ms: f64,
    /// Every wake measured, sorted (ms; at most [`MAX_SPREAD`]): the plan
    /// charges wakes across this spread rather than the median alone.
    /// Empty: every wake costs `wake_ms`.
    #[serde(default)]
    pub wake_ms_spread: Vec<f64>,
    /// Hibernation of a sandbox that dirtied nothing since its last
    /// snapshot (p50, ms).
    pub hibernate_ms: f64,
    /// Extra hibernation time per dirty MiB (ms).
    pub hibernate_ms_per_dirty_mib: f64,
    /// Bytes on disk of a snapshot that holds no dirty page.
    pub snapshot_base_bytes: f64,
    /// Extra snapshot bytes per dirty MiB.
    pub snapshot_bytes_per_dirty_mib: f64,
    /// Memory (PSS, MiB) of a sandbox that has just been created or woken.
    pub fresh_pss_mib: f64,
    /// How long (ms) a created or woken sandbox takes to hold
    /// `fresh_pss_mib`: a restored guest gets its memory back as it
    /// touches it (a guest that works on its memory all the time, within a
    /// second or so). Until then it holds `restored_pss_mib`. 0 (a
    /// calibration stored before it was measured): at once.
    #[serde(default)]
    pub touch_ms: f64,
    /// Memory (MiB) a sandbox holds right after its create or wake answers,
    /// before `touch_ms` (at most `fresh_pss_mib`).
    #[serde(default)]
    pub restored_pss_mib: f64,
    /// The pod's disk write bandwidth (MiB/s) that hibernations' snapshot
    /// writes share. A calibration stored before it was measured reads
    /// as [`BUILTIN_DISK_WRITE_MIB_S`].
    #[serde(default = "builtin_disk_write_mib_s")]
    pub disk_write_mib_s: f64,
}

fn builtin_disk_write_mib_s() -> f64 {
    BUILTIN_DISK_WRITE_MIB_S
}

/// A calibration that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CalibrationError {
    #[error("cannot read calibration {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("calibration {path} is larger than {MAX_FILE} bytes")]
    TooLarge { path: String },
    #[error("calibration {path} is not valid: {message}")]
    Invalid { path: String, message: String },
}

impl Calibration {
    /// The built-in default: figures from the API benchmark's first run
    /// (docs/history.md, "API latency and density": 256 MiB probe template,
    /// shared 2-core PVM host: create 4.5 ms, wake 6 ms without a standby
    /// shell) and a 1:1 snapshot of dirty pages. Plans made with it say so.
    pub fn builtin() -> Calibration {
        Calibration {
            source: "builtin".into(),
            description: "built-in default (docs/history.md API benchmark figures, probe guest, \
                          2-core PVM host); run `torpor plan calibrate` for this host's"
                .into(),
            measured_at_ms: 0,
            samples: 0,
            create_ms: 4.5,
            wake_ms: 6.0,
            wake_ms_spread: Vec::new(),
            hibernate_ms: 15.0,
            hibernate_ms_per_dirty_mib: 1.0,
            snapshot_base_bytes: 64.0 * 1024.0,
            snapshot_bytes_per_dirty_mib: 1048576.0,
            fresh_pss_mib: 1.0,
            touch_ms: 0.0,
            restored_pss_mib: 1.0,
            disk_write_mib_s: BUILTIN_DISK_WRITE_MIB_S,
        }
    }

    /// Checks every figure is finite and in bounds.
    pub fn validate(&self) -> Result<(), String> {
        if self.source.len() > 64 || self.description.len() > 1024 {
            return Err("source or description too long".into());
        }
        for (name, v, max) in [
            ("create_ms", self.create_ms, MAX_MS),
            ("wake_ms", self.wake_ms, MAX_MS),
            ("hibernate_ms", self.hibernate_ms, MAX_MS),
            (
                "hibernate_ms_per_dirty_mib",
                self.hibernate_ms_per_dirty_mib,
                1000.0,
            ),
            ("snapshot_base_bytes", self.snapshot_base_bytes, 1e12),
            (
                "snapshot_bytes_per_dirty_mib",
                self.snapshot_bytes_per_dirty_mib,
                16.0 * 1048576.0,
            ),
            ("fresh_pss_mib", self.fresh_pss_mib, 1e6),
            ("touch_ms", self.touch_ms, MAX_MS),
            ("restored_pss_mib", self.restored_pss_mib, 1e6),
        ] {
            if !v.is_finite() || !(0.0..=max).contains(&v) {
                return Err(format!("{name} {v} is outside [0, {max}]"));
            }
        }
        let disk = self.disk_write_mib_s;
        if !disk.is_finite() || disk <= 0.0 || disk > MAX_DISK_WRITE_MIB_S {
            return Err(format!(
                "disk_write_mib_s {disk} is outside (0, {MAX_DISK_WRITE_MIB_S}]"
            ));
        }
        if self.wake_ms_spread.len() > MAX_SPREAD {
            return Err(format!("more than {MAX_SPREAD} wake samples"));
        }
        if let Some(v) = self
            .wake_ms_spread
            .iter()
            .find(|v| !v.is_finite() || !(0.0..=MAX_MS).contains(*v))
        {
            return Err(format!("wake sample {v} is outside [0, {MAX_MS}]"));
        }
        if !self.wake_ms_spread.is_sorted_by(|a, b| a <= b) {
            return Err("wake samples are not sorted".into());
        }
        Ok(())
    }

    /// Reads a stored calibration.
    pub fn load(path: &Path) -> Result<Calibration, CalibrationError> {
        use std::io::Read;
        let shown = path.display().to_string();
        let io = |source| CalibrationError::Io {
            path: shown.clone(),
            source,
        };
        let mut text = String::new();
        std::fs::File::open(path)
            .map_err(io)?
            .take(MAX_FILE + 1)
            .read_to_string(&mut text)
            .map_err(io)?;
        if text.len() as u64 > MAX_FILE {
            return Err(CalibrationError::TooLarge { path: shown });
        }
        let invalid = |message: String| CalibrationError::Invalid {
            path: shown.clone(),
            message,
        };
        let c: Calibration = serde_json::from_str(&text).map_err(|e| invalid(e.to_string()))?;
        c.validate().map_err(invalid)?;
        Ok(c)
    }

    /// Writes it (atomically: a temp file renamed over the target).
    pub fn store(&self, path: &Path) -> std::io::Result<()> {
        let text = serde_json::to_string_pretty(self).map_err(std::io::Error::other)?;
        crate::files::atomic_write(path, text.as_bytes()).map_err(std::io::Error::other)
    }

    /// The cost of the `n`th wake (ms): `wake_ms`, or, with a spread, its
    /// samples visited in a fixed low-discrepancy order (deterministic,
    /// every part of the spread in proportion).
    pub fn wake_cost_ms(&self, n: u64) -> f64 {
        if self.wake_ms_spread.is_empty() {
            return self.wake_ms;
        }
        // The golden ratio's fractional parts fill [0, 1) evenly.
        let x = (n as f64 * 0.618_033_988_749_895).fract();
        let i =
            ((x * self.wake_ms_spread.len() as f64) as usize).min(self.wake_ms_spread.len() - 1);
        self.wake_ms_spread[i]
    }

    /// Hibernation time of a sandbox with `dirty_mib` dirty, in ms.
    pub fn hibernate_cost_ms(&self, dirty_mib: f64) -> f64 {
        self.hibernate_ms + self.hibernate_ms_per_dirty_mib * dirty_mib
    }

    /// Snapshot bytes of a sandbox with `dirty_mib` dirty.
    pub fn snapshot_bytes(&self, dirty_mib: f64) -> f64 {
        self.snapshot_base_bytes + self.snapshot_bytes_per_dirty_mib * dirty_mib
    }

    /// Bytes the disk writes per ms.
    pub fn disk_bytes_per_ms(&self) -> f64 {
        self.disk_write_mib_s * 1048576.0 / 1000.0
    }
}

/// The disk write bandwidth (MiB/s) hibernations timed show: the extra
/// snapshot bytes a dirty MiB costs over the extra hibernation time it
/// costs (the marginal rate: a hibernation's fixed part is not the
/// disk's; `bytes_per_dirty_mib` over `ms_per_dirty_mib`); when that
/// time is not measurably positive, `bytes` over `ms`, the dirtying
/// hibernations' whole snapshots over their whole time (a lower bound).
/// Within (0, [`MAX_DISK_WRITE_MIB_S`]]; `None` when neither is usable.
pub fn measured_disk_write_mib_s(
    bytes_per_dirty_mib: f64,
    ms_per_dirty_mib: f64,
    bytes: f64,
    ms: f64,
) -> Option<f64> {
    let rate = |b: f64, t: f64| {
        let r = b / 1048576.0 / (t / 1000.0);
        (b > 0.0 && t > 0.0 && r.is_finite()).then(|| r.min(MAX_DISK_WRITE_MIB_S))
    };
    // Under a microsecond per MiB is noise, not a measured write.
    if ms_per_dirty_mib > 0.001 {
        if let Some(r) = rate(bytes_per_dirty_mib, ms_per_dirty_mib) {
            return Some(r);
        }
    }
    rate(bytes, ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_is_valid_and_round_trips() {
        let c = Calibration::builtin();
        c.validate().unwrap();
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path().to_path_buf();
        let p = dir.join(FILE_NAME);
        c.store(&p).unwrap();
        assert_eq!(Calibration::load(&p).unwrap(), c);
        let mut bad = c.clone();
        bad.wake_ms = f64::NAN;
        assert!(bad.validate().is_err());
        bad.wake_ms = -1.0;
        assert!(bad.validate().is_err());
        bad.wake_ms = 6.0;
        bad.wake_ms_spread = vec![2.0, 1.0];
        assert!(bad.validate().is_err(), "unsorted");
        bad.wake_ms_spread = vec![1.0, f64::INFINITY];
        assert!(bad.validate().is_err());
        bad.wake_ms_spread = Vec::new();
        bad.disk_write_mib_s = 0.0;
        assert!(bad.validate().is_err(), "no disk");
        // A calibration stored before the disk was measured: the built-in.
        let mut old: serde_json::Value = serde_json::to_value(&c).unwrap();
        old.as_object_mut().unwrap().remove("disk_write_mib_s");
        std::fs::write(&p, old.to_string()).unwrap();
        assert_eq!(
            Calibration::load(&p).unwrap().disk_write_mib_s,
            BUILTIN_DISK_WRITE_MIB_S
        );
        // Measured: the marginal rate, else the whole one.
        let mib = 1048576.0;
        assert_eq!(measured_disk_write_mib_s(mib, 2.0, 0.0, 0.0), Some(500.0));
        assert_eq!(
            measured_disk_write_mib_s(mib, 0.0, 64.0 * mib, 400.0),
            Some(160.0)
        );
        assert_eq!(measured_disk_write_mib_s(0.0, 0.0, 0.0, 0.0), None);
        // A spread is visited evenly: 1000 wakes over 4 samples.
        let mut c = Calibration::builtin();
        assert_eq!(c.wake_cost_ms(7), c.wake_ms);
        c.wake_ms_spread = vec![1.0, 2.0, 3.0, 40.0];
        let costs: Vec<f64> = (0..1000).map(|n| c.wake_cost_ms(n)).collect();
        let slow = costs.iter().filter(|&&v| v == 40.0).count();
        assert!((230..=270).contains(&slow), "{slow}");
        std::fs::write(&p, r#"{"source":"x"}"#).unwrap();
        assert!(matches!(
            Calibration::load(&p),
            Err(CalibrationError::Invalid { .. })
        ));
    }
}
