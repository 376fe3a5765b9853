//! Operations [`SandboxApi`] takes as one typed request per resource
//! (templates, a sandbox's files, an exec), and [`SandboxCalls`]: the typed
//! call of each, for every backend at once.
//!
//! A backend implements one method per resource and matches the request;
//! callers use the typed calls (`s.get_template(&id)`, `s.read_file(&id,
//! path)`, `s.exec(..)`), which unwrap the reply of their request.

use torpor_scheduler::images::ImagePart;
use torpor_scheduler::model::{Checkpoint, PodId, SandboxId, Template, TemplateId};
use torpor_scheduler::service::guest::MAX_READ_BYTES;

use torpor_sandbox_api::{Operation, Reply};

use crate::backend::SandboxApi;
use crate::service::{
    AgentLink, Cancel, CreateCheckpoint, CreateTemplate, DirListing, ExecOutput, ExecRequest,
    ExitReply, GuestCall, GuestError, Outcome, OutputKind, Owner, ServiceError,
};

/// A template call (`/v1/templates`): [`SandboxApi::templates`]. A get
/// or delete names its template by `key`, an id or a name, resolved for
/// `owner` ([`torpor_scheduler::names`]: its own, then shared ones;
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

/// An images call (`/v1/images`): [`SandboxApi::images`].
pub enum ImageOp<'a> {
    /// The names of the images installed.
    List,
    /// One file of image `name` from `body` (at most `limit` bytes), on
    /// `pod` if named.
    Install {
        name: &'a str,
        part: ImagePart,
        body: &'a mut dyn std::io::Read,
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
/// `/files`): [`SandboxApi::files`].
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

/// Where an exec's output goes: [`SandboxApi::execute`].
pub enum ExecMode<'a> {
    /// Collected into the answer ([`ExecReply::Collected`]).
    Collect,
    /// `on_start` hears that the sandbox runs, before any output; then each
    /// chunk goes to `on_output` as the agent streams it
    /// ([`ExecReply::Streamed`]).
    Stream {
        on_start: &'a mut dyn FnMut(&Outcome),
        on_output: &'a mut dyn FnMut(OutputKind, &[u8]),
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

/// One call on a sandbox's agent through `tunnel` (a backend's
/// `with_guest`, which hands it the link to a remote agent): `call`'s value
/// with the tunnel's outcome.
pub fn through_tunnel<T>(
    tunnel: impl FnOnce(
        &mut dyn FnMut(&AgentLink) -> Result<(), GuestError>,
    ) -> Result<Outcome, ServiceError>,
    call: impl FnOnce(&AgentLink) -> Result<T, GuestError>,
) -> Result<GuestCall<T>, ServiceError> {
    let mut call = Some(call);
    let mut value = None;
    let outcome = tunnel(&mut |link| {
        if let Some(call) = call.take() {
            value = Some(call(link)?);
        }
        Ok(())
    })?;
    let value = value.ok_or_else(|| ServiceError::Internal("the agent call did not run".into()))?;
    Ok(GuestCall { outcome, value })
}

/// A backend answered `call` with another call's reply.
fn mismatched(call: &str) -> ServiceError {
    ServiceError::Internal(format!("the backend answered a {call} with another reply"))
}

/// A guest call's value as `T`, if its reply is of that call.
fn value_of<R, T>(
    call: GuestCall<R>,
    name: &str,
    f: fn(R) -> Option<T>,
) -> Result<GuestCall<T>, ServiceError> {
    let GuestCall { outcome, value } = call;
    let value = f(value).ok_or_else(|| mismatched(name))?;
    Ok(GuestCall { outcome, value })
}

/// The typed calls of [`SandboxApi`]'s requests, for every backend: a
/// supertrait of it (so they are in scope wherever it is), implemented once
/// for all of them below (so no backend writes its own).
pub trait SandboxCalls {
    fn list_templates(&self) -> Result<Vec<Template>, ServiceError>
    where
        Self: SandboxApi,
    {
        match self.templates(TemplateOp::List)? {
            TemplateReply::List(list) => Ok(list),
            _ => Err(mismatched("template list")),
        }
    }
    /// Template `id`, whosever (the server's own read; a caller's is
    /// [`SandboxCalls::resolve_template`]).
    fn get_template(&self, id: &TemplateId) -> Result<Template, ServiceError>
    where
        Self: SandboxApi,
    {
        self.template_get(None, id.as_str())
    }
    /// The template `key` (id or name) names for `owner`: its own, then a
    /// shared one; another tenant's is not found.
    fn resolve_template(&self, owner: &Owner, key: &str) -> Result<Template, ServiceError>
    where
        Self: SandboxApi,
    {
        self.template_get(Some(owner), key)
    }
    /// The template `key` names for `owner` (none: the server's own read).
    fn template_get(&self, owner: Option<&Owner>, key: &str) -> Result<Template, ServiceError>
    where
        Self: SandboxApi,
    {
        match self.templates(TemplateOp::Get { key, owner })? {
            TemplateReply::One(t) => Ok(*t),
            _ => Err(mismatched("template get")),
        }
    }
    fn create_template(&self, req: CreateTemplate) -> Result<Template, ServiceError>
    where
        Self: SandboxApi,
    {
        match self.templates(TemplateOp::Create(req))? {
            TemplateReply::One(t) => Ok(*t),
            _ => Err(mismatched("template create")),
        }
    }
    /// Deletes the template `key` names for `owner` (none: the server's
    /// own call): a tenant its own; a shared one is 403, another tenant's
    /// not found.
    fn delete_template(&self, owner: Option<&Owner>, key: &str) -> Result<(), ServiceError>
    where
        Self: SandboxApi,
    {
        match self.templates(TemplateOp::Delete { key, owner })? {
            TemplateReply::Deleted => Ok(()),
            _ => Err(mismatched("template delete")),
        }
    }
    /// The names of the images installed (a cluster's: on the pods up).
    fn image_names(&self) -> Result<Vec<String>, ServiceError>
    where
        Self: SandboxApi,
    {
        match self.images(ImageOp::List)? {
            ImageReply::List(names) => Ok(names),
            _ => Err(mismatched("image list")),
        }
    }
    /// Takes a checkpoint of sandbox `id` ([`Operation::Checkpoint`]).
    /// Listing and restoring are the pod's own (a cluster relays them to
    /// the owning pod).
    fn checkpoint(&self, id: &SandboxId, req: CreateCheckpoint) -> Result<Checkpoint, ServiceError>
    where
        Self: SandboxApi,
    {
        let op = Operation::Checkpoint {
            sandbox: id.clone(),
            request: Box::new(req),
        };
        match self.operate(op)? {
            Reply::Checkpoint { checkpoint } => Ok(*checkpoint),
            _ => Err(mismatched("checkpoint create")),
        }
    }
    /// Deletes checkpoint `name` of sandbox `id`
    /// ([`Operation::CheckpointDelete`]).
    fn delete_checkpoint(&self, id: &SandboxId, name: &str) -> Result<(), ServiceError>
    where
        Self: SandboxApi,
    {
        let op = Operation::CheckpointDelete {
            sandbox: id.clone(),
            name: name.to_string(),
        };
        match self.operate(op)? {
            Reply::CheckpointDeleted { .. } => Ok(()),
            _ => Err(mismatched("checkpoint delete")),
        }
    }
    /// Runs a command, its output collected; `cancel` ends it early (its
    /// client went away): the command is killed in the guest.
    fn exec(
        &self,
        id: &SandboxId,
        req: ExecRequest,
        cancel: &Cancel,
    ) -> Result<GuestCall<ExecOutput>, ServiceError>
    where
        Self: SandboxApi,
    {
        value_of(
            self.execute(id, req, cancel, ExecMode::Collect)?,
            "exec",
            |r| match r {
                ExecReply::Collected(out) => Some(out),
                _ => None,
            },
        )
    }
    /// Runs a command, its output streamed ([`ExecMode::Stream`]).
    fn exec_streaming(
        &self,
        id: &SandboxId,
        req: ExecRequest,
        cancel: &Cancel,
        on_start: &mut dyn FnMut(&Outcome),
        on_output: &mut dyn FnMut(OutputKind, &[u8]),
    ) -> Result<GuestCall<ExitReply>, ServiceError>
    where
        Self: SandboxApi,
    {
        let mode = ExecMode::Stream {
            on_start,
            on_output,
        };
        value_of(
            self.execute(id, req, cancel, mode)?,
            "streamed exec",
            |r| match r {
                ExecReply::Streamed(exit) => Some(exit),
                _ => None,
            },
        )
    }
    /// The file's bytes.
    fn read_file(&self, id: &SandboxId, path: &str) -> Result<GuestCall<Vec<u8>>, ServiceError>
    where
        Self: SandboxApi,
    {
        value_of(
            self.files(id, FileOp::Read { path })?,
            "read",
            |r| match r {
                FileReply::Read(data) => Some(data),
                _ => None,
            },
        )
    }
    /// Writes (replaces) a file, creating missing parents; its size.
    fn write_file(
        &self,
        id: &SandboxId,
        path: &str,
        data: &[u8],
        mode: Option<u32>,
    ) -> Result<GuestCall<u64>, ServiceError>
    where
        Self: SandboxApi,
    {
        self.write_file_as(id, path, data, mode, None)
    }
    /// [`Self::write_file`] whose file, and the parents it creates, go to
    /// `owner`.
    fn write_file_as(
        &self,
        id: &SandboxId,
        path: &str,
        data: &[u8],
        mode: Option<u32>,
        owner: Option<&str>,
    ) -> Result<GuestCall<u64>, ServiceError>
    where
        Self: SandboxApi,
    {
        let op = FileOp::Write {
            path,
            data,
            mode,
            owner,
        };
        value_of(self.files(id, op)?, "write", |r| match r {
            FileReply::Written(size) => Some(size),
            _ => None,
        })
    }
    /// A directory's entries.
    fn list_dir(&self, id: &SandboxId, path: &str) -> Result<GuestCall<DirListing>, ServiceError>
    where
        Self: SandboxApi,
    {
        value_of(
            self.files(id, FileOp::List { path })?,
            "listing",
            |r| match r {
                FileReply::List(listing) => Some(listing),
                _ => None,
            },
        )
    }
}

impl<S: SandboxApi + ?Sized> SandboxCalls for S {}
