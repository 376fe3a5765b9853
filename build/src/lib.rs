//! torpor-build: template builds (issue 28), the pure part. A template is
//! built from a template, an OCI image or an upload, through a chain of
//! steps (RUN, COPY, ENV, WORKDIR, USER), and snapshotted with its start
//! command running once a ready check passes. This crate holds what can
//! be decided without a sandbox; the executor (another crate) runs the
//! steps in a sandbox through the service's API, with these types:
//!
//! - [`BuildSpec`] (`spec`): the build, the `/v1` request body, validated
//!   ([`BuildSpec::validate`], `validate`);
//! - [`ReadyCheck`] (`ready`): when the start command is ready, as a shell
//!   command for the guest;
//! - [`Environment`] (`env`): user, directory and variables folded through
//!   the steps, and the [`GuestCommand`] or [`CopyPlan`] of each step;
//! - [`e2b`]: E2B's build body (`TemplateBuildStartV2`) and its conversion,
//!   so that E2B's template builder works unchanged;
//! - [`dockerfile`]: a Dockerfile as a spec (`torpor template build -f`);
//! - [`key`]: each layer's cache key, and whether the cache may serve it;
//! - [`context`]: a COPY's build-context files as a deterministic gzip'd
//!   tar and its hash (`.dockerignore` and globs: `ignore`).

pub mod context;
pub mod dockerfile;
pub mod e2b;
pub mod env;
pub mod ignore;
pub mod key;
pub mod ready;
pub mod shell;
pub mod spec;
pub mod validate;

pub use context::{pack, pack_into, ContextError, PackSummary, Packed};
pub use dockerfile::{
    parse as parse_dockerfile, CopyInput, DockerfileError, ParsedDockerfile, Problem,
};
pub use e2b::{E2bError, RegistryConfig, TemplateBuildStartV2, TemplateStep};
pub use env::{CopyPlan, Environment, GuestCommand, DEFAULT_USER};
pub use ignore::{BadPattern, Ignore};
pub use key::{layer_keys, source_key, Layer, LayerKey};
pub use ready::ReadyCheck;
pub use spec::{BuildSpec, Secret, Source, Start, Step, MAX_STEPS};
pub use validate::{Invalid, SpecError};
