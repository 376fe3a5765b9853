//! A Dockerfile's lexical layer: parser directives (`# escape=`), comments,
//! line continuations ([`logical_lines`]), heredoc detection
//! ([`has_heredoc`]), and Docker's word processing: quotes, escapes and
//! `$VAR` / `${VAR}` / `${VAR:-word}` / `${VAR-word}` / `${VAR:+word}` /
//! `${VAR+word}` substitution ([`Words`]).

use super::{DockerfileError, Problem};

/// One instruction's text, its continuation lines joined.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Line {
    /// The physical line it starts on, from 1.
    pub number: usize,
    /// The text, continuations removed, comments inside it dropped.
    pub text: String,
}

/// The escape character (`\`, or `` ` `` by directive) and the logical
/// lines of `text`: comment and empty lines dropped, a line ending in the
/// escape character joined with the next.
pub(crate) fn logical_lines(text: &str) -> Result<(char, Vec<Line>), DockerfileError> {
    let physical: Vec<&str> = text.lines().collect();
    let mut escape = '\\';
    // Parser directives: `# key=value` lines at the very top.
    let mut first = 0;
    let mut seen = Vec::new();
    for (i, line) in physical.iter().enumerate() {
        let Some(directive) = directive(line) else {
            break;
        };
        first = i + 1;
        let (key, value) = directive;
        if seen.contains(&key) {
            return Err(DockerfileError::at(
                i + 1,
                Problem::Syntax(format!("the {key} directive is given twice")),
            ));
        }
        seen.push(key.clone());
        if key == "escape" {
            escape = match value.as_str() {
                "\\" => '\\',
                "`" => '`',
                v => {
                    return Err(DockerfileError::at(
                        i + 1,
                        Problem::Syntax(format!("escape directive {v:?}: only \\ or `")),
                    ))
                }
            };
        }
    }
    let mut lines = Vec::new();
    let mut current: Option<Line> = None;
    for (i, raw) in physical.iter().enumerate().skip(first) {
        let trimmed = raw.trim_start();
        // A comment line, also inside a continuation; an empty line
        // inside a continuation is skipped as Docker does.
        if trimmed.starts_with('#') || trimmed.trim_end().is_empty() {
            continue;
        }
        let body = raw.trim_end();
        let (body, continues) = match body.strip_suffix(escape) {
            Some(b) => (b, true),
            None => (body, false),
        };
        match current.as_mut() {
            Some(line) => line.text.push_str(body),
            None => {
                current = Some(Line {
                    number: i + 1,
                    text: body.trim_start().to_string(),
                })
            }
        }
        if !continues {
            lines.extend(current.take());
        }
    }
    // A continuation at the end of the file ends the instruction.
    lines.extend(current.take());
    Ok((escape, lines))
}

/// `# key=value` as a parser directive (lowercase key), if `line` is one.
fn directive(line: &str) -> Option<(String, String)> {
    let body = line.trim().strip_prefix('#')?.trim();
    let (key, value) = body.split_once('=')?;
    let key = key.trim().to_ascii_lowercase();
    if key.is_empty() || !key.bytes().all(|b| b.is_ascii_alphabetic()) {
        return None;
    }
    Some((key, value.trim().to_string()))
}

/// Whether `text` holds a heredoc (`<<EOF`, `<<-EOF`, `<<"EOF"`) outside
/// quotes: BuildKit's syntax, not supported here.
pub(crate) fn has_heredoc(text: &str) -> bool {
    let c: Vec<char> = text.chars().collect();
    let mut quote: Option<char> = None;
    let mut i = 0;
    while i < c.len() {
        match (quote, c[i]) {
            (Some(q), ch) if ch == q => quote = None,
            (Some(_), _) => {}
            (None, '\'' | '"') => quote = Some(c[i]),
            (None, '<')
                if c.get(i + 1) == Some(&'<')
                    && (i == 0 || c[i - 1] != '<')
                    && c.get(i + 2) != Some(&'<') =>
            {
                let mut j = i + 2;
                if c.get(j) == Some(&'-') {
                    j += 1;
                }
                if matches!(c.get(j), Some('"' | '\'')) {
                    j += 1;
                }
                if c.get(j)
                    .is_some_and(|ch| ch.is_ascii_alphabetic() || *ch == '_')
                {
                    return true;
                }
            }
            _ => {}
        }
        i += 1;
    }
    false
}

/// What a variable is while processing words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Var {
    /// Known: substituted.
    Value(String),
    /// Left as written, for the build's environment to expand later.
    Keep,
    /// Unset: empty.
    Unset,
}

/// What the variables are, for [`Words`].
pub(crate) trait Lookup {
    /// Variable `name`.
    fn lookup(&self, name: &str) -> Var;
}

impl<F: Fn(&str) -> Var> Lookup for F {
    fn lookup(&self, name: &str) -> Var {
        self(name)
    }
}

/// Docker's word processing for one instruction.
pub(crate) struct Words<'a> {
    /// The escape character.
    pub escape: char,
    /// The line, for errors.
    pub line: usize,
    /// What each variable is.
    pub lookup: &'a dyn Lookup,
    /// Write the result in `crate::env::expand`'s syntax (literal `$` and
    /// `\` escaped, kept references raw) instead of plain text.
    pub for_env: bool,
}

impl Words<'_> {
    /// `text` split into words at unquoted whitespace, each processed.
    pub fn split(&self, text: &str) -> Result<Vec<String>, DockerfileError> {
        let c: Vec<char> = text.chars().collect();
        let mut words = Vec::new();
        let mut i = 0;
        loop {
            while c.get(i).is_some_and(|ch| ch.is_whitespace()) {
                i += 1;
            }
            if i >= c.len() {
                return Ok(words);
            }
            let (word, next) = self.word(&c, i, true, None)?;
            words.push(word);
            i = next;
        }
    }

    /// `text` processed as one word (whitespace kept).
    pub fn one(&self, text: &str) -> Result<String, DockerfileError> {
        let c: Vec<char> = text.chars().collect();
        Ok(self.word(&c, 0, false, None)?.0)
    }

    fn error(&self, message: impl Into<String>) -> DockerfileError {
        DockerfileError::at(self.line, Problem::Syntax(message.into()))
    }

    fn push_literal(&self, out: &mut String, ch: char) {
        if self.for_env && (ch == '$' || ch == '\\') {
            out.push('\\');
        }
        out.push(ch);
    }

    /// The word from `c[at]`: until unquoted whitespace when `split`, or
    /// until the unquoted `stop` character, or the end. Returns it and the
    /// index it stopped at.
    fn word(
        &self,
        c: &[char],
        at: usize,
        split: bool,
        stop: Option<char>,
    ) -> Result<(String, usize), DockerfileError> {
        let mut out = String::new();
        let mut i = at;
        while i < c.len() {
            let ch = c[i];
            if (split && ch.is_whitespace()) || Some(ch) == stop {
                break;
            }
            if ch == self.escape {
                match c.get(i + 1) {
                    Some(&next) => self.push_literal(&mut out, next),
                    None => self.push_literal(&mut out, ch),
                }
                i += 2;
            } else if ch == '\'' {
                let end = c[i + 1..]
                    .iter()
                    .position(|&q| q == '\'')
                    .ok_or_else(|| self.error("unterminated single quote"))?;
                for &q in &c[i + 1..i + 1 + end] {
                    self.push_literal(&mut out, q);
                }
                i += end + 2;
            } else if ch == '"' {
                i += 1;
                loop {
                    match c.get(i) {
                        None => return Err(self.error("unterminated double quote")),
                        Some('"') => {
                            i += 1;
                            break;
                        }
                        Some(&e) if e == self.escape => {
                            match c.get(i + 1) {
                                Some(&n) if n == '"' || n == '$' || n == self.escape => {
                                    self.push_literal(&mut out, n);
                                }
                                Some(&n) => {
                                    self.push_literal(&mut out, e);
                                    self.push_literal(&mut out, n);
                                }
                                None => return Err(self.error("unterminated double quote")),
                            }
                            i += 2;
                        }
                        Some('$') => i = self.dollar(c, i, &mut out)?,
                        Some(&q) => {
                            self.push_literal(&mut out, q);
                            i += 1;
                        }
                    }
                }
            } else if ch == '$' {
                i = self.dollar(c, i, &mut out)?;
            } else {
                self.push_literal(&mut out, ch);
                i += 1;
            }
        }
        Ok((out, i))
    }

    /// The substitution at `c[at] == '$'`, written to `out`; the index
    /// past it.
    fn dollar(&self, c: &[char], at: usize, out: &mut String) -> Result<usize, DockerfileError> {
        let name_start = |ch: &char| ch.is_ascii_alphabetic() || *ch == '_';
        let name_char = |ch: &char| ch.is_ascii_alphanumeric() || *ch == '_';
        let mut i = at + 1;
        if c.get(i).is_some_and(name_start) {
            while c.get(i).is_some_and(name_char) {
                i += 1;
            }
            let name: String = c[at + 1..i].iter().collect();
            self.emit(out, &name, &c[at..i]);
            return Ok(i);
        }
        if c.get(i) != Some(&'{') {
            self.push_literal(out, '$');
            return Ok(i);
        }
        i += 1;
        let start = i;
        if !c.get(i).is_some_and(name_start) {
            return Err(self.error("bad substitution: ${ without a variable name"));
        }
        while c.get(i).is_some_and(name_char) {
            i += 1;
        }
        let name: String = c[start..i].iter().collect();
        match c.get(i) {
            Some('}') => {
                self.emit(out, &name, &c[at..=i]);
                return Ok(i + 1);
            }
            None => return Err(self.error("bad substitution: missing }")),
            _ => {}
        }
        let colon = c[i] == ':';
        if colon {
            i += 1;
        }
        let op = match c.get(i) {
            Some(&op @ ('-' | '+')) => op,
            other => {
                let op: String = other.map(|o| o.to_string()).unwrap_or_default();
                let op = if colon { format!(":{op}") } else { op };
                return Err(self.error(format!(
                    "unsupported substitution modifier {op:?} in ${{{name}...}} (:-, -, :+, +)"
                )));
            }
        };
        let (word, end) = self.word(c, i + 1, false, Some('}'))?;
        if c.get(end) != Some(&'}') {
            return Err(self.error("bad substitution: missing }"));
        }
        let value = match self.lookup.lookup(&name) {
            Var::Keep => {
                // Left as written, for the environment to expand.
                out.extend(&c[at..=end]);
                return Ok(end + 1);
            }
            Var::Value(v) => Some(v),
            Var::Unset => None,
        };
        let test = if colon {
            value.as_ref().is_some_and(|v| !v.is_empty())
        } else {
            value.is_some()
        };
        match (op, test) {
            ('-', true) | ('+', false) => {
                for ch in value.filter(|_| op == '-').unwrap_or_default().chars() {
                    self.push_literal(out, ch);
                }
            }
            // The word was processed already (written in the output's
            // syntax).
            _ => out.push_str(&word),
        }
        Ok(end + 1)
    }

    /// Variable `name` (written as `raw`) into `out`.
    fn emit(&self, out: &mut String, name: &str, raw: &[char]) {
        match self.lookup.lookup(name) {
            Var::Value(v) => v.chars().for_each(|ch| self.push_literal(out, ch)),
            Var::Keep => out.extend(raw),
            Var::Unset => {}
        }
    }
}

/// `text` split at unquoted whitespace, each word as written (quotes and
/// escapes kept): for `key=value` pairs, whose two sides are processed
/// apart.
pub(crate) fn raw_words(text: &str, escape: char) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut quote: Option<char> = None;
    let mut chars = text.chars();
    while let Some(ch) = chars.next() {
        match (quote, ch) {
            (None, c) if c.is_whitespace() => {
                if !word.is_empty() {
                    words.push(std::mem::take(&mut word));
                }
                continue;
            }
            (_, c) if c == escape && quote != Some('\'') => {
                word.push(c);
                if let Some(next) = chars.next() {
                    word.push(next);
                }
                continue;
            }
            (None, '\'' | '"') => quote = Some(ch),
            (Some(q), c) if c == q => quote = None,
            _ => {}
        }
        word.push(ch);
    }
    if !word.is_empty() {
        words.push(word);
    }
    words
}
