//! envd's protobuf messages in Connect's JSON form (proto3 JSON mapping:
//! lowerCamelCase names, the proto names accepted too; bytes as base64;
//! enums by name, numbers accepted; `int64` as a string; timestamps as
//! RFC 3339), for `process.Process` and `filesystem.Filesystem` of E2B's
//! envd (the SDKs' `process.proto` and `filesystem.proto`). Unknown fields
//! are ignored, as proto3 JSON parsers may.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize};
use torpor_agent::b64;

/// `bytes` fields.
mod bytes {
    use super::*;
    pub fn serialize<S: serde::Serializer>(data: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&b64::encode(data))
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(d)?;
        // proto3 JSON allows URL-safe and unpadded base64 too.
        let std = text.replace('-', "+").replace('_', "/");
        let padded = match std.len() % 4 {
            2 => format!("{std}=="),
            3 => format!("{std}="),
            _ => std,
        };
        b64::decode(&padded).map_err(serde::de::Error::custom)
    }
    pub mod option {
        use super::*;
        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u8>>, D::Error> {
            super::deserialize(d).map(Some)
        }
    }
}

/// An enum value: its name or its number.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum EnumValue {
    Name(String),
    Number(i64),
}

// ---- process.proto ----

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ProcessConfig {
    pub cmd: String,
    pub args: Vec<String>,
    pub envs: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct PtySize {
    pub cols: u32,
    pub rows: u32,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct Pty {
    pub size: Option<PtySize>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct StartRequest {
    pub process: Option<ProcessConfig>,
    pub pty: Option<Pty>,
    pub tag: Option<String>,
    pub stdin: Option<bool>,
}

/// `ProcessSelector`: a oneof of `pid` and `tag`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct ProcessSelector {
    pub pid: Option<u32>,
    pub tag: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct SelectRequest {
    pub process: Option<ProcessSelector>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct ProcessInput {
    #[serde(with = "bytes::option")]
    pub stdin: Option<Vec<u8>>,
    #[serde(with = "bytes::option")]
    pub pty: Option<Vec<u8>>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct SendInputRequest {
    pub process: Option<ProcessSelector>,
    pub input: Option<ProcessInput>,
}

/// `StreamInputRequest`: a oneof of `start`, `data` and `keepalive`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct StreamInputRequest {
    pub start: Option<SelectRequest>,
    pub data: Option<InputData>,
    pub keepalive: Option<Empty>,
}

/// `StreamInputRequest.DataEvent`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct InputData {
    pub input: Option<ProcessInput>,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct SendSignalRequest {
    #[serde(default)]
    pub process: Option<ProcessSelector>,
    #[serde(default)]
    pub signal: Option<EnumValue>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct UpdateRequest {
    pub process: Option<ProcessSelector>,
    pub pty: Option<Pty>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ProcessInfo {
    pub config: ProcessConfig,
    pub pid: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ListResponse {
    pub processes: Vec<ProcessInfo>,
}

/// `ProcessEvent.DataEvent`: one of `stdout`, `stderr`, `pty`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Data {
    Stdout(#[serde(with = "bytes")] Vec<u8>),
    Stderr(#[serde(with = "bytes")] Vec<u8>),
    Pty(#[serde(with = "bytes")] Vec<u8>),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EndEvent {
    pub exit_code: i32,
    pub exited: bool,
    pub status: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StartEvent {
    pub pid: u32,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Empty {}

/// `ProcessEvent`: a oneof.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum ProcessEvent {
    Start(StartEvent),
    Data(Data),
    End(EndEvent),
    Keepalive(Empty),
}

/// `StartResponse` and `ConnectResponse`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EventResponse {
    pub event: ProcessEvent,
}

// ---- filesystem.proto ----

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct PathRequest {
    pub path: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct ListDirRequest {
    pub path: String,
    pub depth: u32,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct MoveRequest {
    pub source: String,
    pub destination: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct WatchRequest {
    pub path: String,
    pub recursive: bool,
    #[serde(alias = "include_entry")]
    pub include_entry: bool,
    #[serde(alias = "allow_network_mounts")]
    pub allow_network_mounts: bool,
}

impl WatchRequest {
    /// The agent's `watch_add` of it, for the resolved `path`.
    pub fn to_agent(&self, path: String) -> torpor_agent::proto::WatchAddRequest {
        torpor_agent::proto::WatchAddRequest {
            path,
            recursive: self.recursive,
            include_entry: self.include_entry,
            allow_network_mounts: self.allow_network_mounts,
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct WatcherRequest {
    #[serde(alias = "watcher_id")]
    pub watcher_id: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EntryInfo {
    pub name: String,
    /// `FILE_TYPE_FILE`, `FILE_TYPE_DIRECTORY`, `FILE_TYPE_SYMLINK` or
    /// `FILE_TYPE_UNSPECIFIED` (devices, FIFOs, sockets).
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub path: String,
    /// `int64`: a string in proto3 JSON.
    pub size: String,
    pub mode: u32,
    pub permissions: String,
    pub owner: String,
    pub group: String,
    pub modified_time: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub symlink_target: Option<String>,
    pub metadata: BTreeMap<String, String>,
    pub is_symlink: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EntryResponse {
    pub entry: EntryInfo,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ListDirResponse {
    pub entries: Vec<EntryInfo>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FilesystemEvent {
    pub name: String,
    /// `EVENT_TYPE_CREATE`, `_WRITE`, `_REMOVE`, `_RENAME`, `_CHMOD`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub entry: Option<EntryInfo>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CreateWatcherResponse {
    pub watcher_id: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WatcherEventsResponse {
    pub events: Vec<FilesystemEvent>,
}

/// `WatchDir`'s oneof `event`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum WatchEvent {
    Start(Empty),
    Filesystem(Box<FilesystemEvent>),
    Keepalive(Empty),
}

/// `WatchDirResponse`: its oneof `event` is the message's own, so proto3
/// JSON has its member at the top (`{"start": {}}`), unlike the process
/// responses, whose `event` is a message holding a oneof.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WatchDirResponse {
    #[serde(flatten)]
    pub event: WatchEvent,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn requests_parse_in_both_spellings() {
        let s: StartRequest = serde_json::from_value(json!({
            "process": {"cmd": "/bin/bash", "args": ["-l", "-c", "echo hi"], "envs": {"A": "1"}},
            "pty": {"size": {"cols": 80, "rows": 24}}, "stdin": false, "unknown": 1
        }))
        .unwrap();
        let p = s.process.unwrap();
        assert_eq!(
            (p.cmd.as_str(), p.args.len(), p.cwd),
            ("/bin/bash", 3, None)
        );
        assert_eq!(s.pty.unwrap().size, Some(PtySize { cols: 80, rows: 24 }));
        let w: WatchRequest =
            serde_json::from_value(json!({"path": "/x", "include_entry": true})).unwrap();
        assert!(w.include_entry);
        let w: WatcherRequest = serde_json::from_value(json!({"watcherId": "7"})).unwrap();
        assert_eq!(w.watcher_id, "7");
        let i: SendInputRequest =
            serde_json::from_value(json!({"process": {"pid": 3}, "input": {"stdin": "aGk"}}))
                .unwrap();
        assert_eq!(i.input.unwrap().stdin.as_deref(), Some(&b"hi"[..]));
        let sig: SendSignalRequest =
            serde_json::from_value(json!({"process": {"tag": "t"}, "signal": "SIGNAL_SIGKILL"}))
                .unwrap();
        assert_eq!(sig.signal, Some(EnumValue::Name("SIGNAL_SIGKILL".into())));
        assert!(serde_json::from_value::<StartRequest>(json!({"process": {"args": 3}})).is_err());
    }

    #[test]
    fn events_have_protobufs_json_shape() {
        let data = EventResponse {
            event: ProcessEvent::Data(Data::Stdout(b"hi\n".to_vec())),
        };
        assert_eq!(
            serde_json::to_value(&data).unwrap(),
            json!({"event": {"data": {"stdout": "aGkK"}}})
        );
        let end = EventResponse {
            event: ProcessEvent::End(EndEvent {
                exit_code: 3,
                exited: true,
                status: "exit status 3".into(),
                error: None,
            }),
        };
        assert_eq!(
            serde_json::to_value(&end).unwrap(),
            json!({"event": {"end": {"exitCode": 3, "exited": true, "status": "exit status 3"}}})
        );
        let ka = WatchDirResponse {
            event: WatchEvent::Keepalive(Empty {}),
        };
        assert_eq!(serde_json::to_value(&ka).unwrap(), json!({"keepalive": {}}));
    }
}
