//! The admin commands' arguments: `torpor image`, `torpor token`,
//! `torpor pod`.

use std::path::PathBuf;

use clap::{ArgGroup, Args, Subcommand};

use super::{ClientArgs, PodServeArgs};

#[derive(Debug, Args)]
pub struct ImageCommand {
    #[command(flatten)]
    pub client: ClientArgs,
    #[command(subcommand)]
    pub action: ImageAction,
}

#[derive(Debug, Subcommand)]
pub enum ImageAction {
    /// List installed images.
    #[command(visible_alias = "ls")]
    List,
    /// Upload an image's kernel and/or root filesystem (admin).
    #[command(group(ArgGroup::new("part").required(true).multiple(true)))]
    Upload {
        /// The image's name.
        #[arg(value_name = "NAME")]
        name: String,
        /// The kernel (vmlinux) to upload.
        #[arg(long, value_name = "FILE", group = "part")]
        kernel: Option<PathBuf>,
        /// The root filesystem (ext4, with torpor-agent) to upload.
        #[arg(long, value_name = "FILE", group = "part")]
        rootfs: Option<PathBuf>,
    },
    /// Remove an image no template uses (admin).
    #[command(visible_alias = "remove")]
    Rm {
        #[arg(value_name = "NAME")]
        name: String,
    },
}

#[derive(Debug, Args)]
pub struct TokenCommand {
    #[command(flatten)]
    pub client: ClientArgs,
    #[command(subcommand)]
    pub action: TokenAction,
}

#[derive(Debug, Subcommand)]
pub enum TokenAction {
    /// Create a token for a tenant and print it (shown this once).
    Create {
        /// The tenant it acts for.
        #[arg(long, value_name = "T")]
        tenant: String,
        /// An admin token (every tenant, pods, images, tokens, quotas)
        /// instead of a tenant token.
        #[arg(long)]
        admin: bool,
    },
    /// List tokens: ID, TENANT, SCOPE, CREATED (never the tokens).
    #[command(visible_alias = "ls")]
    List,
    /// Revoke a token.
    #[command(visible_alias = "remove")]
    Rm {
        /// The token's id (tok_...).
        #[arg(value_name = "ID")]
        id: String,
    },
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
    /// List pods: ID, ADDRESS, MEMORY, RATIO, WATERMARK, COMMITTED, PSS,
    /// SANDBOXES (a pod that does not answer: `unreachable` and why).
    #[command(visible_alias = "ls")]
    List,
    /// Change a pod's oversubscription ratio and/or high watermark.
    Set(PodSetArgs),
    /// Run a pod: the sandbox service of this host (its VMMs, store and
    /// hibernation policy) behind the REST API on a unix socket or TCP:
    /// with --cluster, one of a cluster's pods (it registers itself and
    /// takes commands from its work queue); without, a pod alone (what
    /// `torpor serve` runs in its nested host).
    Serve(Box<PodServeArgs>),
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
