//! Secrets: created at version 1, found by id or name within their tenant
//! only, updated to the next version (metadata replaced when given), the
//! value overwritten and never among the columns read, deleted; they
//! outlive a reopen.

use std::collections::BTreeMap;

use super::*;
use crate::store::secrets::SECRET_ID_PREFIX;
use crate::store::{NewSecret, SecretUpdate, SecretValue};

fn new(tenant: &str, name: &str, value: &str) -> NewSecret {
    NewSecret {
        id: format!("{SECRET_ID_PREFIX}{}", crate::random::random_hex(8)),
        tenant: tenant.into(),
        name: name.into(),
        value: SecretValue::new(value.into()),
        metadata: BTreeMap::from([("env".to_string(), "test".to_string())]),
        at: Timestamp(1_000),
    }
}

#[test]
fn secrets_are_kept_per_tenant_versioned_and_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let a = store
        .write(|tx| tx.insert_secret(&new("acme", "api-key", "s3cret-v1")))
        .unwrap();
    assert!(a.id.starts_with(SECRET_ID_PREFIX));
    assert_eq!((a.version, a.name.as_str()), (1, "api-key"));
    assert_eq!(a.metadata["env"], "test");
    assert_eq!(
        (a.created_at, a.updated_at),
        (Timestamp(1_000), Timestamp(1_000))
    );
    // The same name is another tenant's to take, not acme's again.
    let e = store
        .write(|tx| tx.insert_secret(&new("acme", "api-key", "x")))
        .unwrap_err();
    assert!(
        matches!(e, StoreError::AlreadyExists { kind: "secret", .. }),
        "{e}"
    );
    let b = store
        .write(|tx| tx.insert_secret(&new("evil", "api-key", "theirs")))
        .unwrap();
    assert_ne!(a.id, b.id);
    store
        .read(|tx| {
            assert_eq!(tx.secret("acme", &a.id)?, a);
            assert_eq!(tx.secret("acme", "api-key")?, a);
            // Another tenant's secret is a missing one, by id or name.
            assert!(matches!(
                tx.secret("evil", &a.id),
                Err(StoreError::NotFound { .. })
            ));
            assert_eq!(tx.secret("evil", "api-key")?.id, b.id);
            assert_eq!(tx.secret_count("acme")?, 1);
            assert_eq!(tx.list_secrets("acme")?, vec![a.clone()]);
            assert_eq!(tx.secret_value("acme", "api-key")?.expose(), "s3cret-v1");
            Ok(())
        })
        .unwrap();
    // An update without metadata keeps it; with it, replaces it.
    let up = |value: &str, metadata: Option<BTreeMap<String, String>>, at| SecretUpdate {
        value: SecretValue::new(value.into()),
        metadata,
        at: Timestamp(at),
    };
    let v2 = store
        .write(|tx| tx.update_secret("acme", "api-key", &up("s3cret-v2", None, 2_000)))
        .unwrap();
    assert_eq!((v2.version, v2.metadata.clone()), (2, a.metadata.clone()));
    assert_eq!(
        (v2.created_at, v2.updated_at),
        (Timestamp(1_000), Timestamp(2_000))
    );
    let only = BTreeMap::from([("team".to_string(), "ml".to_string())]);
    let v3 = store
        .write(|tx| tx.update_secret("acme", &a.id, &up("s3cret-v3", Some(only.clone()), 3_000)))
        .unwrap();
    assert_eq!((v3.version, v3.metadata), (3, only));
    assert!(store
        .write(|tx| tx.update_secret("evil", &a.id, &up("stolen", None, 4_000)))
        .is_err());
    assert!(store.write(|tx| tx.delete_secret("evil", &a.id)).is_err());
    drop(store);
    // Reopened: kept, the value the last version's only.
    let store = Store::open(dir.path()).unwrap();
    store
        .read(|tx| {
            assert_eq!(tx.secret("acme", "api-key")?.version, 3);
            assert_eq!(tx.secret_value("acme", &a.id)?.expose(), "s3cret-v3");
            Ok(())
        })
        .unwrap();
    let gone = store
        .write(|tx| tx.delete_secret("acme", "api-key"))
        .unwrap();
    assert_eq!(gone.id, a.id);
    store
        .read(|tx| {
            assert!(matches!(
                tx.secret("acme", &a.id),
                Err(StoreError::NotFound { .. })
            ));
            assert!(tx.secret_value("acme", &a.id).is_err());
            assert_eq!(tx.secret_count("acme")?, 0);
            assert_eq!(tx.secret_count("evil")?, 1);
            Ok(())
        })
        .unwrap();
    // The value is in no Debug print.
    let text = format!("{:?}", new("acme", "k", "hunter2"));
    assert!(!text.contains("hunter2"), "{text}");
}
