//! E2B's sandbox lists: `GET /v2/sandboxes` (the SDKs' `Sandbox.list()`
//! paginator) and the deprecated `GET /sandboxes`, as E2B's API answers
//! them (`spec/openapi.yml`, its `sandboxes_list.go`):
//!
//! - newest first by default (`order=desc`); `order=asc` oldest first.
//!   Ties on the start time are broken by id, ascending for `desc` and
//!   descending for `asc` (one order the exact reverse of the other);
//! - `limit` (1 to 100, default 100) and `nextToken`: the next page's
//!   token is the `x-next-token` header, absent on the last page. It is
//!   E2B's form, base64url of `<RFC 3339 start>__<id>` (`__asc` appended
//!   for ascending pages), and is bound to its order: a token of one
//!   order replayed with the other is 400, as any token we did not give;
//! - `x-total-running`: the running sandboxes that match every filter,
//!   before the page is cut, whenever running ones were asked for;
//! - `metadata`: `k=v&k2=v2` with keys and values percent-encoded, decoded
//!   as E2B's `parseFilters` does (the whole value once, then each key
//!   and value again; a pair without exactly one `=` is 400).

use std::collections::BTreeMap;

use axum::extract::{Extension, RawQuery};
use axum::http::header::HeaderValue;
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine;
use torpor_scheduler::model::{Sandbox, Timestamp};

use super::error::E2bError;
use super::request::{limit, query_pairs};
use super::routes::detail;
use super::wire::{e2b_state, torpor_states, SandboxDetail};
use torpor_gate::auth::Principal;
use torpor_gate::backend::SandboxApi;
use torpor_gate::handlers::{call, Api};
use torpor_gate::service::{SandboxFilter, ServiceError};

type E2bResult<T> = Result<T, E2bError>;

/// The header with the count of running sandboxes that match.
pub const TOTAL_RUNNING_HEADER: &str = "x-total-running";
/// The header with the next page's token.
pub const NEXT_TOKEN_HEADER: &str = "x-next-token";

/// A list's order by start time (`order`): newest first by default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Order {
    Asc,
    #[default]
    Desc,
}

impl Order {
    fn parse(word: Option<&str>) -> E2bResult<Order> {
        match word {
            None | Some("desc") => Ok(Order::Desc),
            Some("asc") => Ok(Order::Asc),
            Some(o) => Err(E2bError::bad_request(format!(
                "Invalid order parameter: unknown order {o:?}"
            ))),
        }
    }

    /// E2B's sort: `desc` by (start DESC, id ASC), `asc` the exact reverse.
    fn cmp(self, a: &Key, b: &Key) -> std::cmp::Ordering {
        let desc = b.at.cmp(&a.at).then_with(|| a.id.cmp(&b.id));
        match self {
            Order::Desc => desc,
            Order::Asc => desc.reverse(),
        }
    }
}

/// Where a sandbox sorts: its start (creation) time and id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Key {
    pub at: Timestamp,
    pub id: String,
}

impl Key {
    fn of(s: &Sandbox) -> Key {
        Key {
            at: s.created_at,
            id: s.id.to_string(),
        }
    }
}

/// A page token: the key of the page's last entry, and the order it was
/// given for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Token {
    pub after: Key,
    pub order: Order,
}

const ASC_SUFFIX: &str = "asc";

impl Token {
    pub fn encode(&self) -> String {
        let mut text = format!("{}__{}", super::time::format(self.after.at), self.after.id);
        if self.order == Order::Asc {
            text.push_str("__");
            text.push_str(ASC_SUFFIX);
        }
        base64::engine::general_purpose::URL_SAFE.encode(text)
    }

    /// A token we gave (400 otherwise, E2B's "Invalid next token").
    pub fn decode(token: &str) -> E2bResult<Token> {
        let bad = || E2bError::bad_request("Invalid next token");
        let bytes = base64::engine::general_purpose::URL_SAFE
            .decode(token)
            .map_err(|_| bad())?;
        let text = String::from_utf8(bytes).map_err(|_| bad())?;
        let parts: Vec<&str> = text.split("__").collect();
        let order = match parts.as_slice() {
            [_, _] => Order::Desc,
            [_, _, ASC_SUFFIX] => Order::Asc,
            _ => return Err(bad()),
        };
        let at = super::time::parse(parts[0]).ok_or_else(bad)?;
        if parts[1].is_empty() {
            return Err(bad());
        }
        Ok(Token {
            after: Key {
                at,
                id: parts[1].to_string(),
            },
            order,
        })
    }

    /// Whether `key` comes after this token's entry in its order.
    fn passes(&self, key: &Key) -> bool {
        self.order.cmp(&self.after, key) == std::cmp::Ordering::Less
    }
}

/// Go's `url.QueryUnescape`: `+` is a space, `%XX` a byte (any other `%`
/// is an error); the bytes must be UTF-8.
fn query_unescape(text: &str) -> Option<String> {
    let b = text.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = |c: u8| (c as char).to_digit(16);
                let hi = hex(*b.get(i + 1)?)?;
                let lo = hex(*b.get(i + 2)?)?;
                out.push((hi * 16 + lo) as u8);
                i += 2;
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8(out).ok()
}

/// The `metadata` filter as E2B parses it (its `parseFilters`): the
/// value (already decoded once as a query parameter) is unescaped whole,
/// split on `&` into pairs of exactly one `=`, and each key and value
/// unescaped again. The SDKs send `urlencode({quote(k): quote(v)})`.
pub fn metadata_filter(text: &str) -> Result<BTreeMap<String, String>, String> {
    let whole = query_unescape(text).ok_or("error when unescaping query")?;
    let mut out = BTreeMap::new();
    for pair in whole.split('&') {
        let parts: Vec<&str> = pair.split('=').collect();
        let [k, v] = parts.as_slice() else {
            return Err("invalid key value pair in query".into());
        };
        let k = query_unescape(k).ok_or("error when unescaping key")?;
        let v = query_unescape(v).ok_or("error when unescaping value")?;
        out.insert(k, v);
    }
    Ok(out)
}

/// Whether every pair of `filter` is in the sandbox's metadata.
fn matches(s: &Sandbox, filter: &BTreeMap<String, String>) -> bool {
    filter.iter().all(|(k, v)| s.metadata.get(k) == Some(v))
}

/// The listing tenant: a tenant's key lists its own sandboxes; an
/// admin's, every one.
/// The sandboxes as E2B shows them (those it would not show left out).
async fn details<S: SandboxApi>(
    s: &S,
    builds: &torpor_gate::builds::Builds,
    sandboxes: &[Sandbox],
) -> Vec<SandboxDetail> {
    let mut shown = Vec::with_capacity(sandboxes.len());
    for x in sandboxes {
        shown.extend(detail(s, builds, x).await);
    }
    shown
}

fn scope(principal: &Principal) -> SandboxFilter {
    SandboxFilter {
        tenant: (!principal.sees_all()).then(|| principal.owner().tenant),
        ..SandboxFilter::default()
    }
}

/// What a `GET /v2/sandboxes` asked for.
#[derive(Debug, Default)]
struct Query {
    running: bool,
    paused: bool,
    metadata: Option<BTreeMap<String, String>>,
    started_after: Option<Timestamp>,
    template: Option<String>,
    order: Order,
    limit: usize,
    token: Option<Token>,
}

impl Query {
    fn parse(q: &BTreeMap<String, String>) -> E2bResult<Query> {
        let mut out = Query {
            order: Order::parse(q.get("order").map(String::as_str))?,
            limit: limit(q)?,
            ..Query::default()
        };
        match q.get("state") {
            None => (out.running, out.paused) = (true, true),
            Some(words) => {
                for word in words.split(',').map(str::trim).filter(|w| !w.is_empty()) {
                    match word {
                        "running" => out.running = true,
                        "paused" => out.paused = true,
                        _ => {
                            return Err(E2bError::bad_request(format!(
                                "unknown state {word:?} (running, paused)"
                            )))
                        }
                    }
                }
            }
        }
        if let Some(t) = q.get("nextToken").filter(|t| !t.is_empty()) {
            let token = Token::decode(t)?;
            if token.order != out.order {
                // Replayed with the other order it would serve again what
                // was seen (E2B refuses it too).
                return Err(E2bError::bad_request("Invalid next token"));
            }
            out.token = Some(token);
        }
        if let Some(m) = q.get("metadata") {
            out.metadata = Some(
                metadata_filter(m).map_err(|_| E2bError::bad_request("Error parsing metadata"))?,
            );
        }
        if let Some(t) = q.get("startedAfter") {
            out.started_after = Some(super::time::parse(t).ok_or_else(|| {
                E2bError::bad_request(format!("startedAfter {t:?} is not an RFC 3339 time"))
            })?);
        }
        out.template = q.get("template").cloned();
        Ok(out)
    }
}

/// One page of a v2 list, the running count and the next page's token.
struct Page {
    items: Vec<SandboxDetail>,
    total_running: Option<usize>,
    next: Option<String>,
}

impl IntoResponse for Page {
    fn into_response(self) -> Response {
        let mut response = Json(self.items).into_response();
        let headers = response.headers_mut();
        if let Some(n) = self.total_running {
            headers.insert(TOTAL_RUNNING_HEADER, HeaderValue::from(n));
        }
        if let Some(token) = self.next.and_then(|t| HeaderValue::from_str(&t).ok()) {
            headers.insert(NEXT_TOKEN_HEADER, token);
        }
        response
    }
}

/// `GET /v2/sandboxes`: `state` (`running,paused`, both by default),
/// `metadata`, `template` (id or name), `startedAfter`, `order` (`desc`
/// by default), `limit` (at most 100) and `nextToken`; the next page's
/// token in `x-next-token`, the running ones that match in
/// `x-total-running`.
pub async fn list_v2<S: SandboxApi>(
    state: Api<S>,
    Extension(principal): Extension<Principal>,
    RawQuery(raw): RawQuery,
) -> E2bResult<Response> {
    let q = Query::parse(&query_pairs(raw))?;
    let mut filter = scope(&principal);
    for (asked, word) in [(q.running, "running"), (q.paused, "paused")] {
        if asked {
            filter
                .states
                .extend_from_slice(torpor_states(word).unwrap_or(&[]));
        }
    }
    let owner = principal.owner();
    let builds = state.tenancy.builds.clone();
    let page = call(&state, move |s| async move {
        let s = &*s;
        if let Some(t) = &q.template {
            match s.resolve_template(&owner, t).await {
                Ok(found) => filter.template = Some(found.id),
                Err(ServiceError::NotFound { .. }) => {
                    return Ok(Page {
                        items: Vec::new(),
                        total_running: q.running.then_some(0),
                        next: None,
                    })
                }
                Err(e) => return Err(e),
            }
        }
        let mut sandboxes: Vec<Sandbox> = s
            .list_sandboxes(filter)
            .await?
            .into_iter()
            .filter(|x| q.started_after.is_none_or(|t| x.created_at >= t))
            .filter(|x| q.metadata.as_ref().is_none_or(|m| matches(x, m)))
            .collect();
        let total_running = q.running.then(|| {
            sandboxes
                .iter()
                .filter(|x| e2b_state(x.state) == Some("running"))
                .count()
        });
        sandboxes.sort_by(|a, b| q.order.cmp(&Key::of(a), &Key::of(b)));
        let rest: Vec<Sandbox> = sandboxes
            .into_iter()
            .filter(|x| q.token.as_ref().is_none_or(|t| t.passes(&Key::of(x))))
            .collect();
        let page = &rest[..rest.len().min(q.limit)];
        // A next page only when something follows the page's last entry.
        let next = (rest.len() > q.limit)
            .then(|| page.last())
            .flatten()
            .map(|last| {
                Token {
                    after: Key::of(last),
                    order: q.order,
                }
                .encode()
            });
        let items = details(s, &builds, page).await;
        Ok(Page {
            items,
            total_running,
            next,
        })
    })
    .await?;
    Ok(page.into_response())
}

/// `GET /sandboxes` (E2B's deprecated v1 list): the running sandboxes,
/// newest first, `metadata` filter; no pages.
pub async fn list_v1<S: SandboxApi>(
    state: Api<S>,
    Extension(principal): Extension<Principal>,
    RawQuery(raw): RawQuery,
) -> E2bResult<Response> {
    let q = query_pairs(raw);
    let mut filter = scope(&principal);
    filter
        .states
        .extend_from_slice(torpor_states("running").unwrap_or(&[]));
    let metadata = q
        .get("metadata")
        .map(|m| metadata_filter(m))
        .transpose()
        .map_err(|e| E2bError::bad_request(format!("Error parsing metadata: {e}")))?;
    let builds = state.tenancy.builds.clone();
    let out = call(&state, move |s| async move {
        let s = &*s;
        let mut sandboxes: Vec<Sandbox> = s
            .list_sandboxes(filter)
            .await?
            .into_iter()
            .filter(|x| metadata.as_ref().is_none_or(|m| matches(x, m)))
            .collect();
        sandboxes.sort_by(|a, b| Order::Desc.cmp(&Key::of(a), &Key::of(b)));
        Ok(details(s, &builds, &sandboxes).await)
    })
    .await?;
    Ok(Json(out).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(at: i64, id: &str) -> Key {
        Key {
            at: Timestamp(at),
            id: id.into(),
        }
    }

    #[test]
    fn metadata_is_parsed_as_e2b_parses_it() {
        // The Python SDK: urlencode({quote("team a"): quote("x&y=z")}),
        // once decoded as a query parameter.
        let m = metadata_filter("team%2520a=x%2526y%253Dz&k=v").unwrap();
        assert_eq!(m["team a"], "x&y=z");
        assert_eq!(m["k"], "v");
        // The whole value is unescaped before it is split: an encoded `=`
        // or `&` separates too, as in E2B.
        let m = metadata_filter("a%3Db%26c%3Dd").unwrap();
        assert_eq!((m["a"].as_str(), m["c"].as_str()), ("b", "d"));
        assert_eq!(metadata_filter("k=a+b").unwrap()["k"], "a b");
        // An empty key is a key (that no sandbox has).
        assert_eq!(metadata_filter("=v").unwrap()[""], "v");
        for bad in ["", "k", "k=v=w", "k=v&", "k=%ZZ", "k=%2", "k=%25FF"] {
            assert!(metadata_filter(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn order_is_newest_first_and_asc_its_reverse() {
        let mut keys = vec![key(1, "a"), key(2, "c"), key(2, "b"), key(3, "d")];
        keys.sort_by(|a, b| Order::Desc.cmp(a, b));
        assert_eq!(keys, [key(3, "d"), key(2, "b"), key(2, "c"), key(1, "a")]);
        keys.sort_by(|a, b| Order::Asc.cmp(a, b));
        assert_eq!(keys, [key(1, "a"), key(2, "c"), key(2, "b"), key(3, "d")]);
        assert_eq!(Order::parse(None).unwrap(), Order::Desc);
        assert!(Order::parse(Some("sideways")).is_err());
    }

    #[test]
    fn tokens_round_trip_and_carry_their_order() {
        for order in [Order::Asc, Order::Desc] {
            let t = Token {
                after: key(1_764_000_000_123, "sbx_00000000000000ab"),
                order,
            };
            let text = t.encode();
            assert_eq!(Token::decode(&text).unwrap(), t);
            let plain = base64::engine::general_purpose::URL_SAFE
                .decode(&text)
                .unwrap();
            let plain = String::from_utf8(plain).unwrap();
            assert!(plain.starts_with("2025-11-24T"), "{plain}");
            assert_eq!(plain.ends_with("__asc"), order == Order::Asc, "{plain}");
        }
        let t = Token {
            after: key(2, "b"),
            order: Order::Desc,
        };
        assert!(t.passes(&key(1, "z")));
        assert!(t.passes(&key(2, "c")));
        assert!(!t.passes(&key(2, "b")));
        assert!(!t.passes(&key(2, "a")));
        assert!(!t.passes(&key(3, "a")));
        for bad in ["", "garbage", "!!", "MTIz", "eF9feQ=="] {
            assert!(Token::decode(bad).is_err(), "{bad:?}");
        }
        let wrong_suffix =
            base64::engine::general_purpose::URL_SAFE.encode("2025-11-24T00:00:00.000Z__sbx_1__up");
        assert!(Token::decode(&wrong_suffix).is_err());
    }
}
