//! Command-line interface. Exit status everywhere: 0 success, 1 bad
//! configuration or a failed request, 2 usage error, 3 the VM failed.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

mod admin;
mod client;
mod plan;
pub use admin::*;
pub use client::*;
pub use plan::*;

#[derive(Debug, Parser)]
#[command(
    name = "torpor",
    version,
    about = "microVM sandboxes that hibernate when idle"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run one microVM in this process, or control a running one.
    Vmm(Box<VmmCommand>),
    /// Check this host: KVM, virtualization kind, userfaultfd, huge pages, cgroups.
    Doctor {
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Run the sandbox service: REST API, scheduler, store and a local pod.
    Serve(Box<ServeArgs>),
    /// Sandboxes, through the REST API of `torpor serve`: create, list, get,
    /// exec, pause, resume, hibernate, rm.
    Sandbox(SandboxCommand),
    /// Templates, through the REST API: list, get, create, rm.
    Template(TemplateCommand),
    /// Images (kernels and root filesystems Linux templates are built
    /// from), through the REST API: list, upload, rm (admin).
    Image(ImageCommand),
    /// API tokens, through the REST API: create, list, rm (admin). A
    /// token is shown once, when it is created.
    Token(TokenCommand),
    /// Pods (the hosts sandboxes run on): list, set, add, rm through the
    /// REST API; `pod serve` runs one.
    Pod(PodCommand),
    /// Plan a pod's settings from an activity trace: replay it with the
    /// service's own admission and hibernation policy for each candidate
    /// ratio, keep-alive and watermark; `plan calibrate` measures this
    /// host's costs.
    Plan(Box<PlanCommand>),
    /// Write the built-in probe guest kernel (an ELF) to a file.
    ProbeImage {
        /// Where to write it.
        #[arg(long)]
        out: PathBuf,
    },
    /// What the nested host's QEMU runs for each volume connection of its
    /// pod: stdin and stdout piped to `torpor serve`'s volume gateway.
    /// Writes nothing else (its stderr is the connection too).
    #[command(hide = true)]
    NestedVolumePipe {
        /// The gateway's unix socket.
        socket: PathBuf,
    },
}

#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct VmmCommand {
    #[command(subcommand)]
    pub action: Option<VmmAction>,
    #[command(flatten)]
    pub run: VmmRunArgs,
}

#[derive(Debug, Subcommand)]
pub enum VmmAction {
    /// Print a running VM's status as JSON.
    Status(SocketArg),
    /// Pause every vCPU of a running VM.
    Pause(SocketArg),
    /// Resume a paused VM.
    Resume(SocketArg),
    /// Stop a running VM (the VMM exits with status 0).
    Shutdown(SocketArg),
    /// Snapshot a paused VM into a directory (`state` + sparse `memory`).
    Snapshot(SnapshotArgs),
    /// Print where each vCPU stands as JSON (registers, pending events,
    /// local APIC, the IOAPIC's unmasked pins): for a guest that stopped
    /// answering. A running VM is paused for the reading and runs on.
    Vcpus(SocketArg),
    /// Print the balloon's state and the guest's memory statistics as JSON
    /// (and ask the guest for fresh ones); with --target-mib, first ask the
    /// guest to give that much memory back (0: all of it to the guest).
    Balloon(BalloonArgs),
    /// Run a command in the guest through torpor-agent over the VM's vsock
    /// socket; prints its output and exits with its status.
    Exec(GuestExecArgs),
    /// Tell the guest agent it was restored: it sets the wall clock to this
    /// host's time, reads the identity page (generation, seed) and reseeds
    /// the kernel RNG. Prints its report;
    /// exits 1 unless the clock and the RNG steps succeeded.
    Resumed(GuestAgentArgs),
    /// Wait until the guest agent answers; prints its protocol and version.
    Ping(GuestAgentArgs),
    /// Copy files into and out of the guest, list and stat guest paths,
    /// through torpor-agent over the VM's vsock socket.
    Files(GuestFilesArgs),
}

#[derive(Debug, Args)]
pub struct GuestFilesArgs {
    #[command(flatten)]
    pub agent: GuestAgentArgs,
    #[command(subcommand)]
    pub action: GuestFilesAction,
}

#[derive(Debug, Subcommand)]
pub enum GuestFilesAction {
    /// Copy a local file to GUEST_PATH (absolute; replaced if it exists).
    Put {
        /// The local file.
        local: PathBuf,
        /// Where it goes in the guest.
        guest_path: String,
        /// Permission bits in octal (e.g. 755); default 644 for a new file.
        #[arg(long)]
        mode: Option<String>,
        /// Create missing parent directories.
        #[arg(long)]
        parents: bool,
    },
    /// Copy GUEST_PATH out of the guest to LOCAL (`-` or absent: stdout).
    Get {
        /// The guest file.
        guest_path: String,
        /// Where to write it (`-`: stdout).
        local: Option<PathBuf>,
    },
    /// List a guest directory: kind, mode, size, name (one entry a line).
    Ls {
        /// The guest directory.
        guest_dir: String,
    },
    /// Print a guest path's metadata as JSON (symlinks not followed).
    Stat {
        /// The guest path.
        guest_path: String,
    },
}

#[derive(Debug, Args)]
pub struct GuestAgentArgs {
    /// The VM's vsock host socket (`--vsock-uds` of the VMM).
    #[arg(long)]
    pub vsock_uds: PathBuf,
    /// The agent's vsock port.
    #[arg(long, default_value_t = 52)]
    pub port: u32,
    /// Keep trying to reach the agent for this long.
    #[arg(long, default_value_t = 60_000)]
    pub wait_ms: u64,
}

#[derive(Debug, Args)]
pub struct GuestExecArgs {
    /// The VM's vsock host socket (`--vsock-uds` of the VMM).
    #[arg(long)]
    pub vsock_uds: PathBuf,
    /// The agent's vsock port.
    #[arg(long, default_value_t = 52)]
    pub port: u32,
    /// Kill the command after this many milliseconds (0: no limit).
    #[arg(long, default_value_t = 60_000)]
    pub timeout_ms: u64,
    /// Keep trying to reach the agent for this long (it may still be booting).
    #[arg(long, default_value_t = 60_000)]
    pub wait_ms: u64,
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    pub argv: Vec<String>,
}

#[derive(Debug, Args)]
pub struct SnapshotArgs {
    /// The VM's control socket.
    #[arg(long)]
    pub socket: PathBuf,
    /// Directory to write the snapshot into (created if missing).
    #[arg(long)]
    pub out: PathBuf,
    /// Write only the pages dirtied since the snapshot this VM was restored
    /// from or last took (a diff layer that names its parent).
    #[arg(long)]
    pub diff: bool,
}

#[derive(Debug, Args)]
pub struct BalloonArgs {
    /// The VM's control socket.
    #[arg(long)]
    pub socket: PathBuf,
    /// The balloon's new target in MiB.
    #[arg(long)]
    pub target_mib: Option<u64>,
}

#[derive(Debug, Args)]
pub struct SocketArg {
    /// The VM's control socket.
    #[arg(long)]
    pub socket: PathBuf,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum MemoryBackendArg {
    /// Fresh anonymous memory (cold boot only).
    Anonymous,
    /// Private mapping of the snapshot's memory files: page-cache sharing
    /// between clones, kernel copy-on-write (restore only; the default).
    File,
    /// Anonymous memory filled on first touch by a userfaultfd page server
    /// (restore only).
    Uffd,
    /// Template in shmem mapped privately, first touches seen through
    /// userfaultfd minor faults (restore only).
    UffdShared,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DirtyTrackingArg {
    /// KVM's dirty log (KVM_MEM_LOG_DIRTY_PAGES).
    Kvm,
    /// userfaultfd asynchronous write-protection read with PAGEMAP_SCAN
    /// (Linux 6.7+).
    UffdWp,
    /// uffd-wp writes the diff; KVM's dirty log is kept too and each
    /// snapshot reports where they differ (a check; costs both).
    Both,
}

/// The VMM's per-thread seccomp filters (docs/security.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SeccompArg {
    /// A system call outside its thread's allow-list kills the VMM.
    Enforce,
    /// Such calls are allowed and logged by the kernel (dmesg): debugging.
    Log,
    /// No filters: debugging only.
    Off,
}

impl SeccompArg {
    pub fn level(self) -> torpor_vmm_api::SeccompLevel {
        match self {
            SeccompArg::Enforce => torpor_vmm_api::SeccompLevel::Enforce,
            SeccompArg::Log => torpor_vmm_api::SeccompLevel::Log,
            SeccompArg::Off => torpor_vmm_api::SeccompLevel::Off,
        }
    }
}

impl DirtyTrackingArg {
    pub fn tracking(self) -> torpor_vmm_api::DirtyTracking {
        match self {
            DirtyTrackingArg::Kvm => torpor_vmm_api::DirtyTracking::Kvm,
            DirtyTrackingArg::UffdWp => torpor_vmm_api::DirtyTracking::UffdWp,
            DirtyTrackingArg::Both => torpor_vmm_api::DirtyTracking::Both,
        }
    }
}

#[derive(Debug, Args)]
pub struct VmmRunArgs {
    /// Kernel image: an ELF vmlinux or a bzImage, or `builtin:probe` for the
    /// probe guest built into torpor.
    #[arg(long, required_unless_present_any = ["restore", "standby"])]
    pub kernel: Option<String>,
    /// Create the VM (vCPUs, memory slots) now and wait on the control
    /// socket for a `restore` request: a pre-created shell for fast restores.
    /// Uses --mem-mib and --vcpus; needs --control-socket.
    #[arg(long, requires = "control_socket", conflicts_with_all = ["kernel", "restore", "initrd"])]
    pub standby: bool,
    /// Restore this snapshot directory instead of booting a kernel.
    #[arg(long, conflicts_with_all = ["kernel", "initrd", "cmdline", "mem_mib", "vcpus"])]
    pub restore: Option<PathBuf>,
    /// With --restore: keep the vCPUs paused until a `resume` request.
    #[arg(long, requires = "restore")]
    pub paused: bool,
    /// With --restore and a uffd backend: install the snapshot's recorded
    /// working set eagerly.
    #[arg(long, requires = "restore")]
    pub prefetch: bool,
    /// With --restore and a uffd backend: record the pages first touched in
    /// this many milliseconds after restore as the snapshot's working set.
    #[arg(long, requires = "restore")]
    pub record_working_set_ms: Option<u64>,
    /// Initial ramdisk, loaded at the top of low memory.
    #[arg(long)]
    pub initrd: Option<PathBuf>,
    /// Kernel command line.
    #[arg(long, default_value = torpor_vmm::DEFAULT_CMDLINE)]
    pub cmdline: String,
    /// Guest memory in MiB (at least 16, at most the host's RAM).
    #[arg(long, default_value_t = 256)]
    pub mem_mib: u64,
    /// Number of vCPUs (1 to the KVM maximum).
    #[arg(long, default_value_t = 1)]
    pub vcpus: u16,
    /// Root disk image (raw) as virtio-blk /dev/vda; never written: writes go
    /// to --disk-overlay.
    #[arg(long, requires = "disk_overlay")]
    pub disk: Option<PathBuf>,
    /// This VM's copy-on-write overlay of the disk (created sparse). With
    /// --restore: the clone's own overlay for a snapshot that has a disk.
    #[arg(long)]
    pub disk_overlay: Option<PathBuf>,
    /// Attach the disk read-only.
    #[arg(long, requires = "disk")]
    pub disk_read_only: bool,
    /// virtio-vsock host socket (Firecracker's hybrid vsock: connect, send
    /// `CONNECT <port>`). With --restore: the clone's own socket.
    #[arg(long)]
    pub vsock_uds: Option<PathBuf>,
    /// virtio-net on a tap: `tap=NAME[,mac=MAC]` (the tap is opened by name
    /// in this process's network namespace, created if missing). With
    /// --restore: the clone's tap (default: the saved name); the MAC stays
    /// the snapshot's.
    #[arg(long, value_parser = parse_net)]
    pub net: Option<torpor_vmm_api::NetSpec>,
    /// virtio-balloon: the guest reports free memory (which the VMM gives
    /// back to the host) and its memory statistics, and the control
    /// socket's `set_balloon` asks it to give memory back. Needs a Linux
    /// guest with CONFIG_VIRTIO_BALLOON (and CONFIG_PAGE_REPORTING).
    #[arg(long)]
    pub balloon: bool,
    /// Write the guest console to this file instead of stdout.
    #[arg(long)]
    pub serial: Option<PathBuf>,
    /// Discard the guest console.
    #[arg(long, conflicts_with = "serial")]
    pub no_serial: bool,
    /// Serve the control protocol on this unix socket.
    #[arg(long)]
    pub control_socket: Option<PathBuf>,
    /// How guest memory is backed (default: anonymous to boot, file to
    /// restore).
    #[arg(long, value_enum)]
    pub memory_backend: Option<MemoryBackendArg>,
    /// Where diff snapshots of this VM take their dirty pages from (boot,
    /// --restore and --standby).
    #[arg(long, value_enum, default_value_t = DirtyTrackingArg::Kvm)]
    pub dirty_tracking: DirtyTrackingArg,
    /// Per-thread seccomp filters: `enforce` (the default), or `log` /
    /// `off` for debugging (both print a warning: the VMM is then not
    /// confined).
    #[arg(long, value_enum, default_value_t = SeccompArg::Enforce)]
    pub seccomp: SeccompArg,
    /// At exit, print boot phase timings and the exit reason as one JSON
    /// line on stderr.
    #[arg(long)]
    pub report: bool,
    /// Run the VMM jailed as this uid (the default; see docs/vmm.md,
    /// "The jail"): own namespaces, `pivot_root` into a root holding only
    /// the paths it uses, no capabilities, a cgroup. The directories it
    /// writes in (control socket, console, overlay) must be writable by it.
    #[arg(long, value_name = "UID", default_value_t = torpor_vmm_api::jail::CLI_JAIL_UID,
          conflicts_with = "no_jail")]
    pub jail_uid: u32,
    /// The jail's gid (default: the uid).
    #[arg(long, value_name = "GID", conflicts_with = "no_jail")]
    pub jail_gid: Option<u32>,
    /// Another host path visible in the jail at the same path (`PATH`, or
    /// `PATH:ro` read-only), e.g. where snapshots are written.
    #[arg(long, value_name = "PATH[:ro]", conflicts_with = "no_jail")]
    pub jail_expose: Vec<String>,
    /// Join this network namespace (`/run/netns/NAME`, `/proc/PID/ns/net`)
    /// instead of making a new one: how a pod's VMMs without a network
    /// share one empty namespace (docs/vmm.md, "The jail").
    #[arg(long, value_name = "PATH", conflicts_with = "no_jail")]
    pub jail_netns: Option<PathBuf>,
    /// Run without a jail, with the caller's privileges (development only:
    /// a guest that escapes owns what the caller owns).
    #[arg(long)]
    pub no_jail: bool,
}

/// How the local pod's service runs: `torpor serve` and `torpor pod serve`.
#[derive(Debug, Args)]
pub struct ServiceFlags {
    /// How often the hibernation policy runs, in ms (0 turns it off).
    #[arg(long, default_value_t = 1000)]
    pub policy_interval_ms: u64,
    /// How often each running sandbox's resource use is sampled into its
    /// history (`GET /v1/sandboxes/{id}/metrics`, E2B's metrics), in ms;
    /// the last 1440 samples are kept (0 turns sampling off; a read of a
    /// running sandbox's metrics still samples it).
    #[arg(long, default_value_t = torpor_scheduler::service::history::SAMPLE_INTERVAL_MS)]
    pub history_interval_ms: u64,
    /// The object store hibernations and templates are uploaded to, so
    /// that any pod of a cluster sharing it wakes a sandbox whose pod is
    /// gone: a directory (`/var/lib/torpor/objects`, `file:///...`) or an
    /// S3-compatible bucket (`s3://bucket/prefix`, endpoint and keys from
    /// AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID,
    /// AWS_SECRET_ACCESS_KEY). A hibernation then writes a full snapshot
    /// and answers once it is durable there. Unset: snapshots stay on this
    /// pod's disk only.
    #[arg(long, value_name = "DIR|s3://BUCKET/PREFIX")]
    pub object_store: Option<String>,
    /// With --object-store: every running or paused sandbox's state is
    /// snapshotted (full) and stored there every N seconds, so that if
    /// this pod is lost for good the sandbox wakes on another pod from a
    /// state at most about N s old (the guest stops for the snapshot's
    /// write). Unset or 0: off, and such a sandbox is lost with its pod.
    #[arg(long, value_name = "N", requires = "object_store")]
    pub checkpoint_interval_s: Option<u64>,
    /// A cold wake (snapshot only in the object store) restores once the
    /// layer's small files and its working set are here; the rest of its
    /// memory arrives while the guest runs, a fault on a page not yet
    /// here fetching its chunk first (such a restore takes the `uffd`
    /// backend, whatever --memory-backend says). Off by default: a lazy
    /// adoption moves a sandbox before its layer was read whole
    /// (docs/storage.md, "The wake path").
    #[arg(long, requires = "object_store")]
    pub lazy_wake: bool,
    /// With --object-store, when a hibernation is answered: `stored` (the
    /// default) once its snapshot is durable in the object store; `local`
    /// once it is durable on this pod's disk, the upload following at once
    /// in the background (retried every 30 s while the store fails). The
    /// risk of `local`: a pod lost for good before the upload ends loses
    /// the hibernated sandboxes not stored yet (the API shows them without
    /// `stored_snapshot` until then).
    #[arg(long, value_enum, default_value_t = HibernateAckArg::Stored, requires = "object_store")]
    pub hibernate_ack: HibernateAckArg,
    /// With --object-store: the bound, in MiB, of this pod's chunk cache
    /// (`<data-dir>/chunk-cache`), which every snapshot layer fetched here
    /// reads its chunks through: chunks this pod's sandboxes share (most of
    /// those of one template) are fetched from the store once. Least
    /// recently used chunks go first; 0 turns it off.
    #[arg(long, value_name = "MIB", default_value_t = torpor_scheduler::service::DEFAULT_CHUNK_CACHE_MIB)]
    pub chunk_cache_mib: u64,
    /// Where the tenants' volumes (E2B's `Volume`) are, for the Linux
    /// sandboxes that mount them (`volumeMounts`): `<data-dir>/volumes`,
    /// where `torpor serve` keeps them, unless given (a nested pod: the
    /// outer server's, shared into its host).
    #[arg(long, value_name = "DIR", conflicts_with = "volumes_relay")]
    pub volumes_dir: Option<std::path::PathBuf>,
    /// A nested pod's: send its sandboxes' volume connections to this
    /// address (the volume gateway of the `torpor serve` in front of it,
    /// which has the volumes) instead of serving volumes itself.
    #[arg(long, value_name = "ADDR", requires = "volumes_relay_token_file")]
    pub volumes_relay: Option<std::net::SocketAddr>,
    /// With --volumes-relay: the file holding the token the pod proves
    /// itself with to that gateway (its own token, which the server in
    /// front of it made).
    #[arg(long, value_name = "FILE", requires = "volumes_relay")]
    pub volumes_relay_token_file: Option<std::path::PathBuf>,
    /// Most bytes an E2B volume's files hold (MiB), whether written through
    /// the volume content API (past it: 413) or by a sandbox through its
    /// mount (past it: the guest's write fails with EDQUOT).
    #[arg(long, default_value_t = torpor_scheduler::volumes::usage::DEFAULT_LIMIT >> 20, value_parser = clap::value_parser!(u64).range(1..), value_name = "MIB")]
    pub volume_max_mib: u64,
    /// Default keep-alive of a sandbox before it is hibernated when idle
    /// (at most 30 days).
    #[arg(long, default_value_t = 300_000,
          value_parser = clap::value_parser!(u64).range(..=torpor_scheduler::service::MAX_KEEP_ALIVE_MS))]
    pub keep_alive_ms: u64,
    /// Longest a request may take (template builds boot a guest; under
    /// emulation that can take minutes); past it the answer is 504.
    #[arg(long, default_value_t = 120_000, value_name = "N")]
    pub request_timeout_ms: u64,
    /// Timeout of an exec that names none, and the longest one may name
    /// (larger ones are refused): no exec runs for ever.
    #[arg(long, default_value_t = torpor_scheduler::service::DEFAULT_EXEC_TIMEOUT_MS, value_name = "N")]
    pub exec_timeout_ms: u64,
    /// Standby VMM shells kept ready per (memory, vCPUs) shape of the
    /// pod's templates when idle; creates and wakes take one instead of
    /// starting a VMM (0 turns the pool off).
    #[arg(long, default_value_t = torpor_scheduler::service::DEFAULT_STANDBY_POOL, value_name = "N")]
    pub standby_pool: usize,
    /// Most standby shells per shape the pool grows to under bursts: it
    /// keeps as many as the most creates and wakes of a shape in one
    /// second, never more than the pod could still admit, none past
    /// --standby-pool while memory is above the high mark (set it to
    /// --standby-pool for a fixed pool).
    #[arg(long, default_value_t = torpor_scheduler::service::pool::DEFAULT_MAX, value_name = "N")]
    pub standby_pool_max: usize,
    /// How long after its largest burst the pool stays grown before it
    /// shrinks back to --standby-pool (stopping the shells beyond).
    #[arg(long, default_value_t = torpor_scheduler::service::pool::DEFAULT_IDLE_MS, value_name = "N")]
    pub standby_pool_idle_ms: u64,
    /// Standby shells made at once (0: one per core).
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub standby_refill_threads: usize,
    /// How restored guest memory is mapped: `file` (page-cache sharing,
    /// the default), `uffd-shared` (shared, faults observed, working set
    /// prefetched) or `uffd` (private copies of every touched page).
    #[arg(long, value_enum, default_value_t = PodBackendArg::File)]
    pub memory_backend: PodBackendArg,
    /// How VMM processes start: forked by one `torpor-vmm --fork-server`
    /// (the default: no exec per VMM, and the VMMs share its relocated
    /// pages; a server forks 256 VMMs, then a new one takes over) or each
    /// exec'd.
    #[arg(long, value_enum, default_value_t = VmmSpawnArg::Fork)]
    pub vmm_spawn: VmmSpawnArg,
    /// Where hibernation diffs take dirty pages from: KVM's dirty log (the
    /// default: cheapest to collect here) or userfaultfd write-protection.
    #[arg(long, value_enum, default_value_t = DirtyTrackingArg::Kvm)]
    pub dirty_tracking: DirtyTrackingArg,
    /// First uid of the range jailed VMMs run as (one uid per VMM).
    #[arg(long, default_value_t = torpor_vmm_api::jail::DEFAULT_JAIL_UID_BASE, value_name = "UID")]
    pub jail_uid_base: u32,
    /// Number of uids in that range: at most this many VMMs at once.
    #[arg(long, default_value_t = torpor_vmm_api::jail::DEFAULT_JAIL_UIDS, value_name = "N")]
    pub jail_uids: u32,
    /// The memory limit (cgroup) of every sandbox's jailed VMM, instead of
    /// its guest memory + 96 MiB: lower to oversubscribe (a guest that
    /// touches more is OOM-killed alone), higher where page cache is
    /// charged to it (a data directory on tmpfs).
    #[arg(long, value_name = "MIB", value_parser = clap::value_parser!(u64).range(64..=1 << 22))]
    pub sandbox_memory_max_mib: Option<u64>,
    /// Run every VMM without a jail, with the service's privileges
    /// (development machines only: a guest that escapes owns the host).
    #[arg(long)]
    pub no_jail: bool,
    /// Where images Linux templates are built from are installed
    /// (NAME/vmlinux, NAME/rootfs.ext4) [default: DATA_DIR/images].
    #[arg(long, value_name = "DIR")]
    pub images_dir: Option<PathBuf>,
    /// How long a deleted sandbox's row is kept before it is pruned.
    #[arg(long, default_value_t = torpor_scheduler::service::DEFAULT_DELETED_RETENTION_MS, value_name = "N")]
    pub deleted_retention_ms: u64,
    /// Record live traffic (creates, requests that wake or use a sandbox,
    /// deletes) as an activity trace `torpor plan --trace` reads
    /// (truncates FILE; see docs/operators.md).
    #[arg(long, value_name = "FILE")]
    pub record_trace: Option<PathBuf>,
    /// Give Linux sandboxes a network: a namespace each (torpor-sbx-N)
    /// with tap0, a veth to the host (10.200.0.0/16) and NAT; needs root,
    /// `ip` and `nft`. Egress is open but for the host, other sandboxes and
    /// link-local; see docs/security.md (Egress model).
    #[arg(long)]
    pub sandbox_network: bool,
    /// With --sandbox-network: sandboxes reach only the networks and
    /// domains given with --allow-out (and the DNS forwarder). A ceiling:
    /// no tenant policy turns internet back on.
    #[arg(long, requires = "sandbox_network")]
    pub no_internet: bool,
    /// With --sandbox-network: a network (a.b.c.d/len) or domain name
    /// sandboxes may reach; repeatable. The pod's policy is the default of
    /// sandboxes created without a `network` policy of their own, and the
    /// ceiling of those with one (tenants only narrow it).
    #[arg(long, value_name = "CIDR|DOMAIN", requires = "sandbox_network")]
    pub allow_out: Vec<String>,
    /// With --sandbox-network: a network or domain name sandboxes may not
    /// reach (wins over --allow-out; no tenant policy removes it);
    /// repeatable.
    #[arg(long, value_name = "CIDR|DOMAIN", requires = "sandbox_network")]
    pub deny_out: Vec<String>,
    /// With --sandbox-network: a service on this host sandboxes may reach
    /// (TCP and UDP), e.g. 10.200.0.1/32:3128; repeatable. Every other
    /// address of the host is closed to sandboxes (the DNS forwarder
    /// aside), as are other sandboxes and 169.254.0.0/16.
    #[arg(long, value_name = "ADDR[/LEN]:PORT", requires = "sandbox_network")]
    pub host_allow: Vec<String>,
    /// With --sandbox-network: the UDP port of the pod's DNS forwarder
    /// (guests' queries to their gateway go there); 0: no forwarder, and
    /// domain entries in policies never match.
    #[arg(
        long,
        default_value_t = 10053,
        value_name = "PORT",
        requires = "sandbox_network"
    )]
    pub sandbox_dns_port: u16,
    /// With --sandbox-network: the resolver the DNS forwarder asks
    /// [default: the first nameserver of /etc/resolv.conf].
    #[arg(long, value_name = "IP:PORT", requires = "sandbox_network")]
    pub sandbox_dns_upstream: Option<std::net::SocketAddr>,
}

/// When a hibernation with an object store is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum HibernateAckArg {
    Stored,
    Local,
}

impl HibernateAckArg {
    pub fn ack(self) -> torpor_scheduler::service::objects::HibernateAck {
        use torpor_scheduler::service::objects::HibernateAck;
        match self {
            HibernateAckArg::Stored => HibernateAck::Stored,
            HibernateAckArg::Local => HibernateAck::Local,
        }
    }
}

/// How a pod starts its VMM processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum VmmSpawnArg {
    Fork,
    Exec,
}

impl VmmSpawnArg {
    pub fn mode(self) -> torpor_scheduler::service::vmm_process::SpawnMode {
        use torpor_scheduler::service::vmm_process::SpawnMode;
        match self {
            VmmSpawnArg::Fork => SpawnMode::Fork,
            VmmSpawnArg::Exec => SpawnMode::Exec,
        }
    }
}

/// The memory backends a pod restores with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PodBackendArg {
    File,
    Uffd,
    UffdShared,
}

impl PodBackendArg {
    pub fn backend(self) -> torpor_vmm_api::MemoryBackend {
        match self {
            PodBackendArg::File => torpor_vmm_api::MemoryBackend::File,
            PodBackendArg::Uffd => torpor_vmm_api::MemoryBackend::Uffd,
            PodBackendArg::UffdShared => torpor_vmm_api::MemoryBackend::UffdShared,
        }
    }
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Address and port of the REST API.
    #[arg(long, default_value = "127.0.0.1:7700")]
    pub listen: std::net::SocketAddr,
    /// Also serve the E2B-compatible routes alone on this address (they are
    /// on --listen too, beside /v1): `E2B_API_URL=http://ADDR`.
    #[arg(long, value_name = "ADDR")]
    pub e2b_listen: Option<std::net::SocketAddr>,
    /// The domain of guest ports' host names: `{port}-{id}.DOMAIN` is
    /// proxied to that port of the sandbox's guest (on --listen,
    /// --e2b-listen and --proxy-listen), and E2B's create and connect
    /// answers carry it as `domain` (the SDKs' `get_host(port)`).
    /// `*.localhost` resolves to the loopback for curl and browsers.
    #[arg(long, value_name = "DOMAIN", default_value = "localhost")]
    pub proxy_domain: String,
    /// Also serve guest ports (and envd, port 49983) alone on this
    /// address: the address `*.DOMAIN` points at.
    #[arg(long, value_name = "ADDR")]
    pub proxy_listen: Option<std::net::SocketAddr>,
    /// Serve --proxy-listen over TLS: with --proxy-tls-cert/--proxy-tls-key
    /// (a wildcard certificate for `*.DOMAIN`), else a self-signed one for
    /// `*.DOMAIN` made on first start in DATA_DIR/proxy-tls (its
    /// fingerprint is printed).
    #[arg(long, requires = "proxy_listen")]
    pub proxy_tls: bool,
    /// The certificate of --proxy-listen (PEM; with --proxy-tls-key).
    #[arg(long, value_name = "PEM", requires_all = ["proxy_tls_key", "proxy_listen"])]
    pub proxy_tls_cert: Option<PathBuf>,
    /// The private key of --proxy-tls-cert (PEM).
    #[arg(long, value_name = "PEM", requires = "proxy_tls_cert")]
    pub proxy_tls_key: Option<PathBuf>,
    /// Where the store, templates and snapshots live (default:
    /// $TORPOR_DATA_DIR, /var/lib/torpor as root, else ~/.local/share/torpor).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Admin API bearer token (repeatable), besides the tokens in
    /// DATA_DIR/tenants.json (`torpor token create`). Without one, a first
    /// start creates an admin token there and prints it once. With
    /// --cluster the tokens live in PostgreSQL, shared by every replica:
    /// these and DATA_DIR/tenants.json's are written there (once), and a
    /// first start without any makes the admin token there.
    #[arg(long)]
    pub token: Vec<String>,
    #[command(flatten)]
    pub service: ServiceFlags,
    /// Run as one stateless API replica of a cluster instead of a pod of
    /// its own: shared state in PostgreSQL, commands to the pods (`torpor
    /// pod serve --cluster`) over NATS JetStream. Tenants, tokens and
    /// quotas are in PostgreSQL too.
    #[arg(
        long,
        value_name = "postgres://...,nats://...",
        conflicts_with = "nested_pod"
    )]
    pub cluster: Option<String>,
    /// In a cluster: how long a command waits for its pod's result before
    /// the answer is 202 with the operation (`Location:
    /// /v1/operations/{id}`, which gives the outcome later).
    #[arg(long, value_name = "MS", default_value_t = 20_000)]
    pub cluster_wait_ms: u64,
    /// In a cluster: a pod without a heartbeat for this long is down (its
    /// sandboxes answer 503 until it is back).
    #[arg(long, value_name = "MS", default_value_t = 4_000)]
    pub cluster_down_after_ms: u64,
    /// In a cluster: a pod without a heartbeat for this long is lost for
    /// good: its hibernated sandboxes whose snapshots are in the object
    /// store (pods' --object-store) wake on another pod when next used, and
    /// its stored templates create on other pods.
    #[arg(long, value_name = "MS", default_value_t = 60_000)]
    pub cluster_lost_after_ms: u64,
    /// In a cluster: a create's pod must start it within this of its
    /// admission, else it refuses it; past that and
    /// --cluster-create-grace-ms, a replica ends its operation as failed
    /// (503 `unavailable`) and its tenant's quota is free again.
    #[arg(long, value_name = "MS",
          default_value_t = torpor_cluster::expiry::DEFAULT_START.as_millis() as u64)]
    pub cluster_create_start_ms: u64,
    /// In a cluster: how long after its start deadline a create may still
    /// run (more than a create takes once started) before it is ended as
    /// failed; a pod deletes a create it finished past it.
    #[arg(long, value_name = "MS",
          default_value_t = torpor_cluster::expiry::DEFAULT_GRACE.as_millis() as u64)]
    pub cluster_create_grace_ms: u64,
    /// In a cluster: a create picks at random among this many of the pods
    /// ranked first (those holding the most bytes of its template's
    /// layers, then by admission headroom), so that replicas placing at
    /// once do not all pick the same pod; 1 always picks the first.
    #[arg(long, value_name = "N",
          default_value_t = torpor_cluster::replica::PLACEMENT_CHOICES)]
    pub cluster_placement_choices: usize,
    /// Serve the API over TLS with a self-signed certificate made on first
    /// start in DATA_DIR/tls (its fingerprint is printed; clients pin it
    /// with --api-fingerprint), or with --tls-cert/--tls-key.
    #[arg(long)]
    pub tls: bool,
    /// Serve TLS with this certificate (PEM; with --tls-key).
    #[arg(long, value_name = "PEM", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, value_name = "PEM", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Start the nested host for the Linux templates (`base`, and
    /// `code-interpreter-v1` when its image is there) now rather than on
    /// the first request for one. On a host whose /dev/kvm cannot boot Linux
    /// (PVM), Linux templates run in a nested hardware-virtualization host
    /// (QEMU/TCG with kvm_amd): a pod with the template `base`, about a
    /// core while it runs.
    #[arg(long, conflicts_with = "no_nested_pod")]
    pub nested_pod: bool,
    /// Never start the nested host: `base` is not offered on a host
    /// without VMX/SVM.
    #[arg(long)]
    pub no_nested_pod: bool,
    /// The guest kernel of `base` (default: built on first use by
    /// scripts/build-guest-kernel of this checkout, cached).
    #[arg(long, value_name = "VMLINUX")]
    pub nested_kernel: Option<PathBuf>,
    /// The root filesystem of `base` (default: built on first use by
    /// scripts/build-rootfs of this checkout with its agent, cached).
    #[arg(long, value_name = "EXT4")]
    pub nested_rootfs: Option<PathBuf>,
    /// The root filesystem of `code-interpreter-v1` (default: made with
    /// this checkout's agent from the tree `scripts/build-rootfs --variant
    /// interpreter` cached; without either it is not offered).
    #[arg(long, value_name = "EXT4", conflicts_with = "no_nested_interpreter")]
    pub nested_interpreter_rootfs: Option<PathBuf>,
    /// Leave `code-interpreter-v1` out of the nested host, even with its
    /// image there (`base` only: one guest fewer running in L1).
    #[arg(long)]
    pub no_nested_interpreter: bool,
    /// Memory of the nested host in MiB (its sandboxes live in it).
    #[arg(long, default_value_t = 3072, value_name = "MIB")]
    pub nested_mem_mib: u32,
    /// vCPUs of the nested host itself (L1; QEMU/TCG runs one thread per
    /// vCPU). 1 by default: on a quiet host, restored L2 guests
    /// triple-faulted or stopped taking interrupts in 3 to 38 of every 100
    /// sandbox cycles of the five-at-once soak with 2 (and L1's kernel
    /// panicked now and then), in none of 200 with 1 (docs/history.md,
    /// sessions 35 and 36).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64), value_name = "N")]
    pub nested_host_cpus: u32,
    /// vCPUs of the nested host's template `base` (1 by default: under
    /// QEMU/TCG, L1's KVM now and then lets a guest's secondary vCPU
    /// triple-fault, at boot and after a restore; and a second emulated
    /// vCPU adds no speed on TCG). A host with VMX/SVM builds `base` with 2.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=16), value_name = "N")]
    pub nested_vcpus: u32,
    /// The static torpor-agent put into templates built from OCI images
    /// (default: where scripts/build-agent of this checkout puts it, which
    /// the nested pod's preparation builds; their kernel is `base`'s:
    /// --nested-kernel, or scripts/build-guest-kernel's).
    #[arg(long, value_name = "PATH")]
    pub guest_agent: Option<PathBuf>,
    /// An extra CA (PEM) the registries template builds pull from are
    /// checked against, besides the system's roots.
    #[arg(long, value_name = "PEM")]
    pub registry_ca: Option<PathBuf>,
    /// A registry (`host` or `host:port`, as image references name it)
    /// template builds may pull from although it resolves to a loopback,
    /// private or link-local address; repeatable. Every other such
    /// registry is refused.
    #[arg(long = "registry-allow-private", value_name = "HOST[:PORT]")]
    pub private_registries: Vec<String>,
    /// Most E2B volumes a tenant has; another create is 400.
    #[arg(long, default_value_t = 100, value_name = "N")]
    pub volumes_per_tenant: usize,
}

/// `torpor pod serve`.
#[derive(Debug, Args)]
pub struct PodServeArgs {
    /// Where the pod's API listens: unix:/PATH or tcp:ADDR:PORT (TLS, with
    /// a certificate made on first start; see --plain-tcp).
    #[arg(long, value_name = "unix:PATH|tcp:ADDR:PORT")]
    pub listen: String,
    /// Where the pod's store, templates and snapshots live (default as for
    /// `torpor serve`).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// The file holding the pod's bearer token (created with a random one,
    /// mode 0600, if missing): what its callers present (a cluster's
    /// replicas, or the `torpor serve` of a nested pod).
    #[arg(long, value_name = "F")]
    pub token_file: PathBuf,
    /// On tcp:, serve plain HTTP instead of TLS: allowed on a loopback
    /// address only (the token and the sandboxes' traffic cross in clear).
    #[arg(long)]
    pub plain_tcp: bool,
    /// On tcp:, serve TLS with this certificate instead of the one made on
    /// first start in DATA_DIR/tls (PEM; with --tls-key).
    #[arg(long, value_name = "PEM", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, value_name = "PEM", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Join a cluster (`torpor serve --cluster` replicas): heartbeats with
    /// this pod's load, and operations from its own JetStream work queue.
    #[arg(long, value_name = "postgres://...,nats://...", requires = "pod_id")]
    pub cluster: Option<String>,
    /// This pod's id in the cluster (1-64 of a-z, 0-9 and -).
    #[arg(long, value_name = "ID")]
    pub pod_id: Option<String>,
    /// In a cluster: the heartbeat period.
    #[arg(long, value_name = "MS", default_value_t = 1_000)]
    pub heartbeat_ms: u64,
    #[command(flatten)]
    pub service: ServiceFlags,
}

/// How the `sandbox`, `template` and `pod` commands reach the API. Errors
/// print `torpor: error: MESSAGE (HTTP STATUS CODE)` and exit 1.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "API access")]
pub struct ClientArgs {
    /// Base URL of the API: http://HOST[:PORT], https://HOST[:PORT] (with
    /// --api-fingerprint) or unix:/PATH (a pod's socket) [default: $TORPOR_API,
    /// else http://127.0.0.1:7700].
    #[arg(long, global = true, value_name = "URL")]
    pub api: Option<String>,
    /// The SHA-256 fingerprint of an https:// API's certificate, the only
    /// one trusted [default: $TORPOR_API_FINGERPRINT].
    #[arg(long, global = true, value_name = "SHA256")]
    pub api_fingerprint: Option<String>,
    /// API bearer token [default: $TORPOR_TOKEN, else the token file of the
    /// default data directory: $TORPOR_DATA_DIR/token, /var/lib/torpor/token
    /// as root, else ~/.local/share/torpor/token].
    #[arg(long, global = true, value_name = "T")]
    pub token: Option<String>,
    /// Print the API's JSON answer as it is (pretty) instead of a table.
    #[arg(long, global = true)]
    pub json: bool,
}

fn parse_net(text: &str) -> Result<torpor_vmm_api::NetSpec, String> {
    torpor_vmm_api::NetSpec::parse(text).map_err(|e| e.message)
}
