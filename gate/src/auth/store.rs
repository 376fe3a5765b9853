//! Where a server keeps its tenants when no tokens file does: the
//! [`TokenStore`] a cluster replica hands [`super::Auth::shared`] (the
//! cluster's PostgreSQL, `cluster/tenants.rs`). Auth reads and changes the
//! tenants through this trait only, so it depends on no database.

use std::future::Future;
use std::pin::Pin;

use super::tokens::{TenantsFile, TokenRecord, TokensError};
use crate::quota::Quota;

/// What a [`TokenStore`] call returns: its errors are the tokens' errors
/// ([`TokensError::Store`] for the store's own failures).
pub type StoreFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, TokensError>> + Send + 'a>>;

/// The tenants' tokens (their digests, never the tokens) and quotas, shared
/// by every server that reads them.
pub trait TokenStore: Send + Sync + 'static {
    /// Every token (oldest first) and every quota.
    fn tenants(&self) -> StoreFuture<'_, TenantsFile>;

    /// Stores `record`: false if its id or its digest is there already;
    /// [`TokensError::TooMany`] past the most kept. With `only_first`,
    /// only into a store without any token (a first start's admin token).
    fn add_token<'a>(&'a self, record: &'a TokenRecord, only_first: bool) -> StoreFuture<'a, bool>;

    /// Removes token `id`, unless it is the last admin token
    /// ([`TokensError::LastAdmin`]; [`TokensError::NotFound`] if absent).
    fn remove_token<'a>(&'a self, id: &'a str) -> StoreFuture<'a, TokenRecord>;

    /// Sets `tenant`'s quota; unless `replace`, only if it has none.
    fn set_quota<'a>(
        &'a self,
        tenant: &'a str,
        quota: &'a Quota,
        replace: bool,
    ) -> StoreFuture<'a, ()>;
}
