//! The cluster's templates: each pod's, as its heartbeats carry them
//! (`Heartbeat::catalog`, kept in `pods.catalog`, schema version 5). `GET
//! /v1/templates` through any replica lists the templates of the pods up,
//! each entry naming its `pod` as embedded serve's list does (a template
//! on two pods is listed twice); the API keeps a tenant's own and the
//! shared ones, as in the embedded mode. A create asks its template's
//! memory of its tenant's quota from the same list (`admission.rs`).
//! Templates built and deleted through a replica (`templates.rs`) change
//! the list with their result, before the pod's next heartbeat
//! (schema version 9, `schema.rs`: `CATALOG_CHANGES`; `db.rs`: `Db::finish`).

use std::time::Duration;

use serde_json::{json, Value};
use torpor_scheduler::model::{PodId, Template, TemplateId};

use super::db::{pg, Db, OpRow};
use super::ClusterError;

impl Db {
    /// The templates of the pods heard from within `down_after`, by pod.
    pub async fn templates(&self, down_after: Duration) -> Result<Vec<Value>, ClusterError> {
        let c = self.client().await?;
        let rows = c
            .query(
                "SELECT id, catalog FROM pods
                 WHERE last_heartbeat > now() - make_interval(secs => $1)
                 ORDER BY id",
                &[&down_after.as_secs_f64()],
            )
            .await
            .map_err(pg)?;
        let mut out = Vec::new();
        for r in rows {
            let pod: String = r.get(0);
            let Value::Array(list) = r.get::<_, Value>(1) else {
                return Err(ClusterError::Schema(format!("pod {pod}'s templates")));
            };
            out.extend(list.into_iter().filter(Value::is_object).map(|mut t| {
                t["pod"] = json!(pod);
                t
            }));
        }
        Ok(out)
    }

    /// The memory of template `key` (id or name) on `pod`, as the pod
    /// listed it last; none if it did not.
    pub async fn template_mem(&self, pod: &PodId, key: &str) -> Result<Option<u64>, ClusterError> {
        let c = self.client().await?;
        let row = c
            .query_opt(
                "SELECT (t->>'mem_mib')::bigint FROM pods, jsonb_array_elements(catalog) t
                 WHERE pods.id = $1 AND (t->>'id' = $2 OR t->>'name' = $2)
                 LIMIT 1",
                &[&pod.as_str(), &key],
            )
            .await
            .map_err(pg)?;
        Ok(row
            .and_then(|r| r.get::<_, Option<i64>>(0))
            .and_then(|m| u64::try_from(m).ok()))
    }
}

/// A template as a pod up lists it.
#[derive(Debug, Clone)]
pub struct Listed {
    pub pod: PodId,
    pub up: bool,
    pub template: Template,
}

impl Db {
    /// The pods whose catalog lists template `id`, by pod id, and whether
    /// each is up (heard from within `down_after`).
    pub async fn listing(
        &self,
        id: &TemplateId,
        down_after: Duration,
    ) -> Result<Vec<Listed>, ClusterError> {
        let c = self.client().await?;
        let rows = c
            .query(
                "SELECT pods.id, last_heartbeat > now() - make_interval(secs => $2), t
                 FROM pods, jsonb_array_elements(catalog) t
                 WHERE t->>'id' = $1
                 ORDER BY pods.id",
                &[&id.as_str(), &down_after.as_secs_f64()],
            )
            .await
            .map_err(pg)?;
        rows.into_iter()
            .map(|r| {
                let pod: String = r.get(0);
                let template = serde_json::from_value(r.get(2))
                    .map_err(|e| ClusterError::Schema(format!("pod {pod}'s template {id}: {e}")))?;
                Ok(Listed {
                    pod: PodId::new(pod),
                    up: r.get(1),
                    template,
                })
            })
            .collect()
    }

    /// The operation `tenant` journaled with `key`.
    pub async fn operation_by_tenant_key(
        &self,
        tenant: &str,
        key: &str,
    ) -> Result<Option<OpRow>, ClusterError> {
        let c = self.client().await?;
        let row = c
            .query_opt(
                "SELECT id FROM operations WHERE tenant = $1 AND idempotency_key = $2",
                &[&tenant, &key],
            )
            .await
            .map_err(pg)?;
        match row {
            Some(r) => self.operation(r.get::<_, &str>(0)).await,
            None => Ok(None),
        }
    }

    /// The first of the deletes of template `id` made by a request with
    /// `key` (each pod's journaled with `key`, a space and the pod's id:
    /// `templates.rs`).
    pub async fn template_delete_by_key(
        &self,
        key: &str,
        id: &TemplateId,
        tenant: Option<&str>,
    ) -> Result<Option<OpRow>, ClusterError> {
        let c = self.client().await?;
        let row = c
            .query_opt(
                "SELECT id FROM operations
                 WHERE starts_with(idempotency_key, $1 || ' ') AND kind = 'template_delete'
                    AND template = $2 AND ($3::text IS NULL OR tenant = $3)
                 ORDER BY created_at LIMIT 1",
                &[&key, &id.as_str(), &tenant],
            )
            .await
            .map_err(pg)?;
        match row {
            Some(r) => self.operation(r.get::<_, &str>(0)).await,
            None => Ok(None),
        }
    }
}
