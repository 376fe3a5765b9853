//! The per-VM control protocol, both ways: a request line as the VMM's
//! control server answers it (any bytes; a refusal for anything that is
//! not a request), and a response line as the service reads it from a
//! VMM it may no longer trust. What parses must serialize and parse back
//! to the same value.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use torpor_vmm::control::server::answer;
use torpor_vmm::control::{
    BalloonStatus, Request, Response, SnapshotInfo, VmController, VmState, VmStatus,
};
use torpor_vmm_api::vcpus::VcpuStates;
use torpor_vmm_api::VmError;

struct Idle;

impl VmController for Idle {
    fn status(&self) -> VmStatus {
        VmStatus {
            protocol: 1,
            state: VmState::Running,
            pid: 1,
            vcpus: 1,
            mem_mib: 64,
            kernel: String::new(),
            uptime_ms: 0,
            generation: 0,
            memory_backend: "anonymous".into(),
            base_snapshot: None,
            guest_clock_ns: None,
            dirty_tracking: String::new(),
            console_dropped_bytes: 0,
        }
    }
    fn pause(&self) -> Result<VmStatus, VmError> {
        Ok(self.status())
    }
    fn resume(&self) -> Result<VmStatus, VmError> {
        Ok(self.status())
    }
    fn shutdown(&self) -> Result<VmStatus, VmError> {
        Ok(self.status())
    }
    fn snapshot(&self, path: &Path, diff: bool) -> Result<SnapshotInfo, VmError> {
        Ok(SnapshotInfo {
            path: path.to_path_buf(),
            diff,
            pages: 0,
            memory_allocated_bytes: 0,
            state_bytes: 0,
            duration_us: 0,
            dirty_tracking: String::new(),
            dirty_collect_us: 0,
            dirty_crosscheck: None,
            lineage: Vec::new(),
        })
    }
    fn hibernate(&self, path: &Path, diff: bool) -> Result<SnapshotInfo, VmError> {
        self.snapshot(path, diff)
    }
    fn set_balloon(&self, target_mib: u64) -> Result<BalloonStatus, VmError> {
        Ok(BalloonStatus {
            target_mib,
            ..Default::default()
        })
    }
    fn balloon(&self) -> Result<BalloonStatus, VmError> {
        Ok(BalloonStatus::default())
    }
    fn vcpu_state(&self) -> Result<VcpuStates, VmError> {
        Ok(VcpuStates {
            vcpus: Vec::new(),
            ioapic: Vec::new(),
            ioapic_irr: 0,
        })
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(line) = std::str::from_utf8(data) else {
        return;
    };
    let response = answer(line, &Idle);
    assert_eq!(
        response.ok,
        serde_json::from_str::<Request>(line).is_ok_and(|r| !matches!(r, Request::Restore { .. })),
        "only requests are answered ok"
    );
    if let Ok(req) = serde_json::from_str::<Request>(line) {
        let text = serde_json::to_string(&req).expect("a request serializes");
        let back: Request = serde_json::from_str(&text).expect("and parses back");
        assert_eq!(back, req);
    }
    if let Ok(resp) = serde_json::from_str::<Response>(line) {
        let _ = resp.vm_error();
        let text = serde_json::to_string(&resp).expect("a response serializes");
        let _: Response = serde_json::from_str(&text).expect("and parses back");
    }
});
