//! How a VM ends: the first reason recorded wins and wakes the main thread.

use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use torpor_sync::Locked;
use vmm_sys_util::eventfd::EventFd;

/// Why the VMM is stopping. Each maps to a documented process exit status.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "reason", content = "detail")]
pub enum ExitReason {
    /// The guest reset the machine (i8042 0xFE, triple fault) or powered off.
    GuestShutdown,
    /// A `shutdown` request on the control socket.
    ControlShutdown,
    /// A `hibernate` request: the VM's snapshot is written, the VMM ends.
    Hibernated,
    /// A vCPU hit an error the VMM cannot recover from.
    VcpuError(String),
    /// The userfaultfd page server failed; guest memory can no longer be
    /// served, so the VM is stopped rather than left hanging.
    PageServerFailed(String),
}

impl ExitReason {
    /// Process exit status: 0 for an orderly end, 3 for a VM failure.
    /// (1 is a configuration error before boot, 2 a usage error.)
    pub fn exit_code(&self) -> i32 {
        match self {
            ExitReason::GuestShutdown | ExitReason::ControlShutdown | ExitReason::Hibernated => 0,
            ExitReason::VcpuError(_) | ExitReason::PageServerFailed(_) => 3,
        }
    }
}

impl ExitReason {
    /// What to tell people when the VM failed while running.
    pub fn failure(&self) -> Option<String> {
        match self {
            ExitReason::VcpuError(e) => Some(format!("the VM failed: {e}")),
            ExitReason::PageServerFailed(e) => Some(format!(
                "the VM was stopped because its page server failed: {e}"
            )),
            _ => None,
        }
    }
}

/// Shared by vCPUs, devices and the control server to end the VM.
#[derive(Clone, Debug)]
pub struct ExitSignal {
    reason: Arc<Mutex<Option<ExitReason>>>,
    evt: Arc<EventFd>,
}

impl ExitSignal {
    pub fn new() -> std::io::Result<Self> {
        Ok(Self {
            reason: Arc::new(Mutex::new(None)),
            evt: Arc::new(EventFd::new(libc::EFD_CLOEXEC)?),
        })
    }

    /// Records `reason` unless another was recorded first, and wakes the waiter.
    pub fn exit(&self, reason: ExitReason) {
        let mut slot = self.reason.locked();
        if slot.is_none() {
            *slot = Some(reason);
        }
        // A full eventfd counter still leaves it readable, so ignoring the
        // error cannot lose the wake-up.
        let _ = self.evt.write(1);
    }

    /// Blocks until some party calls `exit`, then returns the first reason.
    pub fn wait(&self) -> ExitReason {
        loop {
            if let Some(r) = self.reason.locked().clone() {
                return r;
            }
            let _ = self.evt.read();
        }
    }

    /// The reason, if the VM is already ending.
    pub fn reason(&self) -> Option<ExitReason> {
        self.reason.locked().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_reason_wins() {
        let s = ExitSignal::new().unwrap();
        s.exit(ExitReason::GuestShutdown);
        s.exit(ExitReason::VcpuError("late".into()));
        assert_eq!(s.wait(), ExitReason::GuestShutdown);
        assert_eq!(ExitReason::VcpuError(String::new()).exit_code(), 3);
    }
}
