//! Path patterns: globs of a COPY source (`*`, `?`, `[a-z]`, `[!x]`, `\`
//! escapes, per path component; `**` for any number of components, as
//! E2B's SDKs allow) and `.dockerignore` ([`Ignore`]): one pattern per
//! line, `#` comments, `!` exceptions, anchored at the context's root (a
//! leading `/` changes nothing), a pattern matching a directory ignoring
//! everything under it, the last matching line winning.

/// A pattern that does not parse: an unclosed `[`, a trailing `\`.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error("bad pattern {0:?}: an unclosed [ or a trailing \\")]
pub struct BadPattern(pub String);

/// Whether `part` (one path component) has glob characters.
pub fn has_meta(part: &str) -> bool {
    part.contains(['*', '?', '[', '\\'])
}

/// `pattern` is well formed.
pub fn check(pattern: &str) -> Result<(), BadPattern> {
    let p: Vec<char> = pattern.chars().collect();
    let bad = || BadPattern(pattern.to_string());
    let mut i = 0;
    while i < p.len() {
        match p[i] {
            '\\' if i + 1 == p.len() => return Err(bad()),
            '\\' => i += 2,
            '[' => i = class_end(&p, i).ok_or_else(bad)?,
            _ => i += 1,
        }
    }
    Ok(())
}

/// The index past the class opened at `p[at] == '['`.
fn class_end(p: &[char], at: usize) -> Option<usize> {
    let mut i = at + 1;
    if matches!(p.get(i), Some('!' | '^')) {
        i += 1;
    }
    let first = i;
    loop {
        match p.get(i)? {
            ']' if i > first => return Some(i + 1),
            '\\' => i += 2,
            _ => i += 1,
        }
    }
}

/// Whether the class at `p[at] == '['` matches `c`, and the index past it.
fn class(p: &[char], at: usize, c: char) -> Option<(bool, usize)> {
    let end = class_end(p, at)?;
    let mut i = at + 1;
    let negated = matches!(p[i], '!' | '^');
    if negated {
        i += 1;
    }
    let mut matched = false;
    while i < end - 1 {
        let lo = if p[i] == '\\' {
            i += 1;
            p[i]
        } else {
            p[i]
        };
        i += 1;
        if p.get(i) == Some(&'-') && i + 1 < end - 1 {
            let hi = if p[i + 1] == '\\' { p[i + 2] } else { p[i + 1] };
            i += if p[i + 1] == '\\' { 3 } else { 2 };
            matched |= (lo..=hi).contains(&c);
        } else {
            matched |= lo == c;
        }
    }
    Some((matched != negated, end))
}

/// Whether `name` (one component) matches `pattern` (one component);
/// `*` also matches a leading dot.
pub fn component_match(pattern: &str, name: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let n: Vec<char> = name.chars().collect();
    let (mut pi, mut ni) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    loop {
        if pi < p.len() {
            let step = match p[pi] {
                '*' => {
                    star = Some((pi, ni));
                    pi += 1;
                    continue;
                }
                '?' => (ni < n.len()).then_some(pi + 1),
                '[' if ni < n.len() => match class(&p, pi, n[ni]) {
                    Some((true, next)) => Some(next),
                    _ => None,
                },
                '\\' => (p.get(pi + 1).is_some() && n.get(ni) == p.get(pi + 1)).then_some(pi + 2),
                c => (n.get(ni) == Some(&c)).then_some(pi + 1),
            };
            if let Some(next) = step {
                pi = next;
                ni += 1;
                continue;
            }
        } else if ni == n.len() {
            return true;
        }
        match star {
            Some((sp, sn)) if sn < n.len() => {
                star = Some((sp, sn + 1));
                pi = sp + 1;
                ni = sn + 1;
            }
            _ => return false,
        }
    }
}

/// Whether the components `path` match the pattern components `pattern`
/// (`**` any number of components).
pub fn path_match<S: AsRef<str>>(pattern: &[S], path: &[&str]) -> bool {
    match pattern.split_first() {
        None => path.is_empty(),
        Some((first, rest)) if first.as_ref() == "**" => {
            (0..=path.len()).any(|k| path_match(rest, &path[k..]))
        }
        Some((first, rest)) => match path.split_first() {
            Some((name, tail)) => component_match(first.as_ref(), name) && path_match(rest, tail),
            None => false,
        },
    }
}

/// `.dockerignore`'s rules.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ignore {
    rules: Vec<Rule>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Rule {
    /// The pattern's components.
    parts: Vec<String>,
    /// `!pattern`: matching paths are kept.
    exception: bool,
}

impl Ignore {
    /// The rules of a `.dockerignore`'s text.
    pub fn parse(text: &str) -> Result<Ignore, BadPattern> {
        let mut rules = Vec::new();
        for line in text.lines() {
            let line = line.trim_start_matches('\u{feff}');
            if line.starts_with('#') {
                continue;
            }
            let mut pattern = line.trim();
            let exception = pattern.starts_with('!');
            if exception {
                pattern = pattern[1..].trim();
            }
            check(pattern)?;
            let parts: Vec<String> = clean(pattern);
            if parts.is_empty() {
                continue;
            }
            rules.push(Rule { parts, exception });
        }
        Ok(Ignore { rules })
    }

    /// Whether `rel` (a `/`-separated path from the context's root) is
    /// ignored: the last rule matching it or one of its parents decides.
    pub fn is_ignored(&self, rel: &str) -> bool {
        let parts: Vec<&str> = rel.split('/').filter(|p| !p.is_empty()).collect();
        let mut ignored = false;
        for rule in &self.rules {
            if (1..=parts.len()).any(|k| path_match(&rule.parts, &parts[..k])) {
                ignored = !rule.exception;
            }
        }
        ignored
    }

    /// Whether some rule is an exception: then an ignored directory is
    /// still walked, for the paths an exception keeps.
    pub fn has_exceptions(&self) -> bool {
        self.rules.iter().any(|r| r.exception)
    }
}

/// `pattern`'s components, cleaned: `.` and empty ones dropped, `..`
/// taking one off (never above the root), a leading `/` ignored.
fn clean(pattern: &str) -> Vec<String> {
    let mut parts: Vec<String> = Vec::new();
    for part in pattern.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            p => parts.push(p.to_string()),
        }
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn components_match_like_filepath_match() {
        assert!(component_match("*.py", "main.py"));
        assert!(component_match("*.py", ".hidden.py"));
        assert!(!component_match("*.py", "main.pyc"));
        assert!(component_match("a?c", "abc"));
        assert!(!component_match("a?c", "ac"));
        assert!(component_match("[a-c]x", "bx"));
        assert!(!component_match("[!a-c]x", "bx"));
        assert!(component_match("[^a-c]x", "dx"));
        assert!(component_match("\\*", "*"));
        assert!(!component_match("\\*", "a"));
        assert!(component_match("*a*b", "xxaybzb"));
        assert!(component_match("", ""));
        assert!(!component_match("", "a"));
    }

    #[test]
    fn double_star_spans_directories() {
        let p = ["**", "*.md"];
        assert!(path_match(&p, &["README.md"]));
        assert!(path_match(&p, &["docs", "a", "x.md"]));
        assert!(!path_match(&p, &["docs", "x.txt"]));
        assert!(path_match(&["a", "**"], &["a"]));
        assert!(path_match(&["a", "**"], &["a", "b", "c"]));
    }

    #[test]
    fn bad_patterns_are_refused() {
        assert_eq!(check("[abc"), Err(BadPattern("[abc".into())));
        assert_eq!(check("abc\\"), Err(BadPattern("abc\\".into())));
        assert_eq!(check("[]"), Err(BadPattern("[]".into())));
        assert_eq!(check("a[]]b"), Ok(()));
        assert!(Ignore::parse("ok\n[bad\n").is_err());
    }

    #[test]
    fn dockerignore_rules() {
        let ignore = Ignore::parse(
            "# comment\n\n/node_modules\n*.log\n**/*.tmp\nbuild\n!build/keep.txt\n./docs/../secret\n",
        )
        .unwrap();
        assert!(ignore.is_ignored("node_modules"));
        assert!(ignore.is_ignored("node_modules/x/y.js"));
        assert!(ignore.is_ignored("a.log"));
        assert!(
            !ignore.is_ignored("sub/a.log"),
            "*.log is anchored at the root"
        );
        assert!(ignore.is_ignored("sub/deep/a.tmp"));
        assert!(ignore.is_ignored("build/out.o"));
        assert!(!ignore.is_ignored("build/keep.txt"));
        assert!(ignore.is_ignored("secret"));
        assert!(!ignore.is_ignored("src/main.rs"));
        assert!(!ignore.is_ignored("# comment"));
        assert!(ignore.has_exceptions());
        assert!(!Ignore::parse("a\n").unwrap().has_exceptions());
    }
}
