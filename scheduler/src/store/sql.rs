//! How model values become SQLite values and back. A stored value that does
//! not parse is a conversion failure, which [`super::StoreError`] reports as
//! `Corrupt`.

use std::path::{Path, PathBuf};

use rusqlite::types::{FromSql, FromSqlError, FromSqlResult, ToSql, ToSqlOutput, ValueRef};
use rusqlite::Row;

use super::journal::{OperationKind, OperationStatus};
use super::StoreError;
use crate::model::{
    CheckpointId, HibernationKind, OnTimeout, OperationId, PodId, SandboxId, TemplateId,
    TemplateKind, Timestamp,
};
use crate::state::SandboxState;

macro_rules! sql_id {
    ($($ty:ty),+) => {$(
        impl ToSql for $ty {
            fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
                Ok(ToSqlOutput::Borrowed(ValueRef::Text(self.as_str().as_bytes())))
            }
        }
        impl FromSql for $ty {
            fn column_result(value: ValueRef<'_>) -> FromSqlResult<Self> {
                String::column_result(value).map(<$ty>::new)
            }
        }
    )+};
}
sql_id!(SandboxId, TemplateId, PodId, CheckpointId, OperationId);

macro_rules! sql_word {
    ($($ty:ty),+) => {$(
        impl ToSql for $ty {
            fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
                Ok(ToSqlOutput::Borrowed(ValueRef::Text(self.as_str().as_bytes())))
            }
        }
        impl FromSql for $ty {
            fn column_result(value: ValueRef<'_>) -> FromSqlResult<Self> {
                value.as_str()?.parse().map_err(|e| FromSqlError::Other(Box::new(e)))
            }
        }
    )+};
}
sql_word!(
    SandboxState,
    TemplateKind,
    OnTimeout,
    HibernationKind,
    OperationKind,
    OperationStatus
);

impl ToSql for Timestamp {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        self.0.to_sql()
    }
}

impl FromSql for Timestamp {
    fn column_result(value: ValueRef<'_>) -> FromSqlResult<Self> {
        i64::column_result(value).map(Timestamp)
    }
}

/// A path as stored text; paths that are not UTF-8 are refused.
pub(crate) fn path_text<'p>(path: &'p Path, what: &'static str) -> Result<&'p str, StoreError> {
    path.to_str().ok_or_else(|| StoreError::Invalid {
        what,
        detail: format!("path {} is not UTF-8", path.display()),
    })
}

/// An optional path as optional stored text.
pub(crate) fn opt_path_text<'p>(
    path: Option<&'p Path>,
    what: &'static str,
) -> Result<Option<&'p str>, StoreError> {
    path.map(|p| path_text(p, what)).transpose()
}

/// A `u64` as SQLite's `i64`; larger values are refused.
pub(crate) fn u64_sql(value: u64, what: &'static str) -> Result<i64, StoreError> {
    i64::try_from(value).map_err(|_| StoreError::Invalid {
        what,
        detail: format!("{value} is too large"),
    })
}

/// Reads a non-negative integer column as `u64`.
pub(crate) fn get_u64(row: &Row<'_>, col: &str) -> rusqlite::Result<u64> {
    let v: i64 = row.get(col)?;
    let idx = row.as_ref().column_index(col)?;
    u64::try_from(v).map_err(|_| rusqlite::Error::IntegralValueOutOfRange(idx, v))
}

/// Reads an optional text column as a path.
pub(crate) fn get_path(row: &Row<'_>, col: &str) -> rusqlite::Result<Option<PathBuf>> {
    Ok(row.get::<_, Option<String>>(col)?.map(PathBuf::from))
}
