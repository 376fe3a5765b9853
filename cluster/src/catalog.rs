//! The cluster's templates: each pod's, as its heartbeats carry them
//! (`Heartbeat::catalog`, kept in `pods.catalog`, schema version 5). `GET
//! /v1/templates` through any replica lists the templates of the pods up,
//! each entry naming its `pod` as embedded serve's list does (a template
//! on two pods is listed twice); the API keeps a tenant's own and the
//! shared ones, as in the embedded mode. A create asks its template's
//! memory of its tenant's quota from the same list (`admission.rs`).
//! Templates built and deleted through a replica (`templates.rs`) change
//! the list with their result, before the pod's next heartbeat
//! ([`MIGRATION`]).

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

/// Schema version 9. `operations.template`: the template a template's
/// delete is on (a retry finds it by key and template). `pods.catalog_changes`:
/// the templates built and deleted through the replicas that the pod's
/// heartbeats do not list (or still list) yet, by id: `{"template": the
/// template or null once deleted, "name": its name, "at": epoch s}`. A
/// result writes its change with the operation (`finish`), applied to the
/// pod's `catalog` and `templates` at once, so that a create right after a
/// build's 201 is placed on its pod; each heartbeat applies the changes it
/// does not confirm yet (a built template listed in the same state, a
/// deleted one not listed) over what it lists, and keeps only those (for
/// at most [`CHANGE_TTL_S`]): a heartbeat taken before the result (the
/// template missing, or still `building`) and written after it (another
/// replica) does not undo it.
pub const MIGRATION: &str = "
    ALTER TABLE operations ADD COLUMN template text;
    CREATE INDEX operations_template ON operations (template) WHERE template IS NOT NULL;
    ALTER TABLE pods ADD COLUMN catalog_changes jsonb NOT NULL DEFAULT '{}'::jsonb;
    CREATE FUNCTION torpor_catalog(reported jsonb, changes jsonb) RETURNS jsonb
    LANGUAGE sql IMMUTABLE AS $f$
        SELECT coalesce(jsonb_agg(t ORDER BY n), '[]'::jsonb) FROM (
            SELECT e AS t, r.n FROM jsonb_array_elements(reported) WITH ORDINALITY AS r(e, n)
            WHERE NOT changes ? coalesce(e->>'id', '')
            UNION ALL
            SELECT c.value -> 'template', 9223372036854775807 FROM jsonb_each(changes) c
            WHERE jsonb_typeof(c.value -> 'template') = 'object'
        ) s
    $f$;
    CREATE FUNCTION torpor_catalog_names(reported text[], changes jsonb) RETURNS text[]
    LANGUAGE sql IMMUTABLE AS $f$
        WITH kept AS (
            SELECT x, n FROM unnest(reported) WITH ORDINALITY AS r(x, n)
            WHERE NOT EXISTS (SELECT 1 FROM jsonb_each(changes) c
                WHERE jsonb_typeof(c.value -> 'template') = 'null'
                    AND x IN (c.key, c.value->>'name'))
        ), added AS (
            SELECT DISTINCT v.x FROM jsonb_each(changes) c,
                LATERAL (VALUES (c.key), (c.value->>'name')) AS v(x)
            WHERE jsonb_typeof(c.value -> 'template') = 'object' AND v.x IS NOT NULL
        )
        SELECT coalesce(array_agg(x ORDER BY n), '{}'::text[]) FROM (
            SELECT x, n FROM kept
            UNION ALL
            SELECT x, 9223372036854775807 FROM added WHERE x NOT IN (SELECT x FROM kept)
        ) s
    $f$;
    CREATE FUNCTION torpor_catalog_pending(reported jsonb, changes jsonb) RETURNS jsonb
    LANGUAGE sql STABLE AS $f$
        SELECT coalesce(jsonb_object_agg(c.key, c.value), '{}'::jsonb) FROM jsonb_each(changes) c
        WHERE (c.value->>'at')::double precision > extract(epoch FROM now()) - 60
            AND CASE WHEN jsonb_typeof(c.value -> 'template') = 'object'
                THEN NOT EXISTS (SELECT 1 FROM jsonb_array_elements(reported) e
                    WHERE e->>'id' = c.key AND e->>'state' = c.value->'template'->>'state')
                ELSE EXISTS (SELECT 1 FROM jsonb_array_elements(reported) e
                    WHERE e->>'id' = c.key)
            END
    $f$";

/// How long a catalog change waits for its pod's heartbeats to confirm
/// it (the `60` of `torpor_catalog_pending`).
pub const CHANGE_TTL_S: u64 = 60;

/// A template's build or delete finished on `pod` (`Db::finish`): the
/// operation done and the pod's catalog changed, in one statement, only
/// while the operation was pending (a result applied once).
pub(super) async fn finish(
    c: &tokio_postgres::Client,
    operation: &str,
    outcome: &Value,
    pod: &PodId,
    template: &Template,
    built: bool,
) -> Result<u64, tokio_postgres::Error> {
    let entry = if built {
        serde_json::to_value(template).ok()
    } else {
        None
    };
    c.execute(
        "WITH op AS (
            UPDATE operations SET status = 'done', outcome = $2, finished_at = now()
            WHERE id = $1 AND pod = $3 AND status = 'pending' RETURNING id),
         change AS (SELECT jsonb_build_object($4::text, jsonb_build_object(
            'template', $5::jsonb, 'name', $6::text, 'at', extract(epoch FROM now()))) AS c)
         UPDATE pods SET catalog_changes = pods.catalog_changes || change.c,
            catalog = torpor_catalog(pods.catalog, change.c),
            templates = torpor_catalog_names(pods.templates, change.c)
         FROM change WHERE pods.id = $3 AND EXISTS (SELECT 1 FROM op)",
        &[
            &operation,
            outcome,
            &pod.as_str(),
            &template.id.as_str(),
            &entry,
            &template.name,
        ],
    )
    .await
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
