//! Shell quoting: [`quote`] is Python's `shlex.quote` (what E2B's SDKs
//! use to build their commands, so that our commands are byte for byte
//! theirs), and [`unquote`] reads back exactly the words it writes.

/// The characters `shlex.quote` leaves bare.
fn safe(c: char) -> bool {
    c.is_ascii_alphanumeric() || "@%+=:,./-_".contains(c)
}

/// `s` as one shell word: bare when every character is safe, otherwise in
/// single quotes with each `'` written as `'"'"'` (Python's `shlex.quote`,
/// and the JS SDK's `shellQuote`).
pub fn quote(s: &str) -> String {
    if s.is_empty() {
        return "''".to_string();
    }
    if s.chars().all(safe) {
        return s.to_string();
    }
    format!("'{}'", s.replace('\'', "'\"'\"'"))
}

/// The words of `argv`, each quoted, joined by spaces (Python's
/// `shlex.join`): a command that runs `argv` without a shell's rewriting.
pub fn join(argv: &[String]) -> String {
    argv.iter().map(|a| quote(a)).collect::<Vec<_>>().join(" ")
}

/// The word [`quote`] wrote as `q`, or `None` when `q` is not such a word
/// (bare safe characters, or single-quoted parts and `"'"` parts only).
pub fn unquote(q: &str) -> Option<String> {
    if !q.is_empty() && q.chars().all(safe) {
        return Some(q.to_string());
    }
    let mut out = String::new();
    let mut rest = q;
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        if let Some(r) = rest.strip_prefix("\"'\"") {
            out.push('\'');
            rest = r;
        } else if let Some(r) = rest.strip_prefix('\'') {
            let end = r.find('\'')?;
            out.push_str(&r[..end]);
            rest = &r[end + 1..];
        } else {
            return None;
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quote_is_shlex_quote() {
        assert_eq!(quote("nginx"), "nginx");
        assert_eq!(quote("/tmp/a-b_c.txt"), "/tmp/a-b_c.txt");
        assert_eq!(quote(""), "''");
        assert_eq!(quote("a b"), "'a b'");
        assert_eq!(quote("it's"), "'it'\"'\"'s'");
        assert_eq!(
            quote("http://localhost:3000/health?x=1"),
            "'http://localhost:3000/health?x=1'"
        );
        assert_eq!(
            join(&["python3".into(), "app.py".into(), "a b".into()]),
            "python3 app.py 'a b'"
        );
    }

    #[test]
    fn unquote_reads_back_what_quote_writes() {
        for s in ["nginx", "a b", "it's", "''", "x'y'z", "$HOME", "a\nb"] {
            assert_eq!(unquote(&quote(s)).as_deref(), Some(s), "{s:?}");
        }
        assert_eq!(unquote("a b"), None);
        assert_eq!(unquote("'open"), None);
        assert_eq!(unquote("\"double\""), None);
        assert_eq!(unquote(""), None);
    }
}
