//! Giving up root: resource limits, every capability (bounding, ambient,
//! inheritable, permitted, effective), supplementary groups, the gid and
//! uid, and `PR_SET_NO_NEW_PRIVS`.

use torpor_vmm_api::jail::{JailSpec, Rlimits};

use super::{sys, JailError};

/// Highest capability number the kernel might know (it stops at the first
/// unknown one, EINVAL).
const MAX_CAP: libc::c_ulong = 63;

fn setrlimit(resource: libc::__rlimit_resource_t, name: &str, value: u64) -> Result<(), JailError> {
    let limit = libc::rlimit {
        rlim_cur: value,
        rlim_max: value,
    };
    // SAFETY: a valid rlimit struct, read for the call.
    let ret = unsafe { libc::setrlimit(resource, &limit) };
    sys(ret, || format!("set {name} to {value}"))
}

/// `RLIMIT_NOFILE`, `RLIMIT_FSIZE` (when given) and `RLIMIT_CORE` = 0. A
/// write past the size limit then fails with EFBIG (reported as a full
/// disk) instead of killing the VMM with SIGXFSZ.
pub fn limit(r: &Rlimits) -> Result<(), JailError> {
    setrlimit(libc::RLIMIT_NOFILE, "RLIMIT_NOFILE", r.nofile)?;
    setrlimit(libc::RLIMIT_CORE, "RLIMIT_CORE", 0)?;
    if let Some(fsize) = r.fsize {
        // SAFETY: ignoring a signal installs no handler code.
        unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) };
        setrlimit(libc::RLIMIT_FSIZE, "RLIMIT_FSIZE", fsize)?;
    }
    Ok(())
}

/// Drops to `spec.uid`/`spec.gid` with no capability left and no way to
/// gain one (no setuid binaries, no file capabilities).
pub fn drop_privileges(spec: &JailSpec) -> Result<(), JailError> {
    for cap in 0..=MAX_CAP {
        // SAFETY: prctl with integer arguments only.
        let ret = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) };
        if ret != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINVAL) {
                break; // past the kernel's last capability
            }
            return Err(JailError::Sys {
                what: format!("drop capability {cap} from the bounding set"),
                source: e,
            });
        }
    }
    // SAFETY: prctl with integer arguments only.
    let ret = unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        )
    };
    sys(ret, || "clear the ambient capabilities".into())?;
    // SAFETY: an empty group list (null pointer, length 0).
    let ret = unsafe { libc::setgroups(0, std::ptr::null()) };
    sys(ret, || "drop supplementary groups".into())?;
    // SAFETY: integer arguments only.
    let ret = unsafe { libc::setresgid(spec.gid, spec.gid, spec.gid) };
    sys(ret, || format!("setresgid {}", spec.gid))?;
    // Leaving uid 0 for good clears the permitted and effective sets
    // (SECBIT_KEEP_CAPS is not set); inheritable is cleared below.
    // SAFETY: integer arguments only.
    let ret = unsafe { libc::setresuid(spec.uid, spec.uid, spec.uid) };
    sys(ret, || format!("setresuid {}", spec.uid))?;
    clear_capabilities()?;
    // SAFETY: prctl with integer arguments only.
    let ret = unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
    sys(ret, || "set no_new_privs".into())?;
    // SAFETY: umask takes and returns a mode only.
    unsafe { libc::umask(0o077) };
    Ok(())
}

/// `capset` with empty effective, permitted and inheritable sets.
fn clear_capabilities() -> Result<(), JailError> {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;
    let mut header = Header {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let data = [Data::default(); 2];
    // SAFETY: capset reads one header and two data structs (version 3),
    // both alive for the call.
    let ret = unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) };
    sys(ret as i32, || "clear the capability sets".into())
}
