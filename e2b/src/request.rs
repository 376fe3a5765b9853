//! What E2B's handlers share to read a request: a slot of the token's rate
//! limit, the JSON body, the query's pairs and a page's limit.

use std::collections::BTreeMap;

use axum::body::Bytes;
use serde::de::DeserializeOwned;

use super::error::E2bError;
use super::wire::{Cursor, MAX_LIMIT};
use torpor_gate::auth::Principal;
use torpor_gate::backend::SandboxApi;
use torpor_gate::error::ApiError;
use torpor_gate::handlers::AppState;
use torpor_gate::tenancy::{Limited, Permit};

type E2bResult<T> = Result<T, E2bError>;

/// A slot of the token's rate limit (the same [`torpor_gate::tenancy::Limiter`]
/// as `/v1`'s): 429 past it.
pub(super) fn permit<S: SandboxApi>(
    state: &AppState<S>,
    p: &Principal,
) -> E2bResult<Option<Permit>> {
    state
        .tenancy
        .limiter
        .acquire(p)
        .map_err(|wait| ApiError::from(Limited(wait)).into())
}

/// A required JSON body; 400 with serde's reason when it does not parse.
pub(super) fn body<T: DeserializeOwned>(bytes: &Bytes) -> E2bResult<T> {
    serde_json::from_slice(bytes)
        .map_err(|e| E2bError::bad_request(format!("invalid request body: {e}")))
}

/// The limit of a page: 1 to 100, 100 by default; else 400.
pub(super) fn limit(q: &BTreeMap<String, String>) -> E2bResult<usize> {
    match q.get("limit") {
        None => Ok(MAX_LIMIT),
        Some(l) => match l.parse::<usize>() {
            Ok(n) if (1..=MAX_LIMIT).contains(&n) => Ok(n),
            _ => Err(E2bError::bad_request(format!(
                "limit {l:?} is not a number from 1 to {MAX_LIMIT}"
            ))),
        },
    }
}

/// A page of a list ordered by creation: its [`limit`] and the cursor of
/// `nextToken` (a previous page's `x-next-token`; empty is none), 400
/// for a token we did not give.
pub(super) fn page_query(q: &BTreeMap<String, String>) -> E2bResult<(usize, Option<Cursor>)> {
    let after = q
        .get("nextToken")
        .filter(|t| !t.is_empty())
        .map(|t| Cursor::decode(t))
        .transpose()?;
    Ok((limit(q)?, after))
}

/// The query of a list: its pairs, percent-decoded.
pub(super) fn query_pairs(raw: Option<String>) -> BTreeMap<String, String> {
    form_urlencoded::parse(raw.unwrap_or_default().as_bytes())
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect()
}
