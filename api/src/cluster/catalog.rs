//! The cluster's templates: each pod's, as its heartbeats carry them
//! (`Heartbeat::catalog`, kept in `pods.catalog`, schema version 5). `GET
//! /v1/templates` through any replica lists the templates of the pods up,
//! each entry naming its `pod` as the federation's list does (a template
//! on two pods is listed twice); the API keeps a tenant's own and the
//! shared ones, as in the embedded mode. A create asks its template's
//! memory of its tenant's quota from the same list (`admission.rs`).

use std::time::Duration;

use serde_json::{json, Value};
use torpor_scheduler::model::PodId;

use super::db::{pg, Db};
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
