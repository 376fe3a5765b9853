//! Operations [`SandboxApi`] takes as one typed request per resource
//! (templates, a sandbox's files), and [`SandboxCalls`]: the typed call of
//! each, for every backend at once.
//!
//! A backend implements one method per resource and matches the request;
//! callers use the typed calls (`s.get_template(&id)`, `s.read_file(&id,
//! path)`), which unwrap the reply of their request.

use torpor_scheduler::model::{SandboxId, Template, TemplateId};
use torpor_scheduler::service::guest::MAX_READ_BYTES;

use crate::backend::SandboxApi;
use crate::service::{AgentLink, CreateTemplate, DirListing, GuestCall, GuestError, ServiceError};

/// A template call (`/v1/templates`): [`SandboxApi::templates`].
#[derive(Debug, Clone)]
pub enum TemplateOp<'a> {
    List,
    Get(&'a TemplateId),
    Create(CreateTemplate),
    Delete(&'a TemplateId),
}

/// A [`TemplateOp`]'s answer, the variant of its call.
#[derive(Debug)]
pub enum TemplateReply {
    List(Vec<Template>),
    /// The template got or created.
    One(Template),
    Deleted,
}

/// A file call on a sandbox's agent (`/v1/sandboxes/{id}/files`, E2B's
/// `/files`): [`SandboxApi::files`].
#[derive(Debug, Clone, Copy)]
pub enum FileOp<'a> {
    /// The file's bytes (at most [`MAX_READ_BYTES`]).
    Read { path: &'a str },
    /// Writes (replaces) the file, creating missing parents.
    Write {
        path: &'a str,
        data: &'a [u8],
        mode: Option<u32>,
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
            FileOp::Write { path, data, mode } => {
                FileReply::Written(link.write_file(path, data, mode)?)
            }
            FileOp::List { path } => FileReply::List(link.list_dir(path)?),
        })
    }
}

/// A backend answered `call` with another call's reply.
fn mismatched(call: &str) -> ServiceError {
    ServiceError::Internal(format!("the backend answered a {call} with another reply"))
}

/// A guest call's value as `T`, if its reply is of that call.
fn file_value<T>(
    call: GuestCall<FileReply>,
    name: &str,
    f: fn(FileReply) -> Option<T>,
) -> Result<GuestCall<T>, ServiceError> {
    let GuestCall { outcome, value } = call;
    let value = f(value).ok_or_else(|| mismatched(name))?;
    Ok(GuestCall { outcome, value })
}

/// The typed calls of [`SandboxApi`]'s requests, for every backend (a
/// supertrait of it, so they are in scope wherever it is).
pub trait SandboxCalls {
    fn list_templates(&self) -> Result<Vec<Template>, ServiceError>;
    fn get_template(&self, id: &TemplateId) -> Result<Template, ServiceError>;
    fn create_template(&self, req: CreateTemplate) -> Result<Template, ServiceError>;
    fn delete_template(&self, id: &TemplateId) -> Result<(), ServiceError>;
    /// The file's bytes.
    fn read_file(&self, id: &SandboxId, path: &str) -> Result<GuestCall<Vec<u8>>, ServiceError>;
    /// Writes (replaces) a file, creating missing parents; its size.
    fn write_file(
        &self,
        id: &SandboxId,
        path: &str,
        data: &[u8],
        mode: Option<u32>,
    ) -> Result<GuestCall<u64>, ServiceError>;
    /// A directory's entries.
    fn list_dir(&self, id: &SandboxId, path: &str) -> Result<GuestCall<DirListing>, ServiceError>;
}

impl<S: SandboxApi + ?Sized> SandboxCalls for S {
    fn list_templates(&self) -> Result<Vec<Template>, ServiceError> {
        match self.templates(TemplateOp::List)? {
            TemplateReply::List(list) => Ok(list),
            _ => Err(mismatched("template list")),
        }
    }
    fn get_template(&self, id: &TemplateId) -> Result<Template, ServiceError> {
        match self.templates(TemplateOp::Get(id))? {
            TemplateReply::One(t) => Ok(t),
            _ => Err(mismatched("template get")),
        }
    }
    fn create_template(&self, req: CreateTemplate) -> Result<Template, ServiceError> {
        match self.templates(TemplateOp::Create(req))? {
            TemplateReply::One(t) => Ok(t),
            _ => Err(mismatched("template create")),
        }
    }
    fn delete_template(&self, id: &TemplateId) -> Result<(), ServiceError> {
        match self.templates(TemplateOp::Delete(id))? {
            TemplateReply::Deleted => Ok(()),
            _ => Err(mismatched("template delete")),
        }
    }
    fn read_file(&self, id: &SandboxId, path: &str) -> Result<GuestCall<Vec<u8>>, ServiceError> {
        file_value(
            self.files(id, FileOp::Read { path })?,
            "read",
            |r| match r {
                FileReply::Read(data) => Some(data),
                _ => None,
            },
        )
    }
    fn write_file(
        &self,
        id: &SandboxId,
        path: &str,
        data: &[u8],
        mode: Option<u32>,
    ) -> Result<GuestCall<u64>, ServiceError> {
        let op = FileOp::Write { path, data, mode };
        file_value(self.files(id, op)?, "write", |r| match r {
            FileReply::Written(size) => Some(size),
            _ => None,
        })
    }
    fn list_dir(&self, id: &SandboxId, path: &str) -> Result<GuestCall<DirListing>, ServiceError> {
        file_value(
            self.files(id, FileOp::List { path })?,
            "listing",
            |r| match r {
                FileReply::List(listing) => Some(listing),
                _ => None,
            },
        )
    }
}
