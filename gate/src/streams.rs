//! Long requests, fairly: exec streams and envd's streaming calls (a
//! process's output, a directory watch) can last minutes. Each takes a
//! slot of its tenant's ([`Streams::take`]: at most `per_tenant` at once
//! per tenant and `total` in all; past either, 429 `rate_limited` with
//! `Retry-After`), holds it for as long as it streams, and runs on a
//! thread of its own ([`run_long`]), never on tokio's blocking pool, which
//! every other request needs for its service call. So one tenant at its
//! limit leaves every other tenant's creates, execs and reads answering
//! as before (`benches/fairness.rs` measures it).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::http::StatusCode;
use torpor_sync::Locked;

use crate::error::{code, ApiError};

/// Default [`Streams`] slots per tenant.
pub const DEFAULT_PER_TENANT: usize = 32;
/// Default [`Streams`] slots in all (each is a thread while it runs).
pub const DEFAULT_TOTAL: usize = 1024;

#[derive(Debug, Default)]
struct Held {
    all: usize,
    per_tenant: HashMap<String, usize>,
}

/// The slots of long requests (see the module documentation).
#[derive(Debug)]
pub struct Streams {
    per_tenant: usize,
    total: usize,
    held: Mutex<Held>,
}

/// One long request's slot, freed on drop.
#[derive(Debug)]
pub struct StreamSlot {
    streams: Arc<Streams>,
    tenant: String,
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let mut held = self.streams.held.locked();
        held.all = held.all.saturating_sub(1);
        if let Some(n) = held.per_tenant.get_mut(&self.tenant) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                held.per_tenant.remove(&self.tenant);
            }
        }
    }
}

impl Streams {
    pub fn new(per_tenant: usize, total: usize) -> Arc<Self> {
        Arc::new(Streams {
            per_tenant: per_tenant.max(1),
            total: total.max(1),
            held: Mutex::new(Held::default()),
        })
    }

    /// A slot of `tenant`'s (the sandbox's owner, whoever calls), or 429.
    pub fn take(self: &Arc<Self>, tenant: &str) -> Result<StreamSlot, ApiError> {
        let mut held = self.held.locked();
        let mine = held.per_tenant.get(tenant).copied().unwrap_or(0);
        if mine >= self.per_tenant || held.all >= self.total {
            let message = if mine >= self.per_tenant {
                format!(
                    "tenant {tenant} has {mine} long requests (streams, watches) open, its most; \
                     end one or retry later"
                )
            } else {
                format!(
                    "{} long requests are open on this server, its most",
                    held.all
                )
            };
            return Err(ApiError {
                retry_after: Some(1),
                ..ApiError::new(StatusCode::TOO_MANY_REQUESTS, code::RATE_LIMITED, message)
            });
        }
        held.all += 1;
        *held.per_tenant.entry(tenant.to_string()).or_default() += 1;
        Ok(StreamSlot {
            streams: Arc::clone(self),
            tenant: tenant.to_string(),
        })
    }

    /// Slots `tenant` holds now.
    pub fn held(&self, tenant: &str) -> usize {
        let held = self.held.locked();
        held.per_tenant.get(tenant).copied().unwrap_or(0)
    }
}

impl Default for Streams {
    fn default() -> Self {
        Streams {
            per_tenant: DEFAULT_PER_TENANT,
            total: DEFAULT_TOTAL,
            held: Mutex::new(Held::default()),
        }
    }
}

/// Runs `f` on a thread of its own, holding `slot` until it returns.
/// The thread enters the caller's tokio runtime, as the blocking pool's
/// threads do: an agent tunnel to another pod (`crate::pods::tunnel`)
/// runs its I/O there.
pub fn run_long(slot: StreamSlot, name: &str, f: impl FnOnce() + Send + 'static) {
    let runtime = tokio::runtime::Handle::try_current().ok();
    let spawned = std::thread::Builder::new()
        .name(format!("long-{name}"))
        .stack_size(256 << 10)
        .spawn(move || {
            let _slot = slot;
            let _entered = runtime.as_ref().map(tokio::runtime::Handle::enter);
            f();
        });
    if let Err(e) = spawned {
        // The slot went with the closure; the caller's channel closes and
        // its stream ends with an error line.
        tracing::error!(error = %e, "cannot start a thread for a long request");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn slots_are_per_tenant_and_in_all_and_freed_on_drop() {
        let s = Streams::new(2, 3);
        let a1 = s.take("a").unwrap();
        let _a2 = s.take("a").unwrap();
        let e = s.take("a").unwrap_err();
        assert_eq!(e.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(e.retry_after, Some(1));
        let _b1 = s.take("b").unwrap();
        assert!(s.take("c").is_err(), "3 in all");
        drop(a1);
        assert_eq!(s.held("a"), 1);
        let _c = s.take("c").unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let slot = {
            drop(_c);
            s.take("c").unwrap()
        };
        run_long(slot, "test", move || tx.send(()).unwrap());
        rx.recv().unwrap();
        // The thread ended: its slot is free again.
        for _ in 0..100 {
            if s.held("c") == 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(s.held("c"), 0);
    }

    #[test]
    fn a_long_request_runs_in_its_callers_runtime() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let s = Streams::new(1, 1);
        let (tx, rx) = std::sync::mpsc::channel();
        runtime.block_on(async {
            run_long(s.take("a").unwrap(), "test", move || {
                tx.send(tokio::runtime::Handle::try_current().is_ok())
                    .unwrap()
            });
        });
        assert!(rx.recv().unwrap(), "an agent tunnel needs the runtime");
    }
}
