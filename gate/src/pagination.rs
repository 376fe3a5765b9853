//! Paginated lists: `limit` (at most [`MAX_PAGE`], the default) and
//! `next`, the token a previous page answered with, in the body (`next`)
//! and in the `X-Next-Token` header (as E2B's API does). Items are ordered
//! by creation time and id; the token names the last item of its page, so
//! a page after deletions neither repeats nor skips what remains.

use axum::http::header::HeaderValue;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;

use crate::error::ApiError;

/// Largest page, and the page without `limit`.
pub const MAX_PAGE: usize = 1000;
/// The header carrying the next page's token.
pub const NEXT_HEADER: &str = "x-next-token";

/// `limit` and `next` of a list request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Page {
    pub limit: Option<usize>,
    /// After this (created_at, id).
    pub after: Option<(i64, String)>,
}

impl Page {
    /// Takes `limit` and `next` out of the query pairs; the rest.
    pub fn split(pairs: Vec<(String, String)>) -> Result<(Vec<(String, String)>, Page), ApiError> {
        let mut page = Page::default();
        let mut rest = Vec::new();
        for (k, v) in pairs {
            match k.as_str() {
                "limit" => {
                    let n: usize = v
                        .parse()
                        .ok()
                        .filter(|n| (1..=MAX_PAGE).contains(n))
                        .ok_or_else(|| {
                            ApiError::invalid(format!("limit must be 1..={MAX_PAGE}"))
                        })?;
                    page.limit = Some(n);
                }
                "next" => page.after = Some(parse_token(&v)?),
                _ => rest.push((k, v)),
            }
        }
        Ok((rest, page))
    }

    /// A JSON answer with `X-Next-Token` when there is a next page.
    pub fn respond<T: Serialize>(body: T, next: Option<String>) -> Response {
        let mut response = Json(body).into_response();
        if let Some(v) = next.and_then(|n| HeaderValue::from_str(&n).ok()) {
            response.headers_mut().insert(NEXT_HEADER, v);
        }
        response
    }
}

fn parse_token(token: &str) -> Result<(i64, String), ApiError> {
    let bad = || ApiError::invalid("next is not a token this API gave");
    // The form the OpenAPI document gives: `^-?[0-9]{1,18}\.[A-Za-z0-9_]{1,64}$`.
    let (at, id) = token.split_once('.').ok_or_else(bad)?;
    let digits = at.strip_prefix('-').unwrap_or(at);
    if digits.is_empty() || digits.len() > 18 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let at: i64 = at.parse().map_err(|_| bad())?;
    if id.is_empty() || id.len() > 64 || !id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
    {
        return Err(bad());
    }
    Ok((at, id.to_string()))
}

/// Items that can be paged: creation time (ms) and id.
pub trait Keyed {
    fn key(&self) -> (i64, &str);
}

impl Keyed for torpor_scheduler::model::Sandbox {
    fn key(&self) -> (i64, &str) {
        (self.created_at.0, self.id.as_str())
    }
}

impl Keyed for serde_json::Value {
    fn key(&self) -> (i64, &str) {
        (
            self["created_at"].as_i64().unwrap_or(0),
            self["id"].as_str().unwrap_or_default(),
        )
    }
}

/// One page of `items` and the next page's token (none on the last page).
pub fn page<T: Keyed>(mut items: Vec<T>, p: &Page) -> (Vec<T>, Option<String>) {
    items.sort_by(|a, b| a.key().cmp(&b.key()));
    if let Some((at, id)) = &p.after {
        items.retain(|i| i.key() > (*at, id.as_str()));
    }
    let limit = p.limit.unwrap_or(MAX_PAGE);
    if items.len() <= limit {
        return (items, None);
    }
    items.truncate(limit);
    let next = items.last().map(|i| {
        let (at, id) = i.key();
        format!("{at}.{id}")
    });
    (items, next)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn pages_walk_the_list_once_even_after_deletions() {
        let items: Vec<serde_json::Value> = (0..7)
            .map(|i| json!({"id": format!("sbx_{i}"), "created_at": 100 + i / 2}))
            .collect();
        let pairs = vec![
            ("limit".to_string(), "3".to_string()),
            ("state".into(), "running".into()),
        ];
        let (rest, mut p) = Page::split(pairs).unwrap();
        assert_eq!(rest, vec![("state".to_string(), "running".to_string())]);
        let mut seen = Vec::new();
        let mut list = items.clone();
        loop {
            let (got, next) = page(list.clone(), &p);
            seen.extend(got.iter().map(|v| v["id"].as_str().unwrap().to_string()));
            // The page's last item is deleted before the next request.
            list.retain(|v| Some(v) != got.last());
            let Some(next) = next else { break };
            let (_, np) =
                Page::split(vec![("next".into(), next), ("limit".into(), "3".into())]).unwrap();
            p = np;
        }
        let all: Vec<String> = items
            .iter()
            .map(|v| v["id"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(seen, all);
        for bad in ["0", "1001", "x"] {
            assert!(Page::split(vec![("limit".into(), bad.into())]).is_err());
        }
        for bad in ["", "x", "1.", "1.a/b", "a.sbx"] {
            assert!(
                Page::split(vec![("next".into(), bad.into())]).is_err(),
                "{bad}"
            );
        }
    }
}
