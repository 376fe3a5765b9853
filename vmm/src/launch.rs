//! Starting a VMM from a [`LaunchSpec`]: the one entry point the pod's
//! `torpor-vmm` process and the `torpor vmm` command for people share.
//!
//! A spec with a jail confines the process first ([`crate::jail::enter`]),
//! before anything of the guest is read. The spec then becomes a boot, a
//! restore or a standby shell; its [`Ready`] hook fires once the control
//! socket answers (the VM built, or the shell made), which is when
//! `torpor-vmm` writes its `ready` line.

use torpor_vmm_api::launch::{DiskSpec, KernelSource, LaunchMode, LaunchSpec};
use torpor_vmm_api::{ErrorKind, VmError};

use crate::boot::KernelImage;
use crate::microvm::{Ready, RunError, RunReport};
use crate::restore::RestoreOptions;
use crate::virtio_devices::{DiskConfig, VirtioConfig, VirtioRestorePaths};
use crate::vstate::memory::AnonymousBackend;
use crate::VmConfig;

/// A kernel built into the VMM binary, by name (`builtin:NAME`).
pub type Builtin = (&'static str, &'static [u8]);

/// Runs the VM `spec` describes until it ends, in its jail when it has
/// one; `on_ready` runs once its control socket serves, with the VMM's
/// pid as its starter sees it. Built-in kernels are looked up in
/// `builtins`. Must be called before the process starts any thread.
pub fn run(
    spec: &LaunchSpec,
    builtins: &[Builtin],
    on_ready: impl FnOnce(u32) + Send + 'static,
) -> Result<RunReport, RunError> {
    // A jailed VMM with a sandbox network joins that namespace while it is
    // still root (a VMM without rights cannot `setns` later) and opens its
    // tap there by name.
    let mut spec_owned;
    let spec = match (&spec.jail, tap_name(spec)) {
        (Some(_), Some(tap)) => {
            let netns = net_namespace(spec);
            if let Some(netns) = &netns {
                crate::jail::join_net(netns)?;
            }
            // The tap too, as root: attaching to a tap someone else made
            // needs CAP_NET_ADMIN, and the jail has no /dev/net/tun. The
            // descriptor stays valid in the jail's own namespaces.
            crate::devices::net::Tap::preopen(&tap)?;
            spec_owned = spec.clone();
            if let Some(netns) = netns {
                if let Some(jail) = spec_owned.jail.as_mut() {
                    jail.namespaces.join_net = Some(netns);
                }
                clear_net_namespace(&mut spec_owned);
            }
            &spec_owned
        }
        _ => spec,
    };
    // Read once, before the jail's /proc (its processes only) hides
    // /proc/meminfo: every restore checks its size against it.
    if spec.jail.is_some() {
        let _ = crate::vstate::memory::host_memory_bytes();
    }
    let pid = match &spec.jail {
        Some(jail) => crate::jail::enter(jail)?.host_pid,
        None => std::process::id(),
    };
    let ready = Ready::new(move || on_ready(pid));
    // Compiled by the first thread that installs one, installed by each
    // thread as it starts (crate::seccomp), each kind's list made of its
    // mechanisms' declarations (crate::confine).
    crate::seccomp::init(spec.seccomp, crate::confine::needs)?;
    let socket = spec.control_socket.clone();
    match &spec.mode {
        LaunchMode::Boot {
            kernel,
            initrd,
            cmdline,
            mem_mib,
            vcpus,
            disk,
            vsock_uds,
            net,
            balloon,
        } => {
            let config = VmConfig {
                kernel: kernel_image(kernel, builtins)?,
                initrd: initrd.clone(),
                cmdline: cmdline
                    .clone()
                    .unwrap_or_else(|| crate::DEFAULT_CMDLINE.to_string()),
                mem_mib: *mem_mib,
                vcpus: *vcpus,
                serial: spec.console.clone(),
                virtio: VirtioConfig {
                    disk: disk.as_ref().map(|d: &DiskSpec| DiskConfig {
                        image: d.image.clone(),
                        overlay: d.overlay.clone(),
                        read_only: d.read_only,
                        keep_overlay: d.keep_overlay,
                    }),
                    vsock_uds: vsock_uds.clone(),
                    net: net.as_deref().cloned(),
                    balloon: *balloon,
                },
                dirty_tracking: spec.dirty_tracking,
            };
            crate::microvm::boot(&config, &AnonymousBackend, socket, ready)
        }
        LaunchMode::Restore {
            restore,
            paused,
            record_working_set_ms,
        } => {
            let opts = RestoreOptions {
                snapshot: restore.snapshot.clone(),
                backend: restore.backend,
                serial: spec.console.clone(),
                prefetch: restore.prefetch,
                lazy_map: restore.lazy_map.clone(),
                record_working_set_ms: *record_working_set_ms,
                virtio: VirtioRestorePaths {
                    disk_overlay: restore.disk_overlay.clone(),
                    vsock_uds: restore.vsock_uds.clone(),
                    net: restore.net.as_deref().cloned(),
                },
                dirty_tracking: spec.dirty_tracking,
            };
            crate::microvm::restore(&opts, socket, *paused, ready)
        }
        LaunchMode::Standby { mem_mib, vcpus } => {
            let Some(socket) = socket else {
                return Err(RunError::Launch(VmError::new(
                    ErrorKind::InvalidRequest,
                    "a standby VMM needs a control socket",
                )));
            };
            crate::standby::standby(*mem_mib, *vcpus, socket, spec.dirty_tracking, ready)
        }
    }
}

fn kernel_image(kernel: &KernelSource, builtins: &[Builtin]) -> Result<KernelImage, RunError> {
    match kernel {
        KernelSource::Path(p) => Ok(KernelImage::Path(p.clone())),
        KernelSource::Builtin(name) => builtins
            .iter()
            .find(|(n, _)| n == name)
            .map(|&(name, bytes)| KernelImage::Embedded { name, bytes })
            .ok_or_else(|| {
                let known: Vec<&str> = builtins.iter().map(|(n, _)| *n).collect();
                RunError::Launch(VmError::new(
                    ErrorKind::InvalidRequest,
                    format!(
                        "unknown built-in kernel `{name}` (available: {})",
                        known.join(", ")
                    ),
                ))
            }),
    }
}

/// The network namespace the spec's tap is opened in, if any.
fn net_namespace(spec: &LaunchSpec) -> Option<std::path::PathBuf> {
    match &spec.mode {
        LaunchMode::Boot { net, .. } => net.as_ref().and_then(|n| n.netns.clone()),
        LaunchMode::Restore { restore, .. } => restore.net.as_ref().and_then(|n| n.netns.clone()),
        LaunchMode::Standby { .. } => None,
    }
}

fn tap_name(spec: &LaunchSpec) -> Option<String> {
    match &spec.mode {
        LaunchMode::Boot { net, .. } => net.as_ref().map(|n| n.tap.clone()),
        LaunchMode::Restore { restore, .. } => restore.net.as_ref().map(|n| n.tap.clone()),
        LaunchMode::Standby { .. } => None,
    }
}

/// The tap is opened in the namespace the process is already in.
fn clear_net_namespace(spec: &mut LaunchSpec) {
    let net = match &mut spec.mode {
        LaunchMode::Boot { net, .. } => net.as_mut(),
        LaunchMode::Restore { restore, .. } => restore.net.as_mut(),
        LaunchMode::Standby { .. } => None,
    };
    if let Some(net) = net {
        net.netns = None;
    }
}
