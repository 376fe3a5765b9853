//! The pod's own [`Service`] as a [`SecretStore`]: its SQLite store
//! (`torpor_scheduler::store::secrets`), each call on the blocking pool
//! ([`detached`]). The rules and the interface: `crate::secrets`.

use super::detached;
use crate::secrets::{NewSecret, SecretError, SecretFuture, SecretInfo, SecretStore, SecretUpdate};
use crate::service::{Service, ServiceError};

/// `f` on the pod's store, on the blocking pool ([`detached`]).
async fn on_store<T, F>(service: &Service, f: F) -> Result<T, SecretError>
where
    T: Send + 'static,
    F: FnOnce(&torpor_scheduler::Store) -> Result<T, SecretError> + Send + 'static,
{
    detached(service, move |s| Ok(f(s.store())))
        .await
        .unwrap_or_else(|e: ServiceError| Err(SecretError::store(e.to_string())))
}

/// The pod's own store (SQLite in its data directory).
impl SecretStore for Service {
    fn create_secret(&self, new: NewSecret, max: u64) -> SecretFuture<'_, SecretInfo> {
        Box::pin(on_store(self, move |store| {
            store
                .write(|tx| {
                    if tx.secret_count(&new.tenant)? >= max {
                        return Ok(Err(SecretError::TooMany(max)));
                    }
                    tx.insert_secret(&new).map(Ok)
                })
                .map_err(SecretError::from)?
        }))
    }

    fn secret<'a>(&'a self, tenant: &'a str, key: &'a str) -> SecretFuture<'a, SecretInfo> {
        let (tenant, key) = (tenant.to_string(), key.to_string());
        Box::pin(on_store(self, move |store| {
            Ok(store.read(|tx| tx.secret(&tenant, &key))?)
        }))
    }

    fn secrets<'a>(&'a self, tenant: &'a str) -> SecretFuture<'a, Vec<SecretInfo>> {
        let tenant = tenant.to_string();
        Box::pin(on_store(self, move |store| {
            Ok(store.read(|tx| tx.list_secrets(&tenant))?)
        }))
    }

    fn update_secret<'a>(
        &'a self,
        tenant: &'a str,
        key: &'a str,
        update: SecretUpdate,
    ) -> SecretFuture<'a, SecretInfo> {
        let (tenant, key) = (tenant.to_string(), key.to_string());
        Box::pin(on_store(self, move |store| {
            Ok(store.write(|tx| tx.update_secret(&tenant, &key, &update))?)
        }))
    }

    fn delete_secret<'a>(&'a self, tenant: &'a str, key: &'a str) -> SecretFuture<'a, ()> {
        let (tenant, key) = (tenant.to_string(), key.to_string());
        Box::pin(on_store(self, move |store| {
            store.write(|tx| tx.delete_secret(&tenant, &key))?;
            Ok(())
        }))
    }
}
