//! Command-line interface. Exit status everywhere: 0 success, 1 bad
//! configuration or a failed request, 2 usage error, 3 the VM failed.

use std::path::PathBuf;

use clap::{ArgGroup, Args, Parser, Subcommand, ValueEnum};

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
    Serve(ServeArgs),
    /// Sandboxes, through the REST API of `torpor serve`: create, list, get,
    /// exec, pause, resume, hibernate, rm.
    Sandbox(SandboxCommand),
    /// Templates, through the REST API: list, get, create, rm.
    Template(TemplateCommand),
    /// Pods (the hosts sandboxes run on), through the REST API: list, set.
    Pod(PodCommand),
    /// Write the built-in probe guest kernel (an ELF) to a file.
    ProbeImage {
        /// Where to write it.
        #[arg(long)]
        out: PathBuf,
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
    /// Run a command in the guest through torpor-agent over the VM's vsock
    /// socket; prints its output and exits with its status.
    Exec(GuestExecArgs),
    /// Tell the guest agent it was restored: it reads the identity page,
    /// sets the wall clock and reseeds the kernel RNG. Prints its report;
    /// exits 1 unless the clock and the RNG steps succeeded.
    Resumed(GuestAgentArgs),
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
    /// At exit, print boot phase timings and the exit reason as one JSON
    /// line on stderr.
    #[arg(long)]
    pub report: bool,
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Address and port of the REST API.
    #[arg(long, default_value = "127.0.0.1:7700")]
    pub listen: std::net::SocketAddr,
    /// Where the store, templates and snapshots live (default:
    /// $TORPOR_DATA_DIR, /var/lib/torpor as root, else ~/.local/share/torpor).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// API bearer token (repeatable). Without one, a token is read from (or
    /// created in) DATA_DIR/token.
    #[arg(long)]
    pub token: Vec<String>,
    /// How often the hibernation policy runs, in ms (0 turns it off).
    #[arg(long, default_value_t = 1000)]
    pub policy_interval_ms: u64,
    /// Default keep-alive of a sandbox before it is hibernated when idle.
    #[arg(long, default_value_t = 300_000)]
    pub keep_alive_ms: u64,
}

/// How the `sandbox`, `template` and `pod` commands reach the API. Errors
/// print `torpor: error: MESSAGE (HTTP STATUS CODE)` and exit 1.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "API access")]
pub struct ClientArgs {
    /// Base URL of the API, http only [default: $TORPOR_API, else
    /// http://127.0.0.1:7700].
    #[arg(long, global = true, value_name = "URL")]
    pub api: Option<String>,
    /// API bearer token [default: $TORPOR_TOKEN, else the token file of the
    /// default data directory: $TORPOR_DATA_DIR/token, /var/lib/torpor/token
    /// as root, else ~/.local/share/torpor/token].
    #[arg(long, global = true, value_name = "T")]
    pub token: Option<String>,
    /// Print the API's JSON answer as it is (pretty) instead of a table.
    #[arg(long, global = true)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct SandboxCommand {
    #[command(flatten)]
    pub client: ClientArgs,
    #[command(subcommand)]
    pub action: SandboxAction,
}

#[derive(Debug, Subcommand)]
pub enum SandboxAction {
    /// Create a sandbox from a template (restored from its snapshot) and
    /// print its id.
    Create(SandboxCreateArgs),
    /// List sandboxes: ID, STATE, TEMPLATE, MEM, AGE, LAST ACTIVE, METADATA.
    #[command(visible_alias = "ls")]
    List(SandboxListArgs),
    /// Show one sandbox.
    Get(SandboxId),
    /// Run a command in a sandbox (not served yet: the API answers 501).
    Exec(ExecArgs),
    /// Pause a running sandbox's vCPUs (its VMM stays).
    Pause(SandboxId),
    /// Resume a paused sandbox, or wake a hibernated one (says which, and
    /// how long the wake took).
    Resume(SandboxId),
    /// Hibernate a sandbox: snapshot it and end its VMM.
    Hibernate(SandboxId),
    /// Delete a sandbox (its VMM and snapshots go).
    #[command(visible_alias = "delete")]
    Rm(SandboxId),
}

#[derive(Debug, Args)]
pub struct SandboxId {
    /// The sandbox id (sbx_...).
    #[arg(value_name = "ID")]
    pub id: String,
}

/// The states a sandbox can be in (for `sandbox list --state`).
pub const SANDBOX_STATES: &[&str] = &[
    "creating",
    "running",
    "paused",
    "hibernating",
    "hibernated",
    "resuming",
    "deleted",
    "failed",
];

#[derive(Debug, Args)]
pub struct SandboxCreateArgs {
    /// Template name or id.
    #[arg(long, value_name = "NAME")]
    pub template: String,
    /// Idle time after which it is hibernated, in ms [default: the
    /// service's, `torpor serve --keep-alive-ms`].
    #[arg(long, value_name = "N")]
    pub keep_alive_ms: Option<u64>,
    /// Delete it this many ms after creation, whatever its activity.
    #[arg(long, value_name = "N")]
    pub timeout_ms: Option<u64>,
    /// Metadata pair (repeatable).
    #[arg(long = "meta", value_name = "K=V", value_parser = key_value)]
    pub meta: Vec<(String, String)>,
    /// Wait for capacity instead of being refused (HTTP 429) when the pod is
    /// full.
    #[arg(long)]
    pub queue: bool,
}

#[derive(Debug, Args)]
pub struct SandboxListArgs {
    /// Only sandboxes in this state (repeatable: any of them).
    #[arg(long, value_name = "S", value_parser = clap::builder::PossibleValuesParser::new(SANDBOX_STATES))]
    pub state: Vec<String>,
    /// Only sandboxes of this template (name or id).
    #[arg(long, value_name = "T")]
    pub template: Option<String>,
    /// Only sandboxes with this metadata pair (repeatable: all of them).
    #[arg(long = "meta", value_name = "K=V", value_parser = key_value)]
    pub meta: Vec<(String, String)>,
}

#[derive(Debug, Args)]
pub struct ExecArgs {
    /// The sandbox id (sbx_...).
    #[arg(value_name = "ID")]
    pub id: String,
    /// The program and its arguments, after `--`.
    #[arg(last = true, required = true, value_name = "ARGV")]
    pub argv: Vec<String>,
}

/// `K=V` into its two halves.
fn key_value(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("expected KEY=VALUE, got {s:?}")),
    }
}

#[derive(Debug, Args)]
pub struct TemplateCommand {
    #[command(flatten)]
    pub client: ClientArgs,
    #[command(subcommand)]
    pub action: TemplateAction,
}

#[derive(Debug, Subcommand)]
pub enum TemplateAction {
    /// List templates: ID, NAME, KIND, STATE, MEM.
    #[command(visible_alias = "ls")]
    List,
    /// Show one template.
    Get(TemplateId),
    /// Create a template (booted once and snapshotted) and print its id.
    Create(TemplateCreateArgs),
    /// Delete a template.
    #[command(visible_alias = "delete")]
    Rm(TemplateId),
}

#[derive(Debug, Args)]
pub struct TemplateId {
    /// The template id (tpl_...) or name.
    #[arg(value_name = "ID")]
    pub id: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TemplateKindArg {
    /// The freestanding probe guest (runs natively, even on PVM hosts).
    Probe,
    /// A Linux kernel and rootfs with torpor-agent (not served yet).
    Linux,
}

#[derive(Debug, Args)]
pub struct TemplateCreateArgs {
    /// Its name (unique among live templates).
    #[arg(long, value_name = "N")]
    pub name: String,
    /// What it boots.
    #[arg(long, value_enum)]
    pub kind: TemplateKindArg,
    /// Guest memory in MiB [default: the service's, 64].
    #[arg(long, value_name = "N")]
    pub mem_mib: Option<u32>,
    /// Number of vCPUs [default: the service's, 1].
    #[arg(long, value_name = "N")]
    pub vcpus: Option<u32>,
}

#[derive(Debug, Args)]
pub struct PodCommand {
    #[command(flatten)]
    pub client: ClientArgs,
    #[command(subcommand)]
    pub action: PodAction,
}

#[derive(Debug, Subcommand)]
pub enum PodAction {
    /// List pods: ID, MEMORY, RATIO, WATERMARK, COMMITTED, PSS, SANDBOXES.
    #[command(visible_alias = "ls")]
    List,
    /// Change a pod's oversubscription ratio and/or high watermark.
    Set(PodSetArgs),
}

#[derive(Debug, Args)]
#[command(group(ArgGroup::new("change").required(true).multiple(true)))]
pub struct PodSetArgs {
    /// The pod id.
    #[arg(value_name = "ID")]
    pub id: String,
    /// Committed sandbox memory allowed per byte of physical memory
    /// (0 < F <= 100); creates past it are refused (HTTP 429).
    #[arg(long, value_name = "F", group = "change")]
    pub ratio: Option<f64>,
    /// Fraction of physical memory (measured PSS) past which idle sandboxes
    /// are hibernated, least recently used first (0 < F <= 1).
    #[arg(long, value_name = "F", group = "change")]
    pub high_watermark: Option<f64>,
}
