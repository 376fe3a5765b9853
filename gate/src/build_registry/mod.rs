//! The registry of template builds ([`crate::builds`] runs them): every
//! build's record (status, the step it is on, its log, why it failed),
//! written to the builds directory as it changes, so a restart keeps them
//! (a build a restart interrupted reads as failed); the uploaded files
//! (`files`); what templates from images are provisioned with ([`Guest`]).
//! Below the tenancy state, which holds it, and the executor, which uses
//! it.

pub mod files;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use torpor_scheduler::model::Timestamp;
use torpor_sync::Locked;

use crate::service::{Cancel, ServiceError};

/// Most log entries a build keeps (older ones are dropped, counted).
pub const MAX_LOG_ENTRIES: usize = 10_000;
/// Longest log line kept (bytes; longer ones are cut).
const MAX_LINE: usize = 4096;

/// Where a build is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum BuildStatus {
    /// Accepted, not started (E2B: waiting for its files).
    Waiting,
    Building,
    Ready,
    Error,
    Cancelled,
}

impl BuildStatus {
    pub fn finished(self) -> bool {
        matches!(self, Self::Ready | Self::Error | Self::Cancelled)
    }
}

/// A log entry's level.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Level {
    Debug,
    Info,
    Warn,
    Error,
}

/// One line of a build's log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct LogEntry {
    #[schema(value_type = i64)]
    pub at: Timestamp,
    pub level: Level,
    pub message: String,
}

/// Why a build failed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Failure {
    pub message: String,
    /// The failed step's index (0-based, in the build's steps; the start
    /// command is the one after the last), if a step failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<usize>,
    /// The failed step as the logs name it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instruction: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// The end of the step's output.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub output_tail: String,
}

/// The step a build is on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Progress {
    /// 0-based.
    pub index: usize,
    pub total: usize,
    pub label: String,
    /// Served from the cache.
    pub cached: bool,
}

/// A build's record (`GET /v1/templates/builds/{id}`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct BuildRecord {
    pub id: String,
    /// The tenant whose build it is (none: an admin's, shared).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// The template it makes.
    pub name: String,
    /// E2B's tags of the build (`default` when none was asked for).
    #[serde(default)]
    pub tags: Vec<String>,
    /// vCPUs and memory (MiB) asked for its template (E2B's build
    /// request), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_count: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u32>,
    /// The build's spec, without credentials, once given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub spec: Option<serde_json::Value>,
    /// The user, directory and variables after its last step: where a
    /// build from its template starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub last_env: Option<torpor_build::env::Environment>,
    pub status: BuildStatus,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<Progress>,
    /// Steps served from the cache / run.
    pub cached_steps: usize,
    pub run_steps: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<Failure>,
    /// The template made, once ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template_id: Option<String>,
    #[schema(value_type = i64)]
    pub created_at: Timestamp,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<i64>)]
    pub finished_at: Option<Timestamp>,
    /// Log entries dropped from the front ([`MAX_LOG_ENTRIES`]).
    pub logs_dropped: usize,
    pub logs: Vec<LogEntry>,
}

/// A build in this server: its record and what cancels it.
#[derive(Debug)]
pub struct Build {
    record: Mutex<BuildRecord>,
    pub cancel: Cancel,
    file: Option<PathBuf>,
}

impl Build {
    /// A copy of its record.
    pub fn record(&self) -> BuildRecord {
        self.record.locked().clone()
    }

    /// Changes its record and writes it down.
    pub fn update(&self, f: impl FnOnce(&mut BuildRecord)) {
        let snapshot = {
            let mut r = self.record.locked();
            f(&mut r);
            r.clone()
        };
        self.save(&snapshot);
    }

    /// Takes a waiting build for starting: true once, for the first caller
    /// (it is building from then on); false when it is not waiting.
    pub fn claim(&self) -> bool {
        let snapshot = {
            let mut r = self.record.locked();
            if r.status != BuildStatus::Waiting {
                return false;
            }
            r.status = BuildStatus::Building;
            r.clone()
        };
        self.save(&snapshot);
        true
    }

    /// Ends it failed before it started (its spec or source refused).
    pub fn fail(&self, message: &str) {
        self.log(Level::Error, message);
        self.update(|r| {
            r.status = BuildStatus::Error;
            r.finished_at = Some(Timestamp::now());
            r.failure = Some(Failure {
                message: message.to_string(),
                step: None,
                instruction: None,
                exit_code: None,
                output_tail: String::new(),
            });
        });
    }

    /// Adds a log line (cut at [`MAX_LINE`] bytes); not written down at
    /// once: the next [`Self::update`] writes it.
    pub fn log(&self, level: Level, message: impl Into<String>) {
        let mut message: String = message.into();
        if message.len() > MAX_LINE {
            let mut cut = MAX_LINE;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
        }
        let mut r = self.record.locked();
        r.logs.push(LogEntry {
            at: Timestamp::now(),
            level,
            message,
        });
        if r.logs.len() > MAX_LOG_ENTRIES {
            let excess = r.logs.len() - MAX_LOG_ENTRIES;
            r.logs.drain(..excess);
            r.logs_dropped += excess;
        }
    }

    fn save(&self, record: &BuildRecord) {
        let Some(file) = &self.file else { return };
        let tmp = file.with_extension("json.tmp");
        let written = serde_json::to_vec(record)
            .map_err(std::io::Error::other)
            .and_then(|bytes| std::fs::write(&tmp, bytes))
            .and_then(|()| std::fs::rename(&tmp, file));
        if let Err(e) = written {
            tracing::warn!(build = %record.id, "cannot write the build's record: {e}");
        }
    }
}

/// A random (version 4) UUID.
pub fn uuid() -> String {
    let h = torpor_scheduler::random::random_hex(16).into_bytes();
    let mut b: Vec<char> = h.iter().map(|&c| c as char).collect();
    b[12] = '4';
    b[16] = ['8', '9', 'a', 'b'][usize::from(h[16]) % 4];
    let s: String = b.into_iter().collect();
    format!(
        "{}-{}-{}-{}-{}",
        &s[..8],
        &s[8..12],
        &s[12..16],
        &s[16..20],
        &s[20..]
    )
}

/// Every build of this server, by id.
#[derive(Debug)]
pub struct Builds {
    dir: Option<PathBuf>,
    /// The builds directory, or one of this process's under the system's
    /// temporary directory: builds from images keep their scratch
    /// directories (`work/<build>/`) and what image sources resolved to
    /// (`images/`) there.
    pub(crate) root: PathBuf,
    all: Mutex<HashMap<String, Arc<Build>>>,
    /// Uploaded build files (COPY's tars, images' archives).
    pub files: files::Files,
    /// What templates made from images are provisioned with.
    pub(crate) guest: Guest,
    /// The image sources being made into templates ([`image`]).
    pub(crate) making: Mutex<HashSet<String>>,
}

impl Builds {
    /// The builds kept under `dir` (`None`: in memory only, uploads in a
    /// temporary directory): records found there are loaded, and those a
    /// restart interrupted marked failed.
    pub fn open(dir: Option<&Path>) -> Result<Self, ServiceError> {
        let mut all = HashMap::new();
        if let Some(dir) = dir {
            std::fs::create_dir_all(dir.join("records")).map_err(files::io)?;
            for entry in std::fs::read_dir(dir.join("records"))
                .map_err(files::io)?
                .flatten()
            {
                let path = entry.path();
                if path.extension().and_then(|e| e.to_str()) != Some("json") {
                    continue;
                }
                let Ok(mut record) =
                    std::fs::read(&path)
                        .map_err(|e| e.to_string())
                        .and_then(|b| {
                            serde_json::from_slice::<BuildRecord>(&b).map_err(|e| e.to_string())
                        })
                else {
                    tracing::warn!(path = %path.display(), "an unreadable build record: skipped");
                    continue;
                };
                let interrupted = !record.status.finished();
                if interrupted {
                    record.status = BuildStatus::Error;
                    record.finished_at = Some(Timestamp::now());
                    record.failure = Some(Failure {
                        message: "the server restarted during the build".into(),
                        step: record.step.as_ref().map(|s| s.index),
                        instruction: record.step.as_ref().map(|s| s.label.clone()),
                        exit_code: None,
                        output_tail: String::new(),
                    });
                }
                let build = Build {
                    record: Mutex::new(record.clone()),
                    cancel: Cancel::default(),
                    file: Some(path),
                };
                if interrupted {
                    build.save(&record);
                }
                all.insert(record.id.clone(), Arc::new(build));
            }
        }
        let root = dir.map(Path::to_path_buf).unwrap_or_else(|| {
            std::env::temp_dir().join(format!("torpor-builds-{}", std::process::id()))
        });
        // Scratch directories of builds a restart interrupted.
        let _ = std::fs::remove_dir_all(root.join("work"));
        Ok(Builds {
            dir: dir.map(Path::to_path_buf),
            root,
            all: Mutex::new(all),
            files: files::Files::open(dir.map(|d| d.join("files")))?,
            guest: Guest::default(),
            making: Mutex::new(HashSet::new()),
        })
    }

    /// These builds, templates from images provisioned with `guest`.
    pub fn with_guest(mut self, guest: Guest) -> Self {
        self.guest = guest;
        self
    }

    /// A new build's record, waiting, with a new id (a UUID, as E2B's
    /// build ids are).
    pub fn begin(&self, tenant: Option<String>, name: &str, tags: Vec<String>) -> Arc<Build> {
        let id = uuid();
        let record = BuildRecord {
            id: id.clone(),
            tenant,
            name: name.to_string(),
            tags,
            cpu_count: None,
            memory_mib: None,
            spec: None,
            last_env: None,
            status: BuildStatus::Waiting,
            step: None,
            cached_steps: 0,
            run_steps: 0,
            failure: None,
            template_id: None,
            created_at: Timestamp::now(),
            finished_at: None,
            logs_dropped: 0,
            logs: Vec::new(),
        };
        let build = Arc::new(Build {
            record: Mutex::new(record.clone()),
            cancel: Cancel::default(),
            file: self
                .dir
                .as_ref()
                .map(|d| d.join("records").join(format!("{id}.json"))),
        });
        build.save(&record);
        self.all.locked().insert(id, Arc::clone(&build));
        build
    }

    /// `f` of the record of the build that made template `template_id`,
    /// whoever's.
    fn of_template<T>(&self, template_id: &str, f: impl FnOnce(&BuildRecord) -> T) -> Option<T> {
        self.all
            .locked()
            .values()
            .map(|b| b.record.locked())
            .find(|r| {
                r.status == BuildStatus::Ready && r.template_id.as_deref() == Some(template_id)
            })
            .map(|r| f(&r))
    }

    /// The name of the build that made template `template_id` (E2B calls
    /// a built template by its name: its `templateID`).
    pub fn built_name(&self, template_id: &str) -> Option<String> {
        self.of_template(template_id, |r| r.name.clone())
    }

    /// The user, directory and variables the build that made template
    /// `template_id` ended with: its sandboxes' defaults.
    pub fn guest_defaults(&self, template_id: &str) -> Option<torpor_build::env::Environment> {
        self.of_template(template_id, |r| r.last_env.clone())
            .flatten()
    }

    /// `tenant`'s builds of template `name`, newest first.
    pub fn of_name(&self, tenant: Option<&str>, name: &str) -> Vec<Arc<Build>> {
        let mut out: Vec<Arc<Build>> = self
            .all
            .locked()
            .values()
            .filter(|b| {
                let r = b.record.locked();
                r.name == name && r.tenant.as_deref() == tenant
            })
            .cloned()
            .collect();
        out.sort_by_key(|b| std::cmp::Reverse(b.record.locked().created_at.0));
        out
    }

    /// The ready build of `tenant`'s template `name` that tag `tag` names
    /// (the newest ready build holding it).
    pub fn tagged(&self, tenant: Option<&str>, name: &str, tag: &str) -> Option<Arc<Build>> {
        self.of_name(tenant, name).into_iter().find(|b| {
            let r = b.record.locked();
            r.status == BuildStatus::Ready && r.tags.iter().any(|t| t == tag)
        })
    }

    /// The newest ready build of `tenant` that made template `template_id`.
    pub fn made(&self, tenant: Option<&str>, template_id: &str) -> Option<BuildRecord> {
        self.list(tenant).into_iter().find(|r| {
            r.status == BuildStatus::Ready && r.template_id.as_deref() == Some(template_id)
        })
    }

    /// Build `id` if `tenant` may see it (an admin, `None`, sees all; a
    /// tenant its own; another's is not found).
    pub fn get(&self, id: &str, tenant: Option<&str>) -> Result<Arc<Build>, ServiceError> {
        self.all
            .locked()
            .get(id)
            .filter(|b| tenant.is_none_or(|t| b.record.locked().tenant.as_deref() == Some(t)))
            .cloned()
            .ok_or_else(|| ServiceError::NotFound {
                kind: "build",
                id: id.chars().take(64).collect(),
            })
    }

    /// The builds `tenant` sees (all for `None`), newest first.
    pub fn list(&self, tenant: Option<&str>) -> Vec<BuildRecord> {
        let mut out: Vec<BuildRecord> = self
            .all
            .locked()
            .values()
            .map(|b| b.record())
            .filter(|r| tenant.is_none_or(|t| r.tenant.as_deref() == Some(t)))
            .collect();
        out.sort_by(|a, b| b.created_at.0.cmp(&a.created_at.0).then(b.id.cmp(&a.id)));
        out
    }

    /// How many builds of `tenant` are unfinished.
    pub fn running(&self, tenant: Option<&str>) -> usize {
        self.all
            .locked()
            .values()
            .filter(|b| {
                let r = b.record.locked();
                !r.status.finished() && r.tenant.as_deref() == tenant
            })
            .count()
    }
}

/// What templates made from images are provisioned with (the API's
/// config: `torpor serve` gives its built-in Linux template's kernel and
/// agent).
#[derive(Debug, Clone, Default)]
pub struct Guest {
    /// The guest kernel (`vmlinux`) every such template boots.
    pub kernel: Option<PathBuf>,
    /// The static torpor-agent put into their root filesystems.
    pub agent: Option<PathBuf>,
    /// An extra CA (PEM) registries' certificates are checked against,
    /// besides the system's.
    pub registry_ca: Option<PathBuf>,
    /// Registries pulled from whatever their addresses
    /// ([`crate::ApiConfig::private_registries`]).
    pub private_registries: Vec<String>,
    /// Free space left in a root filesystem past its content (and 30%).
    pub headroom_mib: u64,
}

/// The name of the cache layer of key `key`: a template of the build's
/// tenant, left out of template lists ([`is_layer`]).
pub fn layer_name(key: &str) -> String {
    format!("{LAYER_PREFIX}{}", &key[..key.len().min(40)])
}

/// Whether a template name is a build's cache layer.
pub fn is_layer(name: &str) -> bool {
    name.starts_with(LAYER_PREFIX)
}

/// The prefix of cache layers' names.
pub const LAYER_PREFIX: &str = "build-layer-";
