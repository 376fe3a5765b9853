//! Ready checks: when a template's start command counts as started (the
//! moment its running sandbox is snapshotted). Each is a shell command run
//! repeatedly in the guest until it exits 0 ([`ReadyCheck::command`]);
//! [`ReadyCheck::from_e2b`] reads E2B's `readyCmd` back into a check,
//! recognising the commands of the SDKs' helpers (`wait_for_port`,
//! `wait_for_url`, `wait_for_file`, `wait_for_process`,
//! `wait_for_timeout`).
//!
//! The guest is Debian minbase with bash, python3, procps and iproute2, and
//! no curl: a port is checked with `ss` (as E2B does), a URL with python3
//! (E2B uses curl), a process with `pgrep`.

use serde::{Deserialize, Serialize};

use crate::shell::{quote, unquote};

/// The HTTP status a [`ReadyCheck::Url`] waits for when none is given
/// (E2B's `wait_for_url` default).
pub const DEFAULT_URL_STATUS: u16 = 200;

/// When the started template is ready to be snapshotted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ReadyCheck {
    /// A TCP or UDP socket listens on this local port.
    Port {
        /// 1..=65535.
        port: u16,
    },
    /// A GET of this `http://` or `https://` URL answers this status
    /// (redirects are not followed, as `curl -s` does not).
    Url {
        /// The URL, from inside the guest (`http://localhost:3000/health`).
        url: String,
        /// The status to wait for; [`DEFAULT_URL_STATUS`] when absent.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        status: Option<u16>,
    },
    /// A regular file exists at this absolute path.
    File {
        /// Absolute path in the guest.
        path: String,
    },
    /// A process whose name matches (`pgrep NAME`) runs.
    Process {
        /// A `pgrep` pattern.
        name: String,
    },
    /// This shell command exits 0.
    Command {
        /// Run by `/bin/bash -l -c` as the start command's user.
        cmd: String,
    },
    /// This long after the start command started.
    Delay {
        /// Milliseconds.
        ms: u64,
    },
}

impl ReadyCheck {
    /// The shell command that exits 0 once ready: run by `bash -l -c` in
    /// the guest, as the start command's user, in its directory and with
    /// its environment, again and again (E2B: every 2 s, for at most 10
    /// min) until it succeeds.
    pub fn command(&self) -> String {
        match self {
            // ss exits 0 whatever it finds: ready when it prints a socket.
            // `sport = :N` matches the port exactly (80 is not 8080).
            ReadyCheck::Port { port } => format!("[ -n \"$(ss -Htuln sport = :{port})\" ]"),
            ReadyCheck::Url { url, status } => format!(
                "python3 -c {} {} {}",
                quote(URL_CHECK),
                quote(url),
                status.unwrap_or(DEFAULT_URL_STATUS)
            ),
            ReadyCheck::File { path } => format!("[ -f {} ]", quote(path)),
            ReadyCheck::Process { name } => format!("pgrep {} > /dev/null", quote(name)),
            ReadyCheck::Command { cmd } => cmd.clone(),
            ReadyCheck::Delay { ms } => {
                if ms % 1000 == 0 {
                    format!("sleep {}", ms / 1000)
                } else {
                    let frac = format!("{:03}", ms % 1000);
                    format!("sleep {}.{}", ms / 1000, frac.trim_end_matches('0'))
                }
            }
        }
    }

    /// E2B's `readyCmd` as a check: the commands the SDKs' helpers write
    /// become the typed checks they mean (so `wait_for_url`, which needs
    /// curl, runs with python3 here); any other command is
    /// [`ReadyCheck::Command`], verbatim.
    pub fn from_e2b(cmd: &str) -> ReadyCheck {
        recognise(cmd).unwrap_or_else(|| ReadyCheck::Command {
            cmd: cmd.to_string(),
        })
    }
}

/// The python3 program of [`ReadyCheck::Url`]: `argv[1]` the URL,
/// `argv[2]` the status; exits 0 when a GET answers that status (3xx not
/// followed), 1 otherwise (any error, a timeout of 5 s).
const URL_CHECK: &str = "import sys,urllib.request as r,urllib.error as e
class N(r.HTTPRedirectHandler):
 def redirect_request(*a):return None
try:c=r.build_opener(N).open(sys.argv[1],timeout=5).status
except e.HTTPError as x:c=x.code
except Exception:sys.exit(1)
sys.exit(c!=int(sys.argv[2]))";

/// The check an E2B SDK helper's command means, if `cmd` is one.
fn recognise(cmd: &str) -> Option<ReadyCheck> {
    // wait_for_port: `[ -n "$(ss -Htuln sport = :PORT)" ]`
    if let Some(port) = cmd
        .strip_prefix("[ -n \"$(ss -Htuln sport = :")
        .and_then(|r| r.strip_suffix(")\" ]"))
    {
        return digits(port)?
            .parse()
            .ok()
            .map(|port| ReadyCheck::Port { port });
    }
    // wait_for_url: `curl -s -o /dev/null -w "%{http_code}" URL | grep -q "STATUS"`
    if let Some(rest) = cmd.strip_prefix("curl -s -o /dev/null -w \"%{http_code}\" ") {
        let (url, status) = rest.rsplit_once(" | grep -q \"")?;
        let status: u16 = digits(status.strip_suffix('"')?)?.parse().ok()?;
        if !(100..=599).contains(&status) {
            return None;
        }
        return Some(ReadyCheck::Url {
            url: unquote(url)?,
            status: Some(status),
        });
    }
    // wait_for_file: `[ -f PATH ]`
    if let Some(path) = cmd.strip_prefix("[ -f ").and_then(|r| r.strip_suffix(" ]")) {
        return Some(ReadyCheck::File {
            path: unquote(path)?,
        });
    }
    // wait_for_process: `pgrep NAME > /dev/null`
    if let Some(name) = cmd
        .strip_prefix("pgrep ")
        .and_then(|r| r.strip_suffix(" > /dev/null"))
    {
        return Some(ReadyCheck::Process {
            name: unquote(name)?,
        });
    }
    // wait_for_timeout: `sleep SECONDS`
    if let Some(secs) = cmd.strip_prefix("sleep ") {
        let secs: u64 = digits(secs)?.parse().ok()?;
        return Some(ReadyCheck::Delay {
            ms: secs.checked_mul(1000)?,
        });
    }
    None
}

/// `s` when it is a run of ASCII digits (no sign, no spaces), short
/// enough to parse.
fn digits(s: &str) -> Option<&str> {
    (!s.is_empty() && s.len() <= 9 && s.bytes().all(|b| b.is_ascii_digit())).then_some(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_match_e2b_helpers_where_the_guest_has_the_tool() {
        // e2b/template/readycmd.py, 2.63.0, byte for byte.
        assert_eq!(
            ReadyCheck::Port { port: 8000 }.command(),
            r#"[ -n "$(ss -Htuln sport = :8000)" ]"#
        );
        assert_eq!(
            ReadyCheck::File {
                path: "/tmp/ready".into()
            }
            .command(),
            "[ -f /tmp/ready ]"
        );
        assert_eq!(
            ReadyCheck::Process {
                name: "my daemon".into()
            }
            .command(),
            "pgrep 'my daemon' > /dev/null"
        );
        assert_eq!(ReadyCheck::Delay { ms: 5000 }.command(), "sleep 5");
        assert_eq!(ReadyCheck::Delay { ms: 2500 }.command(), "sleep 2.5");
        assert_eq!(ReadyCheck::Delay { ms: 20 }.command(), "sleep 0.02");
        assert_eq!(
            ReadyCheck::Command {
                cmd: "test -S /run/x.sock".into()
            }
            .command(),
            "test -S /run/x.sock"
        );
    }

    #[test]
    fn url_check_uses_python_not_curl() {
        let cmd = ReadyCheck::Url {
            url: "http://localhost:3000/health".into(),
            status: None,
        }
        .command();
        assert!(
            cmd.starts_with("python3 -c 'import sys,urllib.request"),
            "{cmd}"
        );
        assert!(cmd.ends_with("' http://localhost:3000/health 200"), "{cmd}");
        assert!(!cmd.contains("curl"));
        let cmd = ReadyCheck::Url {
            url: "http://localhost/a b".into(),
            status: Some(204),
        }
        .command();
        assert!(cmd.ends_with(" 'http://localhost/a b' 204"), "{cmd}");
    }

    #[test]
    fn e2b_helper_commands_are_recognised() {
        let cases = [
            (
                r#"[ -n "$(ss -Htuln sport = :8000)" ]"#,
                ReadyCheck::Port { port: 8000 },
            ),
            (
                r#"curl -s -o /dev/null -w "%{http_code}" http://localhost:3000/health | grep -q "204""#,
                ReadyCheck::Url {
                    url: "http://localhost:3000/health".into(),
                    status: Some(204),
                },
            ),
            (
                r#"curl -s -o /dev/null -w "%{http_code}" 'http://h/?a=1&b=2' | grep -q "200""#,
                ReadyCheck::Url {
                    url: "http://h/?a=1&b=2".into(),
                    status: Some(200),
                },
            ),
            (
                "[ -f /devcontainer.up ]",
                ReadyCheck::File {
                    path: "/devcontainer.up".into(),
                },
            ),
            (
                "pgrep nginx > /dev/null",
                ReadyCheck::Process {
                    name: "nginx".into(),
                },
            ),
            ("sleep 20", ReadyCheck::Delay { ms: 20_000 }),
        ];
        for (cmd, check) in cases {
            assert_eq!(ReadyCheck::from_e2b(cmd), check, "{cmd}");
        }
    }

    #[test]
    fn other_commands_stay_commands() {
        for cmd in [
            "curl http://localhost:8000/health",
            r#"[ -n "$(ss -Htuln sport = :99999999999)" ]"#,
            "sleep 1.5",
            "sleep 5 && true",
            "[ -f a b ]",
            "pgrep -f x > /dev/null",
            "",
        ] {
            assert_eq!(
                ReadyCheck::from_e2b(cmd),
                ReadyCheck::Command { cmd: cmd.into() },
                "{cmd:?}"
            );
        }
    }

    #[test]
    fn typed_checks_round_trip_through_their_commands() {
        for check in [
            ReadyCheck::Port { port: 80 },
            ReadyCheck::File {
                path: "/tmp/it's ready".into(),
            },
            ReadyCheck::Process {
                name: "node".into(),
            },
            ReadyCheck::Delay { ms: 3000 },
        ] {
            assert_eq!(ReadyCheck::from_e2b(&check.command()), check);
        }
    }
}
