//! [`SandboxCalls`]: the typed call of each of [`SandboxApi`]'s requests
//! (`crate::calls`: one per resource, templates, images, a sandbox's
//! files, an exec) and of the contract's checkpoint operations, written
//! once for every backend (a blanket impl) and unwrapping the reply of its
//! request.

use torpor_scheduler::model::{Checkpoint, SandboxId, Template, TemplateId};

use torpor_sandbox_api::{Operation, Reply};

use super::SandboxApi;
use crate::calls::{
    ExecMode, ExecReply, FileOp, FileReply, ImageOp, ImageReply, TemplateOp, TemplateReply,
};
use crate::service::{
    Cancel, CreateCheckpoint, CreateTemplate, DirListing, ExecOutput, ExecRequest, ExitReply,
    GuestCall, Outcome, OutputKind, Owner, ServiceError,
};

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
    /// Renames the template `key` names for `owner` (as
    /// [`Self::delete_template`] may delete it) to `name`.
    fn rename_template(
        &self,
        owner: Option<&Owner>,
        key: &str,
        name: &str,
    ) -> Result<Template, ServiceError>
    where
        Self: SandboxApi,
    {
        match self.templates(TemplateOp::Rename { key, owner, name })? {
            TemplateReply::One(t) => Ok(*t),
            _ => Err(mismatched("template rename")),
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
