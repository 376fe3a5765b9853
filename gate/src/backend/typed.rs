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
    fn list_templates(
        &self,
    ) -> impl std::future::Future<Output = Result<Vec<Template>, ServiceError>> + Send
    where
        Self: SandboxApi,
    {
        async move {
            match self.templates(TemplateOp::List).await? {
                TemplateReply::List(list) => Ok(list),
                _ => Err(mismatched("template list")),
            }
        }
    }
    /// Template `id`, whosever (the server's own read; a caller's is
    /// [`SandboxCalls::resolve_template`]).
    fn get_template(
        &self,
        id: &TemplateId,
    ) -> impl std::future::Future<Output = Result<Template, ServiceError>> + Send
    where
        Self: SandboxApi,
    {
        async move { self.template_get(None, id.as_str()).await }
    }
    /// The template `key` (id or name) names for `owner`: its own, then a
    /// shared one; another tenant's is not found.
    fn resolve_template(
        &self,
        owner: &Owner,
        key: &str,
    ) -> impl std::future::Future<Output = Result<Template, ServiceError>> + Send
    where
        Self: SandboxApi,
    {
        async move { self.template_get(Some(owner), key).await }
    }
    /// The template `key` names for `owner` (none: the server's own read).
    fn template_get(
        &self,
        owner: Option<&Owner>,
        key: &str,
    ) -> impl std::future::Future<Output = Result<Template, ServiceError>> + Send
    where
        Self: SandboxApi,
    {
        async move {
            match self.templates(TemplateOp::Get { key, owner }).await? {
                TemplateReply::One(t) => Ok(*t),
                _ => Err(mismatched("template get")),
            }
        }
    }
    fn create_template(
        &self,
        req: CreateTemplate,
    ) -> impl std::future::Future<Output = Result<Template, ServiceError>> + Send
    where
        Self: SandboxApi,
    {
        async move {
            match self.templates(TemplateOp::Create(req)).await? {
                TemplateReply::One(t) => Ok(*t),
                _ => Err(mismatched("template create")),
            }
        }
    }
    /// Deletes the template `key` names for `owner` (none: the server's
    /// own call): a tenant its own; a shared one is 403, another tenant's
    /// not found.
    fn delete_template(
        &self,
        owner: Option<&Owner>,
        key: &str,
    ) -> impl std::future::Future<Output = Result<(), ServiceError>> + Send
    where
        Self: SandboxApi,
    {
        async move {
            match self.templates(TemplateOp::Delete { key, owner }).await? {
                TemplateReply::Deleted => Ok(()),
                _ => Err(mismatched("template delete")),
            }
        }
    }
    /// Renames the template `key` names for `owner` (as
    /// [`Self::delete_template`] may delete it) to `name`.
    fn rename_template(
        &self,
        owner: Option<&Owner>,
        key: &str,
        name: &str,
    ) -> impl std::future::Future<Output = Result<Template, ServiceError>> + Send
    where
        Self: SandboxApi,
    {
        async move {
            match self
                .templates(TemplateOp::Rename { key, owner, name })
                .await?
            {
                TemplateReply::One(t) => Ok(*t),
                _ => Err(mismatched("template rename")),
            }
        }
    }
    /// The names of the images installed (a cluster's: on the pods up).
    fn image_names(
        &self,
    ) -> impl std::future::Future<Output = Result<Vec<String>, ServiceError>> + Send
    where
        Self: SandboxApi,
    {
        async move {
            match self.images(ImageOp::List).await? {
                ImageReply::List(names) => Ok(names),
                _ => Err(mismatched("image list")),
            }
        }
    }
    /// Takes a checkpoint of sandbox `id` ([`Operation::Checkpoint`]).
    /// Listing and restoring are the pod's own (a cluster relays them to
    /// the owning pod).
    fn checkpoint(
        &self,
        id: &SandboxId,
        req: CreateCheckpoint,
    ) -> impl std::future::Future<Output = Result<Checkpoint, ServiceError>> + Send
    where
        Self: SandboxApi,
    {
        async move {
            let op = Operation::Checkpoint {
                sandbox: id.clone(),
                request: Box::new(req),
            };
            match self.operate(op).await? {
                Reply::Checkpoint { checkpoint } => Ok(*checkpoint),
                _ => Err(mismatched("checkpoint create")),
            }
        }
    }
    /// Deletes checkpoint `name` of sandbox `id`
    /// ([`Operation::CheckpointDelete`]).
    fn delete_checkpoint(
        &self,
        id: &SandboxId,
        name: &str,
    ) -> impl std::future::Future<Output = Result<(), ServiceError>> + Send
    where
        Self: SandboxApi,
    {
        async move {
            let op = Operation::CheckpointDelete {
                sandbox: id.clone(),
                name: name.to_string(),
            };
            match self.operate(op).await? {
                Reply::CheckpointDeleted { .. } => Ok(()),
                _ => Err(mismatched("checkpoint delete")),
            }
        }
    }
    /// Runs a command, its output collected; `cancel` ends it early (its
    /// client went away): the command is killed in the guest.
    fn exec(
        &self,
        id: &SandboxId,
        req: ExecRequest,
        cancel: &Cancel,
    ) -> impl std::future::Future<Output = Result<GuestCall<ExecOutput>, ServiceError>> + Send
    where
        Self: SandboxApi,
    {
        async move {
            value_of(
                self.execute(id, req, cancel, ExecMode::Collect).await?,
                "exec",
                |r| match r {
                    ExecReply::Collected(out) => Some(out),
                    _ => None,
                },
            )
        }
    }
    /// Runs a command, its output streamed ([`ExecMode::Stream`]).
    fn exec_streaming(
        &self,
        id: &SandboxId,
        req: ExecRequest,
        cancel: &Cancel,
        on_start: &mut (dyn FnMut(&Outcome) + Send),
        on_output: &mut (dyn FnMut(OutputKind, &[u8]) + Send),
    ) -> impl std::future::Future<Output = Result<GuestCall<ExitReply>, ServiceError>> + Send
    where
        Self: SandboxApi,
    {
        async move {
            let mode = ExecMode::Stream {
                on_start,
                on_output,
            };
            value_of(
                self.execute(id, req, cancel, mode).await?,
                "streamed exec",
                |r| match r {
                    ExecReply::Streamed(exit) => Some(exit),
                    _ => None,
                },
            )
        }
    }
    /// The file's bytes.
    fn read_file(
        &self,
        id: &SandboxId,
        path: &str,
    ) -> impl std::future::Future<Output = Result<GuestCall<Vec<u8>>, ServiceError>> + Send
    where
        Self: SandboxApi,
    {
        async move {
            value_of(
                self.files(id, FileOp::Read { path }).await?,
                "read",
                |r| match r {
                    FileReply::Read(data) => Some(data),
                    _ => None,
                },
            )
        }
    }
    /// Writes (replaces) a file, creating missing parents; its size.
    fn write_file(
        &self,
        id: &SandboxId,
        path: &str,
        data: &[u8],
        mode: Option<u32>,
    ) -> impl std::future::Future<Output = Result<GuestCall<u64>, ServiceError>> + Send
    where
        Self: SandboxApi,
    {
        async move { self.write_file_as(id, path, data, mode, None).await }
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
    ) -> impl std::future::Future<Output = Result<GuestCall<u64>, ServiceError>> + Send
    where
        Self: SandboxApi,
    {
        async move {
            let op = FileOp::Write {
                path,
                data,
                mode,
                owner,
            };
            value_of(self.files(id, op).await?, "write", |r| match r {
                FileReply::Written(size) => Some(size),
                _ => None,
            })
        }
    }
    /// A directory's entries.
    fn list_dir(
        &self,
        id: &SandboxId,
        path: &str,
    ) -> impl std::future::Future<Output = Result<GuestCall<DirListing>, ServiceError>> + Send
    where
        Self: SandboxApi,
    {
        async move {
            value_of(
                self.files(id, FileOp::List { path }).await?,
                "listing",
                |r| match r {
                    FileReply::List(listing) => Some(listing),
                    _ => None,
                },
            )
        }
    }
}

impl<S: SandboxApi + ?Sized> SandboxCalls for S {}
