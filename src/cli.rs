//! Command-line interface. Exit status everywhere: 0 success, 1 bad
//! configuration or a failed request, 2 usage error, 3 the VM failed.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

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
