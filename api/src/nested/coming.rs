//! Templates a pod on its way up will have (`torpor serve`'s `base`, built
//! by the nested pod): until they are there, creating a sandbox from one
//! answers 503 `unavailable` with `Retry-After` and what is happening,
//! rather than a 404 or a wait. A template offered on demand is not
//! started until its first request asks for it.

use std::collections::HashMap;
use std::sync::Mutex;

use torpor_sync::Locked;

use crate::service::ServiceError;

/// What starts an on-demand template (returns at once; the work goes on in
/// the background and reports through [`Coming::set`]).
pub type Starter = Box<dyn FnOnce() + Send>;

/// `Retry-After` while a template is coming, in seconds: the nested pod's
/// steps take minutes, a client asking twice a minute loses little.
pub const RETRY_AFTER_S: u64 = 30;

struct Entry {
    why: String,
    /// Not started yet: the first request for the template runs this.
    start: Option<Starter>,
}

impl std::fmt::Debug for Entry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The starter is a closure: only whether it is still to run.
        f.debug_struct("Entry")
            .field("why", &self.why)
            .field("started", &self.start.is_none())
            .finish()
    }
}

/// The templates that are coming, by name.
#[derive(Default, Debug)]
pub struct Coming {
    entries: Mutex<HashMap<String, Entry>>,
}

impl Coming {
    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.entries.locked()
    }

    /// Marks `name` as coming (`why`: not there yet, and why: progress) or
    /// there (`None`). An on-demand entry not started yet stays unstarted.
    pub fn set(&self, name: &str, why: Option<String>) {
        let mut entries = self.entries();
        match why {
            Some(why) => {
                entries
                    .entry(name.to_string())
                    .and_modify(|e| e.why.clone_from(&why))
                    .or_insert(Entry { why, start: None });
            }
            None => {
                entries.remove(name);
            }
        }
    }

    /// Offers `name` on demand: the first [`Coming::check`] for it runs
    /// `start`.
    pub fn on_demand(&self, name: &str, why: String, start: Starter) {
        self.entries().insert(
            name.to_string(),
            Entry {
                why,
                start: Some(start),
            },
        );
    }

    /// `Ok` when `name` is not coming (it is there, or unknown: the pods
    /// answer for it); else the 503 to give, after starting it if this is
    /// its first request.
    pub fn check(&self, name: &str) -> Result<(), ServiceError> {
        let (why, start) = {
            let mut entries = self.entries();
            let Some(entry) = entries.get_mut(name) else {
                return Ok(());
            };
            (entry.why.clone(), entry.start.take())
        };
        let why = match start {
            // Outside the lock: the starter reports progress through `set`.
            Some(start) => {
                start();
                self.entries()
                    .get(name)
                    .map(|e| e.why.clone())
                    .unwrap_or(why)
            }
            None => why,
        };
        Err(ServiceError::Unavailable {
            message: format!("template {name} is not available yet: {why}"),
            retry_after_s: RETRY_AFTER_S,
        })
    }

    /// What is said about `name` while it is coming.
    pub fn why(&self, name: &str) -> Option<String> {
        self.entries().get(name).map(|e| e.why.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    fn retry(e: ServiceError) -> (String, u64) {
        match e {
            ServiceError::Unavailable {
                message,
                retry_after_s,
            } => (message, retry_after_s),
            other => panic!("not unavailable: {other:?}"),
        }
    }

    #[test]
    fn an_on_demand_template_starts_on_its_first_request_only() {
        let coming = Arc::new(Coming::default());
        let starts = Arc::new(AtomicUsize::new(0));
        let (c, s) = (coming.clone(), starts.clone());
        coming.on_demand(
            "base",
            "not started".into(),
            Box::new(move || {
                s.fetch_add(1, Ordering::SeqCst);
                c.set("base", Some("booting the nested host".into()));
            }),
        );
        assert!(coming.check("probe").is_ok());
        assert_eq!(starts.load(Ordering::SeqCst), 0);
        let (message, after) = retry(coming.check("base").unwrap_err());
        assert_eq!(starts.load(Ordering::SeqCst), 1);
        assert_eq!(after, RETRY_AFTER_S);
        assert!(message.contains("booting the nested host"), "{message}");
        let (message, _) = retry(coming.check("base").unwrap_err());
        assert_eq!(starts.load(Ordering::SeqCst), 1, "started once");
        assert!(message.contains("base is not available yet"), "{message}");
        coming.set("base", None);
        assert!(coming.check("base").is_ok());
        assert_eq!(coming.why("base"), None);
    }

    #[test]
    fn progress_does_not_start_an_unstarted_template() {
        let coming = Coming::default();
        let starts = Arc::new(AtomicUsize::new(0));
        let s = starts.clone();
        coming.on_demand(
            "base",
            "not started".into(),
            Box::new(move || {
                s.fetch_add(1, Ordering::SeqCst);
            }),
        );
        coming.set("base", Some("still not started".into()));
        assert_eq!(coming.why("base").as_deref(), Some("still not started"));
        assert_eq!(starts.load(Ordering::SeqCst), 0);
        coming.check("base").unwrap_err();
        assert_eq!(starts.load(Ordering::SeqCst), 1);
    }
}
