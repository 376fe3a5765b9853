//! The cluster's PostgreSQL schema: its versions in order
//! ([`MIGRATIONS`]), which `Db::open` applies once each, under an advisory
//! lock, so replicas starting together are safe.

/// Schema versions, in order; each applied once, in one transaction.
pub const MIGRATIONS: &[(i32, &str)] = &[
    (
        1,
        "CREATE TABLE pods (
        id text PRIMARY KEY,
        address text NOT NULL,
        token text NOT NULL,
        fingerprint text,
        load jsonb NOT NULL,
        templates text[] NOT NULL,
        headroom_mib double precision NOT NULL,
        running bigint NOT NULL,
        hibernated bigint NOT NULL,
        first_seen timestamptz NOT NULL DEFAULT now(),
        last_heartbeat timestamptz NOT NULL
    );
    CREATE TABLE sandboxes (
        id text PRIMARY KEY,
        pod text NOT NULL REFERENCES pods(id),
        tenant text,
        state text NOT NULL,
        generation bigint NOT NULL,
        body jsonb NOT NULL,
        updated_at timestamptz NOT NULL DEFAULT now()
    );
    CREATE INDEX sandboxes_pod ON sandboxes (pod);
    CREATE TABLE operations (
        id text PRIMARY KEY,
        kind text NOT NULL,
        sandbox text,
        pod text NOT NULL REFERENCES pods(id),
        tenant text NOT NULL,
        idempotency_key text,
        status text NOT NULL DEFAULT 'pending'
            CHECK (status IN ('pending', 'done', 'failed')),
        outcome jsonb,
        created_at timestamptz NOT NULL DEFAULT now(),
        finished_at timestamptz
    );
    CREATE UNIQUE INDEX operations_idempotency
        ON operations (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL;",
    ),
    // A heartbeat looks up a sandbox's finished delete (`upsert_sandbox`).
    (
        2,
        "CREATE INDEX operations_sandbox ON operations (sandbox) WHERE kind = 'delete'",
    ),
    // Tenants and their tokens, shared by every replica (`tenants.rs`):
    // as in the embedded `tenants.json`, a token is kept as its SHA-256.
    (
        3,
        "CREATE TABLE tenant_tokens (
        id text PRIMARY KEY,
        tenant text NOT NULL,
        scope text NOT NULL CHECK (scope IN ('admin', 'tenant')),
        sha256 text NOT NULL UNIQUE CHECK (sha256 ~ '^[0-9a-f]{64}$'),
        created_at_ms bigint NOT NULL
    );
    CREATE INDEX tenant_tokens_tenant ON tenant_tokens (tenant);
    CREATE TABLE tenant_quotas (
        tenant text PRIMARY KEY,
        quota jsonb NOT NULL,
        updated_at timestamptz NOT NULL DEFAULT now()
    );",
    ),
    // A create's admission against its tenant's quota (`admission.rs`):
    // what it asked, counted while it is pending.
    (
        4,
        "ALTER TABLE operations ADD COLUMN asked jsonb;
    CREATE INDEX operations_pending_create ON operations (tenant)
        WHERE kind = 'create' AND status = 'pending';",
    ),
    // Each pod's templates as it lists them (`catalog.rs`).
    (
        5,
        "ALTER TABLE pods ADD COLUMN catalog jsonb NOT NULL DEFAULT '[]'::jsonb",
    ),
    // An operation holding quota while pending: when its pod must start
    // it, and past when replicas end it (`expiry.rs`).
    (
        6,
        "ALTER TABLE operations ADD COLUMN start_by timestamptz,
        ADD COLUMN expires_at timestamptz;
    CREATE INDEX operations_expiring ON operations (expires_at)
        WHERE status = 'pending' AND expires_at IS NOT NULL;",
    ),
    // A fork's admission counts it while pending, as a create
    // (`admission.rs`).
    (
        7,
        "CREATE INDEX operations_pending_fork ON operations (tenant)
        WHERE kind = 'fork' AND status = 'pending';",
    ),
    // Every pending operation that asked for room counts (`admission.rs`):
    // creates, forks and, from this version, wakes; one index for them.
    (
        8,
        "CREATE INDEX operations_pending_asked ON operations (tenant)
        WHERE status = 'pending' AND asked IS NOT NULL;
    DROP INDEX operations_pending_create;
    DROP INDEX operations_pending_fork;",
    ),
    // Templates built and deleted through the replicas (`catalog.rs`):
    // the template an operation is on, and each pod's catalog changes its
    // heartbeats have not confirmed yet.
    (9, CATALOG_CHANGES),
    // What a sandbox's pod keeps but never shows, for E2B's envd on any
    // replica (`guest.rs`): its envd access token, as issued (E2B's
    // connect shows it again), and its environment. Gone with its row.
    (
        10,
        "CREATE TABLE sandbox_secrets (
        sandbox text PRIMARY KEY REFERENCES sandboxes(id) ON DELETE CASCADE,
        access_token text,
        env jsonb NOT NULL DEFAULT '{}'::jsonb
    );",
    ),
    // A checkpoint taken through a replica (`checkpoints.rs`): counted
    // against its tenant's snapshot disk as its sandbox's memory until its
    // delete's result, or its sandbox's, removes it.
    (
        11,
        "CREATE TABLE checkpoints (
        sandbox text NOT NULL REFERENCES sandboxes(id) ON DELETE CASCADE,
        name text NOT NULL,
        tenant text,
        mem_mib bigint NOT NULL,
        created_at timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (sandbox, name)
    );
    CREATE INDEX checkpoints_tenant ON checkpoints (tenant);",
    ),
    // The images index: each pod's installed images, from its heartbeats
    // (`images.rs`).
    (
        12,
        "ALTER TABLE pods ADD COLUMN images text[] NOT NULL DEFAULT '{}';",
    ),
    // The tenants' secrets, E2B's `/secrets` on any replica
    // (`secrets.rs`): the current version's value, a name unique per
    // tenant.
    (
        13,
        "CREATE TABLE secrets (
        id text PRIMARY KEY,
        tenant text NOT NULL,
        name text NOT NULL,
        version bigint NOT NULL,
        value text NOT NULL,
        metadata jsonb NOT NULL DEFAULT '{}'::jsonb,
        created_at_ms bigint NOT NULL,
        updated_at_ms bigint NOT NULL,
        UNIQUE (tenant, name)
    );",
    ),
    // How much of each stored layer a pod holds (`placement.rs`).
    (14, super::layers::LAYERS_COLUMN),
    // An operation's end notified to the replicas waiting for it.
    (15, super::finished::NOTIFY_TRIGGER),
];

/// Schema version 9. `operations.template`: the template a template's
/// delete is on (a retry finds it by key and template). `pods.catalog_changes`:
/// the templates built and deleted through the replicas that the pod's
/// heartbeats do not list (or still list) yet, by id: `{"template": the
/// template or null once deleted, "name": its name, "at": epoch s}`. A
/// result writes its change with the operation (`Db::finish`'s `finish_template`), applied to the
/// pod's `catalog` and `templates` at once, so that a create right after a
/// build's 201 is placed on its pod; each heartbeat applies the changes it
/// does not confirm yet (a built template listed in the same state, a
/// deleted one not listed) over what it lists, and keeps only those (for
/// at most `db::CHANGE_TTL_S`): a heartbeat taken before the result (the
/// template missing, or still `building`) and written after it (another
/// replica) does not undo it.
const CATALOG_CHANGES: &str = "
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
