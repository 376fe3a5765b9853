//! The CLI's output shared by its commands (`torpor sandbox`, `template`,
//! `pod`, `token`, `image`, `checkpoint`, `plan`): JSON re-indented,
//! tables, `key: value` fields, times relative to now. Below every
//! command module.

use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::Value;

/// Re-indents compact JSON text (two spaces), keeping its field order.
pub fn pretty(raw: &str) -> String {
    let (mut out, mut depth, mut in_str, mut esc) = (String::new(), 0usize, false, false);
    let newline = |out: &mut String, depth: usize| {
        out.push('\n');
        out.push_str(&"  ".repeat(depth));
    };
    let mut chars = raw.trim().chars().peekable();
    while let Some(ch) = chars.next() {
        if in_str {
            out.push(ch);
            if esc {
                esc = false;
            } else if ch == '\\' {
                esc = true;
            } else if ch == '"' {
                in_str = false;
            }
            continue;
        }
        match ch {
            '"' => {
                in_str = true;
                out.push(ch);
            }
            '{' | '[' => {
                out.push(ch);
                while chars.next_if(|c| c.is_whitespace()).is_some() {}
                if let Some(close) = chars.next_if(|c| matches!(c, '}' | ']')) {
                    out.push(close);
                } else {
                    depth += 1;
                    newline(&mut out, depth);
                }
            }
            '}' | ']' => {
                depth = depth.saturating_sub(1);
                newline(&mut out, depth);
                out.push(ch);
            }
            ',' => {
                out.push(ch);
                newline(&mut out, depth);
            }
            ':' => out.push_str(": "),
            c if c.is_whitespace() => {}
            c => out.push(c),
        }
    }
    out
}

/// Rows under a header, columns padded to align (two spaces between), no
/// borders, no wrapping (output stays greppable when piped).
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    use comfy_table::{presets::NOTHING, ContentArrangement, Table};
    let mut t = Table::new();
    t.load_style(NOTHING)
        .set_content_arrangement(ContentArrangement::Disabled)
        .set_header(header.iter().copied())
        .add_rows(rows.iter().cloned());
    let last = header.len().saturating_sub(1);
    for (i, column) in t.column_iter_mut().enumerate() {
        column.set_padding((0, if i == last { 0 } else { 2 }));
    }
    t.lines().map(|l| l.trim_end().to_string() + "\n").collect()
}

/// `key: value` lines, values aligned.
pub fn fields(pairs: &[(&str, String)]) -> String {
    let w = pairs.iter().map(|(k, _)| k.len() + 1).max().unwrap_or(0);
    pairs
        .iter()
        .map(|(k, v)| format!("{:<w$} {v}\n", format!("{k}:")))
        .collect()
}

/// A JSON field as display text: strings bare, null as `-`.
pub fn text(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn since(v: &Value) -> Option<i64> {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64);
    v.as_i64().map(|then| (now - then) / 1000)
}

fn span(s: i64) -> String {
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m", s / 60),
        3600..=86399 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86400),
    }
}

/// Time since a millisecond Unix timestamp, short (`42s`, `5m`, `3h`, `2d`).
pub fn age(v: &Value) -> String {
    since(v).map_or_else(|| "-".into(), |s| span(s.max(0)))
}

/// A millisecond Unix timestamp relative to now (`5m ago`, `in 2h`).
pub fn when(v: &Value) -> String {
    match since(v) {
        None => "-".into(),
        Some(s) if s < 0 => format!("in {}", span(-s)),
        Some(s) => format!("{} ago", span(s)),
    }
}

/// A `{k: v}` object as `k=v,k=v` (`-` when empty).
pub fn pairs(v: &Value) -> String {
    match v.as_object() {
        Some(m) if !m.is_empty() => m
            .iter()
            .map(|(k, v)| format!("{k}={}", text(v)))
            .collect::<Vec<_>>()
            .join(","),
        _ => "-".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tables_align() {
        let rows = [vec!["a".into(), "running".into(), "1".into()]];
        let t = table(&["ID", "STATE", "X"], &rows);
        assert_eq!(t, "ID  STATE    X\na   running  1\n");
        let f = fields(&[("id", "a".into()), ("state", "b".into())]);
        assert_eq!(f, "id:    a\nstate: b\n");
        assert_eq!(pairs(&json!({"k": "v", "n": 1})), "k=v,n=1");
        assert_eq!(when(&json!(null)), "-");
        assert_eq!(span(61), "1m");
        let raw = r#"{"z":[],"a":{"s":"x,\\\"{:"},"l":[1, 2]}"#;
        let text = pretty(raw);
        let want = r#"{
  "z": [],
  "a": {
    "s": "x,\\\"{:"
  },
  "l": [
    1,
    2
  ]
}"#;
        assert_eq!(text, want);
        let back: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(back, serde_json::from_str::<Value>(raw).unwrap());
    }
}
