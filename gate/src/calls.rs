//! The typed requests [`SandboxApi`] takes, one per resource (templates,
//! images, a sandbox's files, an exec), with their replies, and the helpers
//! backends answer guest calls with ([`map_call`], [`through_tunnel`]).
//!
//! A backend implements one method per resource and matches the request;
//! callers use the typed calls of [`SandboxCalls`] (`s.get_template(&id)`,
//! `s.read_file(&id, path)`, `s.exec(..)`), which unwrap the reply of their
//! request.
//!
//! [`SandboxApi`]: crate::backend::SandboxApi
//! [`SandboxCalls`]: crate::backend::typed::SandboxCalls

use torpor_scheduler::images::ImagePart;
use torpor_scheduler::model::{PodId, Template};
use torpor_scheduler::service::guest::MAX_READ_BYTES;

use crate::service::{
    AgentLink, CreateTemplate, DirListing, ExecOutput, ExitReply, GuestCall, GuestError, Outcome,
    OutputKind, Owner, ServiceError,
};

/// A template call (`/v1/templates`):
/// [`SandboxApi::templates`](crate::backend::SandboxApi::templates). A
/// get or delete names its template by `key`, an id or a name, resolved
/// for `owner` ([`torpor_scheduler::names`]: its own, then shared ones;
/// another tenant's is not found); `owner: None` is the server's own
/// read, which sees every template (deleted ones by id too).
#[derive(Debug, Clone)]
pub enum TemplateOp<'a> {
    List,
    Get {
        key: &'a str,
        owner: Option<&'a Owner>,
    },
    Create(CreateTemplate),
    Delete {
        key: &'a str,
        owner: Option<&'a Owner>,
    },
    /// Renamed (a rebuilt template's old one, out of its name's way).
    Rename {
        key: &'a str,
        owner: Option<&'a Owner>,
        name: &'a str,
    },
}

/// A [`TemplateOp`]'s answer, the variant of its call.
#[derive(Debug)]
pub enum TemplateReply {
    List(Vec<Template>),
    /// The template got or created.
    One(Box<Template>),
    Deleted,
}

impl TemplateReply {
    pub fn one(t: Template) -> Self {
        TemplateReply::One(Box::new(t))
    }
}

/// An images call (`/v1/images`):
/// [`SandboxApi::images`](crate::backend::SandboxApi::images).
pub enum ImageOp<'a> {
    /// The names of the images installed.
    List,
    /// One file of image `name` from `body` (at most `limit` bytes), on
    /// `pod` if named.
    Install {
        name: &'a str,
        part: ImagePart,
        body: &'a mut (dyn std::io::Read + Send),
        limit: u64,
        pod: Option<&'a PodId>,
    },
    Delete(&'a str),
}

impl std::fmt::Debug for ImageOp<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ImageOp::List => f.write_str("List"),
            ImageOp::Install {
                name, part, pod, ..
            } => f
                .debug_struct("Install")
                .field("name", name)
                .field("part", &part.file_name())
                .field("pod", pod)
                .finish_non_exhaustive(),
            ImageOp::Delete(name) => f.debug_tuple("Delete").field(name).finish(),
        }
    }
}

/// An [`ImageOp`]'s answer, the variant of its call.
#[derive(Debug)]
pub enum ImageReply {
    List(Vec<String>),
    /// The bytes of the file installed.
    Installed(u64),
    Deleted,
}

/// A file call on a sandbox's agent (`/v1/sandboxes/{id}/files`, E2B's
/// `/files`): [`SandboxApi::files`](crate::backend::SandboxApi::files).
#[derive(Debug, Clone, Copy)]
pub enum FileOp<'a> {
    /// The file's bytes (at most [`MAX_READ_BYTES`]).
    Read { path: &'a str },
    /// Writes (replaces) the file, creating missing parents; with an
    /// `owner`, the file and the parents it creates are that user's
    /// (agent 1.4).
    Write {
        path: &'a str,
        data: &'a [u8],
        mode: Option<u32>,
        owner: Option<&'a str>,
    },
    /// The directory's entries.
    List { path: &'a str },
}

/// A [`FileOp`]'s answer, the variant of its call.
#[derive(Debug)]
pub enum FileReply {
    Read(Vec<u8>),
    /// The file's size.
    Written(u64),
    List(DirListing),
}

impl FileOp<'_> {
    /// The call on an agent reached through `link`.
    pub fn run(self, link: &AgentLink) -> Result<FileReply, GuestError> {
        Ok(match self {
            FileOp::Read { path } => FileReply::Read(link.read_file(path, MAX_READ_BYTES)?),
            FileOp::Write {
                path,
                data,
                mode,
                owner,
            } => FileReply::Written(link.write_file_as(path, data, mode, owner)?),
            FileOp::List { path } => FileReply::List(link.list_dir(path)?),
        })
    }
}

/// Where an exec's output goes:
/// [`SandboxApi::execute`](crate::backend::SandboxApi::execute).
pub enum ExecMode<'a> {
    /// Collected into the answer ([`ExecReply::Collected`]).
    Collect,
    /// `on_start` hears that the sandbox runs, before any output; then each
    /// chunk goes to `on_output` as the agent streams it
    /// ([`ExecReply::Streamed`]).
    Stream {
        on_start: &'a mut (dyn FnMut(&Outcome) + Send),
        on_output: &'a mut (dyn FnMut(OutputKind, &[u8]) + Send),
    },
}

impl std::fmt::Debug for ExecMode<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ExecMode::Collect => "Collect",
            ExecMode::Stream { .. } => "Stream",
        })
    }
}

/// An exec's answer, the variant of its [`ExecMode`].
#[derive(Debug)]
pub enum ExecReply {
    Collected(ExecOutput),
    /// How the command ended (its output went to `on_output`).
    Streamed(ExitReply),
}

/// `call` with its value mapped by `f`.
pub fn map_call<T, U>(call: GuestCall<T>, f: impl FnOnce(T) -> U) -> GuestCall<U> {
    GuestCall {
        outcome: call.outcome,
        value: f(call.value),
    }
}

/// One call on a sandbox's agent handed to a backend's `with_guest` (or
/// its tunnel to a remote agent), which hands it the link: [`OneCall::run`]
/// is what it calls, [`OneCall::finish`] the call's value with the
/// backend's outcome.
pub struct OneCall<T, F> {
    call: Option<F>,
    value: Option<T>,
}

impl<T, F> std::fmt::Debug for OneCall<T, F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OneCall")
    }
}

impl<T, F: FnOnce(&AgentLink) -> Result<T, GuestError>> OneCall<T, F> {
    pub fn new(call: F) -> Self {
        OneCall {
            call: Some(call),
            value: None,
        }
    }

    /// The call on `link` (once: a second hand-over does nothing).
    pub fn run(&mut self, link: &AgentLink) -> Result<(), GuestError> {
        if let Some(call) = self.call.take() {
            self.value = Some(call(link)?);
        }
        Ok(())
    }

    /// The call's value with `outcome`, the backend's.
    pub fn finish(self, outcome: Outcome) -> Result<GuestCall<T>, ServiceError> {
        let value = self
            .value
            .ok_or_else(|| ServiceError::Internal("the agent call did not run".into()))?;
        Ok(GuestCall { outcome, value })
    }
}

/// One call on a sandbox's agent through `tunnel` (a backend's
/// `with_guest`, from a thread that may block): [`OneCall`].
pub fn through_tunnel<T: Send>(
    tunnel: impl FnOnce(
        &mut (dyn FnMut(&AgentLink) -> Result<(), GuestError> + Send),
    ) -> Result<Outcome, ServiceError>,
    call: impl FnOnce(&AgentLink) -> Result<T, GuestError> + Send,
) -> Result<GuestCall<T>, ServiceError> {
    let mut one = OneCall::new(call);
    let outcome = tunnel(&mut |link| one.run(link))?;
    one.finish(outcome)
}
