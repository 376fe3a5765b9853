//! torpor-oci: OCI images made into torpor Linux template root
//! filesystems (issue 28, templates `FROM` an image).
//!
//! 1. Get the image: [`pull`] from a registry (anonymous or with
//!    [`Credentials`]; plain HTTP to loopback only unless told; an extra
//!    CA for a self-signed registry), or [`from_archive`] for an OCI
//!    layout or `docker save` tarball a client uploaded. Either gives an
//!    [`Image`]: the linux/amd64 manifest's layers in a content-addressed
//!    blob directory, every blob checked against its digest, and its
//!    [`ImageConfig`] (command, environment, working directory, user,
//!    ports) for the template's defaults.
//! 2. [`unpack`] it into a fresh directory: layers in order, whiteouts,
//!    hard links, symlinks stored as they are, ownership, modes, times and
//!    extended attributes. Every path is walked from the root's file
//!    descriptor one component at a time (`root.rs`): nothing is written
//!    outside it, and an entry that tries (`..`, an absolute path, a
//!    symlink out of the root, a hard link out of it) is refused with a
//!    typed [`Error::Refused`] naming the layer and entry; a tar bomb
//!    (entries, bytes, one file's bytes, compression ratio: [`Limits`]) is
//!    [`Error::Bomb`]. Each layer's uncompressed stream is checked against
//!    the config's diff id.
//! 3. [`make_template_rootfs`]: add torpor's init, the agent, the sandbox
//!    user with passwordless sudo, resolver, hostname and hosts, then
//!    `mkfs.ext4 -d` the tree into the template's image.
//!
//! Files: `pull.rs` (registry), `archive.rs` (tarballs), `image.rs` (the
//! image, its config and the OCI documents), `store.rs` (blob directory,
//! digests), `unpack.rs` (layers, decompression, limits), `entry.rs` (one
//! entry written), `root.rs` (the confined walk), `template.rs` and
//! `users.rs` (the template's additions), `error.rs`.

mod archive;
mod entry;
mod error;
mod image;
mod pull;
mod reach;
mod root;
mod store;
mod template;
mod unpack;
mod users;

pub use archive::from_archive;
pub use entry::Skipped;
pub use error::{BombLimit, Error, Refusal, Result};
pub use image::{Image, ImageConfig, Layer};
pub use pull::{pull, Credentials, Progress, PullEvent, PullOptions, Reference, PROGRESS_EVERY};
pub use reach::{is_global, Reach};
pub use store::Digest;
pub use template::{
    additions_digest, make_ext4, make_template_rootfs, prepare_root, TemplateOptions,
    TemplateReport, AGENT, TORPOR_INIT,
};
pub use unpack::{unpack, unpack_layers, LayerFile, Limits, UnpackReport};
