//! The client commands' arguments: `torpor sandbox`, `torpor template`.

use std::path::PathBuf;

use clap::{Args, Subcommand, ValueEnum};

use super::ClientArgs;

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
    /// Run a command in a sandbox (Linux templates) and exit with its
    /// status (128+N when killed by signal N, 124 when it timed out).
    /// Wakes a hibernated sandbox.
    Exec(ExecArgs),
    /// Read, write or list files in a sandbox (Linux templates).
    #[command(subcommand)]
    Files(FilesAction),
    /// Pause a running sandbox's vCPUs (its VMM stays).
    Pause(SandboxId),
    /// Resume a paused sandbox, or wake a hibernated one (says which, and
    /// how long the wake took).
    Resume(SandboxId),
    /// Connect to a sandbox: it runs afterwards (resumed or woken as
    /// needed) and counts as active.
    Connect(SandboxId),
    /// Hibernate a sandbox: snapshot it and end its VMM.
    Hibernate(SandboxId),
    /// Delete a sandbox (its VMM and snapshots go, but for layers its forks
    /// still sit on).
    #[command(visible_alias = "delete")]
    Rm(SandboxId),
    /// Take a named checkpoint of a running, paused or hibernated sandbox
    /// (it stays in the state it was in).
    Checkpoint(CheckpointArgs),
    /// List a sandbox's checkpoints: NAME, ID, PARENT, AGE.
    Checkpoints(SandboxId),
    /// Delete a checkpoint (its snapshot layers stay while forks or the
    /// sandbox's later snapshots sit on them).
    RmCheckpoint(CheckpointArgs),
    /// Replace a sandbox's VM with one restored from its checkpoint NAME;
    /// it runs afterwards.
    Restore(CheckpointArgs),
    /// Create a new sandbox from the checkpoint NAME of sandbox ID or,
    /// without NAME, from a fresh snapshot of its current state; print the
    /// new sandbox's id.
    Fork(ForkArgs),
}

#[derive(Debug, Args)]
pub struct CheckpointArgs {
    /// The sandbox id (sbx_...).
    #[arg(value_name = "ID")]
    pub id: String,
    /// The checkpoint's name (1-64 of A-Z a-z 0-9 . _ -).
    #[arg(value_name = "NAME")]
    pub name: String,
}

#[derive(Debug, Args)]
pub struct ForkArgs {
    /// The source sandbox id (sbx_...).
    #[arg(value_name = "ID")]
    pub id: String,
    /// The source's checkpoint [default: a fresh snapshot of its state].
    #[arg(value_name = "NAME")]
    pub name: Option<String>,
    /// Idle time after which the fork is hibernated, in ms.
    #[arg(long, value_name = "N")]
    pub keep_alive_ms: Option<u64>,
    /// Delete the fork this many ms after creation.
    #[arg(long, value_name = "N")]
    pub timeout_ms: Option<u64>,
    /// Metadata pair of the fork (repeatable).
    #[arg(long = "meta", value_name = "K=V", value_parser = key_value)]
    pub meta: Vec<(String, String)>,
    /// Wait for capacity instead of being refused when the pod is full.
    #[arg(long)]
    pub queue: bool,
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
    /// Place it on this pod (see `torpor pod list`) instead of letting the
    /// server choose.
    #[arg(long, value_name = "ID")]
    pub pod: Option<String>,
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
    /// Kill the command after this many ms (0: no limit; the API still
    /// ends the request after its own limit, 120 s by default).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub timeout_ms: u64,
    /// Working directory in the guest.
    #[arg(long, value_name = "DIR")]
    pub cwd: Option<String>,
    /// Environment variable for the command (repeatable).
    #[arg(long = "env", value_name = "K=V", value_parser = key_value)]
    pub env: Vec<(String, String)>,
    /// Send this command's stdin to the command's stdin.
    #[arg(long)]
    pub stdin: bool,
    /// Print output as the command writes it (the API's NDJSON stream)
    /// instead of when it ends.
    #[arg(long)]
    pub stream: bool,
    /// The program and its arguments, after `--`.
    #[arg(last = true, required = true, value_name = "ARGV")]
    pub argv: Vec<String>,
}

#[derive(Debug, Subcommand)]
pub enum FilesAction {
    /// Print a file of the guest (or write it to --out).
    Get(FileGetArgs),
    /// Write a file of the guest from --from (default: stdin); parent
    /// directories are created.
    Put(FilePutArgs),
    /// List a directory of the guest: KIND, MODE, SIZE, NAME.
    Ls(FileLsArgs),
}

#[derive(Debug, Args)]
pub struct FileGetArgs {
    #[arg(value_name = "ID")]
    pub id: String,
    /// Absolute path in the guest.
    #[arg(value_name = "PATH")]
    pub path: String,
    /// Write it here instead of stdout.
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct FilePutArgs {
    #[arg(value_name = "ID")]
    pub id: String,
    /// Absolute path in the guest.
    #[arg(value_name = "PATH")]
    pub path: String,
    /// The local file to send [default: stdin].
    #[arg(long, value_name = "FILE")]
    pub from: Option<PathBuf>,
    /// Permission bits, octal (e.g. 755).
    #[arg(long, value_name = "OCTAL")]
    pub mode: Option<String>,
}

#[derive(Debug, Args)]
pub struct FileLsArgs {
    #[arg(value_name = "ID")]
    pub id: String,
    /// Absolute path of a directory in the guest.
    #[arg(value_name = "PATH")]
    pub path: String,
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
    /// Build a template from a Dockerfile in a sandbox (cached by step):
    /// upload what COPY copies, start the build, follow its log.
    Build(TemplateBuildArgs),
}

#[derive(Debug, Args)]
pub struct TemplateBuildArgs {
    /// The Dockerfile [default: CONTEXT/Dockerfile].
    #[arg(short = 'f', long = "file", value_name = "PATH")]
    pub file: Option<PathBuf>,
    /// The template's name [default: the context directory's name].
    #[arg(long, value_name = "N")]
    pub name: Option<String>,
    /// A build argument (ARG), `KEY=VALUE`; repeatable.
    #[arg(long = "build-arg", value_name = "KEY=VALUE")]
    pub build_args: Vec<String>,
    /// Rebuild every step (no cached layer used).
    #[arg(long)]
    pub no_cache: bool,
    /// Start the build and print its id without following it.
    #[arg(long)]
    pub detach: bool,
    /// The build context: the directory COPY sources are relative to.
    #[arg(value_name = "CONTEXT", default_value = ".")]
    pub context: PathBuf,
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
    /// A Linux kernel and rootfs with torpor-agent (needs VMX/SVM: on a
    /// PVM host, run the service in the nested host).
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
    /// Linux: the image to build it from (its name: `torpor image list`;
    /// a kernel and a root filesystem with torpor-agent, never written:
    /// the guest writes to its own overlay).
    #[arg(long, value_name = "NAME")]
    pub image: Option<String>,
    /// The kernel command line [default: the service's for the kind].
    #[arg(long, value_name = "ARGS")]
    pub cmdline: Option<String>,
    /// Build it on this pod (templates are per pod) [default: the local pod].
    #[arg(long, value_name = "ID")]
    pub pod: Option<String>,
}
