//! What `torpor serve` records about its running nested host, so that the
//! next serve on the same data directory (after a restart, kill -9
//! included) re-attaches to it instead of booting another:
//! `DATA_DIR/nested-host.json` (written atomically, 0600): the QEMU process
//! (pid, start time, boot, command line: [`torpor_nested::HostRecord`]),
//! its forwarded ports and work directory, the pod's id here, its address
//! and the fingerprint of the TLS certificate it serves.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use torpor_nested::{AdoptError, HostRecord, RunningHost};
use torpor_scheduler::model::PodId;

/// The record's file in the data directory.
pub const RECORD_FILE: &str = "nested-host.json";
/// The running nested host's work directory (its images and console).
pub const WORK_DIR: &str = "nested-host";

/// A running nested host as recorded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Recorded {
    pub host: HostRecord,
    pub pod: PodId,
    /// `tls:127.0.0.1:PORT`.
    pub address: String,
    /// The SHA-256 fingerprint of the certificate the pod serves.
    pub fingerprint: String,
    /// The templates its script builds, `base` first (a record of an
    /// earlier serve has none: `base` alone).
    #[serde(default)]
    pub templates: Vec<String>,
}

impl Recorded {
    /// The templates the recorded host builds.
    pub fn templates(&self) -> Vec<String> {
        if self.templates.is_empty() {
            vec![super::nested_templates::BASE.to_string()]
        } else {
            self.templates.clone()
        }
    }
}

pub fn record_path(data_dir: &Path) -> PathBuf {
    data_dir.join(RECORD_FILE)
}

/// Writes the record (atomically, 0600).
pub fn write(data_dir: &Path, record: &Recorded) -> Result<(), String> {
    let path = record_path(data_dir);
    let json = serde_json::to_vec_pretty(record).map_err(|e| e.to_string())?;
    torpor_scheduler::files::atomic_write(&path, &json)
        .map_err(|e| format!("recording the nested host: {e}"))?;
    fs::set_permissions(&path, fs::Permissions::from_mode(0o600))
        .map_err(|e| format!("chmod {}: {e}", path.display()))
}

/// The record, if there is one; an unreadable one is said and dropped.
pub fn read(data_dir: &Path) -> Option<Recorded> {
    let path = record_path(data_dir);
    let text = fs::read_to_string(&path).ok()?;
    match serde_json::from_str(&text) {
        Ok(r) => Some(r),
        Err(e) => {
            eprintln!(
                "torpor serve: {} is not a nested host record ({e}); ignored",
                path.display()
            );
            remove(data_dir);
            None
        }
    }
}

/// Forgets the record (its host is gone).
pub fn remove(data_dir: &Path) {
    let _ = fs::remove_file(record_path(data_dir));
}

/// Why a recorded host is not re-attached.
#[derive(Debug, thiserror::Error)]
pub enum NotAdopted {
    #[error(transparent)]
    Host(#[from] AdoptError),
    #[error("it serves the certificate {recorded}, not this server's nested pod identity {ours}")]
    OtherIdentity { recorded: String, ours: String },
}

/// Re-attaches to the recorded host if it is still that QEMU and its pod
/// serves the certificate `ours` (the identity in DATA_DIR/nested-pod-tls).
/// A host of another identity is stopped (its pod could not be trusted).
pub fn adopt(record: &Recorded, ours: &str, echo: bool) -> Result<RunningHost, NotAdopted> {
    let mut host = RunningHost::adopt(&record.host, echo)?;
    if record.fingerprint != ours {
        host.kill();
        return Err(NotAdopted::OtherIdentity {
            recorded: record.fingerprint.clone(),
            ours: ours.to_string(),
        });
    }
    Ok(host)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Command, Stdio};
    use torpor_nested::{ProcessIdentity, CONSOLE_FILE};

    /// A record of a stand-in for QEMU (a shell waiting), and the child.
    fn recorded(dir: &Path) -> (Recorded, std::process::Child) {
        let work = dir.join(WORK_DIR);
        fs::create_dir_all(&work).unwrap();
        fs::write(work.join(CONSOLE_FILE), "L1 booted\n").unwrap();
        let child = Command::new("sh")
            .args(["-c", "while :; do sleep 1; done"])
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        let record = Recorded {
            host: HostRecord {
                process: ProcessIdentity::of(child.id()).unwrap(),
                forwards: vec![(7801, 41234)],
                work_dir: work,
            },
            pod: PodId::new("pod_0123456789abcdef"),
            address: "tls:127.0.0.1:41234".into(),
            fingerprint: "ab:cd".into(),
            templates: vec!["base".into(), "code-interpreter-v1".into()],
        };
        (record, child)
    }

    #[test]
    fn the_record_is_written_0600_read_back_and_removed() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read(dir.path()), None);
        let (record, mut child) = recorded(dir.path());
        write(dir.path(), &record).unwrap();
        let mode = fs::metadata(record_path(dir.path()))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        assert_eq!(read(dir.path()), Some(record.clone()));
        // An earlier serve's record (no templates): `base` alone.
        let mut json: serde_json::Value =
            serde_json::from_slice(&fs::read(record_path(dir.path())).unwrap()).unwrap();
        json.as_object_mut().unwrap().remove("templates");
        fs::write(record_path(dir.path()), json.to_string()).unwrap();
        assert_eq!(read(dir.path()).unwrap().templates(), ["base"]);
        remove(dir.path());
        assert_eq!(read(dir.path()), None);
        // A damaged record is dropped, not trusted.
        fs::write(record_path(dir.path()), "{\"host\":").unwrap();
        assert_eq!(read(dir.path()), None);
        assert!(!record_path(dir.path()).exists());
        let _ = child.kill();
        let _ = child.wait();
    }

    #[test]
    fn a_recorded_host_is_adopted_only_if_it_is_that_process_with_our_identity() {
        let dir = tempfile::tempdir().unwrap();
        let (record, mut child) = recorded(dir.path());
        let host = adopt(&record, "ab:cd", false).expect("the recorded host");
        assert_eq!(host.host_port(7801), Some(41234));
        drop(host);
        assert_eq!(record.host.process.check(), Ok(()), "left running");

        // Another process at that pid (here: another command line).
        let mut other = record.clone();
        other.host.process.cmdline = vec!["qemu-system-x86_64".into()];
        assert!(matches!(
            adopt(&other, "ab:cd", false),
            Err(NotAdopted::Host(_))
        ));
        assert_eq!(record.host.process.check(), Ok(()), "not ours to stop");

        // Our QEMU, but its pod serves another identity: stopped.
        let refused = adopt(&record, "ef:01", false).unwrap_err();
        assert!(
            matches!(refused, NotAdopted::OtherIdentity { .. }),
            "{refused}"
        );
        let _ = child.wait();
        assert!(record.host.process.check().is_err(), "still running");
        assert!(matches!(
            adopt(&record, "ab:cd", false),
            Err(NotAdopted::Host(AdoptError::NotRunning(_)))
        ));
    }
}
