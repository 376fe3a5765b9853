//! A replica's shared PostgreSQL connections (`Db::client`): several,
//! taken in turn, each keeping the statements it prepared.

use std::collections::HashMap;
use std::sync::Mutex;

use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Statement};
use torpor_sync::Locked;

use super::ClusterError;

/// A PostgreSQL error as the cluster's.
pub(super) fn pg(e: tokio_postgres::Error) -> ClusterError {
    ClusterError::Postgres(e.to_string())
}

/// How many connections `Db::client` spreads statements over. One
/// connection runs its statements one after another in one backend, each
/// commit waiting for its WAL flush: every read of every request waited
/// behind every other request's commit (and no two commits shared a
/// flush).
pub const CONNECTIONS: usize = 4;

/// How many statements a connection keeps prepared (past it, it starts
/// over: the statements are the code's, a few dozen).
const MAX_PREPARED: usize = 256;

/// A shared connection, and the statements prepared on it: a statement
/// run by its text alone is parsed, planned and described on every call
/// (two round trips); one of [`Conn::prepared`] once per connection.
pub struct Conn {
    pub(super) client: Client,
    pub(super) statements: Mutex<HashMap<String, Statement>>,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn").finish_non_exhaustive()
    }
}

impl std::ops::Deref for Conn {
    type Target = Client;
    fn deref(&self) -> &Client {
        &self.client
    }
}

impl Conn {
    /// `sql` prepared on this connection, once.
    pub async fn prepared(&self, sql: &str) -> Result<Statement, ClusterError> {
        if let Some(s) = self.statements.locked().get(sql) {
            return Ok(s.clone());
        }
        let statement = self.client.prepare(sql).await.map_err(pg)?;
        let mut statements = self.statements.locked();
        if statements.len() >= MAX_PREPARED {
            statements.clear();
        }
        statements.insert(sql.to_string(), statement.clone());
        Ok(statement)
    }

    /// The row `sql` (prepared) reads, if any. A failure forgets the
    /// statement (say its plan outdated by a migration): the next call
    /// prepares it again.
    pub async fn query_opt_prepared(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<tokio_postgres::Row>, ClusterError> {
        let statement = self.prepared(sql).await?;
        let row = self.client.query_opt(&statement, params).await;
        row.map_err(|e| {
            self.forget(sql);
            pg(e)
        })
    }

    /// How many rows `sql` (prepared) changed; a failure as
    /// [`Conn::query_opt_prepared`]'s.
    pub async fn execute_prepared(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, ClusterError> {
        let statement = self.prepared(sql).await?;
        let n = self.client.execute(&statement, params).await;
        n.map_err(|e| {
            self.forget(sql);
            pg(e)
        })
    }

    /// Forgets `sql`'s statement after it failed.
    pub fn forget(&self, sql: &str) {
        self.statements.locked().remove(sql);
    }
}
