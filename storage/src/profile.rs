//! An S3 store's settings from the AWS shared files, for what the
//! environment leaves unset (the order AWS's own tools read them in):
//!
//! | setting | variable | file, key |
//! |---|---|---|
//! | access key id | `AWS_ACCESS_KEY_ID` | credentials, `aws_access_key_id` |
//! | secret key | `AWS_SECRET_ACCESS_KEY` | credentials, `aws_secret_access_key` |
//! | session token | `AWS_SESSION_TOKEN` | credentials, `aws_session_token` |
//! | region | `AWS_REGION`, `AWS_DEFAULT_REGION` | config, `region` |
//! | endpoint | `AWS_ENDPOINT_URL` | config, `endpoint_url` |
//!
//! The credentials file is `AWS_SHARED_CREDENTIALS_FILE` (else
//! `~/.aws/credentials`), its section the profile's name; the config file
//! `AWS_CONFIG_FILE` (else `~/.aws/config`), its section `[profile NAME]`
//! (`[default]` for the default). The profile is `AWS_PROFILE`, else
//! `default`. A file named by its variable must be readable, and a
//! profile named by `AWS_PROFILE` must be in one of the files; the
//! default files may be absent.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::error::ConfigError;

/// The variables a profile's files answer for, with their file and key.
const FROM_FILES: &[(&str, File, &str)] = &[
    ("AWS_ACCESS_KEY_ID", File::Credentials, "aws_access_key_id"),
    (
        "AWS_SECRET_ACCESS_KEY",
        File::Credentials,
        "aws_secret_access_key",
    ),
    ("AWS_SESSION_TOKEN", File::Credentials, "aws_session_token"),
    ("AWS_REGION", File::Config, "region"),
    ("AWS_ENDPOINT_URL", File::Config, "endpoint_url"),
];

#[derive(Clone, Copy)]
enum File {
    Credentials,
    Config,
}

/// One profile's settings from the shared files.
#[derive(Debug, Default)]
pub(crate) struct Profile {
    credentials: HashMap<String, String>,
    config: HashMap<String, String>,
}

impl Profile {
    /// The profile the environment `env` names, read from its files.
    pub(crate) fn load(env: &impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let named = env("AWS_PROFILE");
        let name = named.clone().unwrap_or_else(|| "default".into());
        let home = env("HOME").map(PathBuf::from);
        let file = |var: &str, default: &str| match env(var) {
            Some(p) => Some((PathBuf::from(p), true)),
            None => home.as_ref().map(|h| (h.join(".aws").join(default), false)),
        };
        let section = if name == "default" {
            name.clone()
        } else {
            format!("profile {name}")
        };
        let credentials = match file("AWS_SHARED_CREDENTIALS_FILE", "credentials") {
            Some((path, required)) => read_section(&path, required, &name)?,
            None => None,
        };
        let config = match file("AWS_CONFIG_FILE", "config") {
            Some((path, required)) => read_section(&path, required, &section)?,
            None => None,
        };
        if named.is_some() && credentials.is_none() && config.is_none() {
            return Err(ConfigError::MissingProfile { profile: name });
        }
        Ok(Self {
            credentials: credentials.unwrap_or_default(),
            config: config.unwrap_or_default(),
        })
    }

    /// What the files give for variable `var`, if they answer for it.
    pub(crate) fn get(&self, var: &str) -> Option<String> {
        let (_, file, key) = FROM_FILES.iter().find(|(v, ..)| *v == var)?;
        let map = match file {
            File::Credentials => &self.credentials,
            File::Config => &self.config,
        };
        map.get(*key).filter(|v| !v.is_empty()).cloned()
    }
}

/// Section `name` of INI file `path` (`key = value` lines, `#` and `;`
/// comments), or None when it has none; a missing file is an error only
/// when `required`.
fn read_section(
    path: &Path,
    required: bool,
    name: &str,
) -> Result<Option<HashMap<String, String>>, ConfigError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if !required && e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(ConfigError::ProfileFile {
                path: path.to_path_buf(),
                why: e.to_string(),
            })
        }
    };
    let mut found = None;
    let mut inside = false;
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with(['#', ';']) {
            continue;
        }
        if let Some(header) = line.strip_prefix('[') {
            let Some(header) = header.strip_suffix(']') else {
                return Err(ConfigError::ProfileFile {
                    path: path.to_path_buf(),
                    why: format!("line {}: a section header without its ]", n + 1),
                });
            };
            inside = header.trim() == name;
            if inside {
                found.get_or_insert_with(HashMap::new);
            }
            continue;
        }
        let Some((key, value)) = line.split_once('=') else {
            return Err(ConfigError::ProfileFile {
                path: path.to_path_buf(),
                why: format!("line {}: neither a [section] nor key = value", n + 1),
            });
        };
        if let (true, Some(map)) = (inside, found.as_mut()) {
            map.insert(key.trim().to_string(), value.trim().to_string());
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, String)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone())
    }

    #[test]
    fn profiles_read_from_both_files() {
        let dir = tempfile::tempdir().unwrap();
        let aws = dir.path().join(".aws");
        std::fs::create_dir(&aws).unwrap();
        std::fs::write(
            aws.join("credentials"),
            "# keys\n[default]\naws_access_key_id = AK\naws_secret_access_key=SK\n\n\
             [other]\naws_access_key_id = AK2\naws_secret_access_key = SK2\naws_session_token = T\n",
        )
        .unwrap();
        std::fs::write(
            aws.join("config"),
            "[default]\nregion = eu-west-1\n; a comment\n[profile other]\nregion = r2\n\
             endpoint_url = http://127.0.0.1:8333\n",
        )
        .unwrap();
        let home = dir.path().display().to_string();
        let vars = [("HOME", home.clone())];
        let p = Profile::load(&env(&vars)).unwrap();
        assert_eq!(p.get("AWS_ACCESS_KEY_ID").as_deref(), Some("AK"));
        assert_eq!(p.get("AWS_SECRET_ACCESS_KEY").as_deref(), Some("SK"));
        assert_eq!(p.get("AWS_REGION").as_deref(), Some("eu-west-1"));
        assert_eq!(p.get("AWS_SESSION_TOKEN"), None);
        assert_eq!(p.get("AWS_ENDPOINT_URL"), None);
        assert_eq!(
            p.get("HOME"),
            None,
            "only the variables the files answer for"
        );

        let vars = [("HOME", home.clone()), ("AWS_PROFILE", "other".into())];
        let p = Profile::load(&env(&vars)).unwrap();
        assert_eq!(p.get("AWS_ACCESS_KEY_ID").as_deref(), Some("AK2"));
        assert_eq!(p.get("AWS_SESSION_TOKEN").as_deref(), Some("T"));
        assert_eq!(p.get("AWS_REGION").as_deref(), Some("r2"));
        assert_eq!(
            p.get("AWS_ENDPOINT_URL").as_deref(),
            Some("http://127.0.0.1:8333")
        );

        let vars = [("HOME", home), ("AWS_PROFILE", "nope".into())];
        let e = Profile::load(&env(&vars)).unwrap_err();
        assert!(e.to_string().contains("nope"), "{e}");
    }

    #[test]
    fn missing_default_files_are_nothing_but_named_ones_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let vars = [("HOME", dir.path().display().to_string())];
        let p = Profile::load(&env(&vars)).unwrap();
        assert_eq!(p.get("AWS_ACCESS_KEY_ID"), None);
        let missing = dir.path().join("creds").display().to_string();
        let vars = [("AWS_SHARED_CREDENTIALS_FILE", missing.clone())];
        let e = Profile::load(&env(&vars)).unwrap_err();
        assert!(e.to_string().contains(&missing), "{e}");
        let bad = dir.path().join("bad");
        std::fs::write(&bad, "[default\nx = 1\n").unwrap();
        let vars = [("AWS_CONFIG_FILE", bad.display().to_string())];
        let e = Profile::load(&env(&vars)).unwrap_err();
        assert!(e.to_string().contains("line 1"), "{e}");
    }
}
