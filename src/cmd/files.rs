//! `torpor vmm files`: copy files into and out of a Linux guest, list and
//! stat guest paths, through torpor-agent over the VM's hybrid vsock socket.
//! Files move in chunks of at most [`MAX_IO_CHUNK`] bytes, so neither side
//! holds more than one chunk of a large file.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use torpor_agent::proto::{ErrorReply, FileKind, FileStat, WriteFileRequest, MAX_IO_CHUNK};
use torpor_agent::{AgentClient, ClientError};

use super::EXIT_FAILURE;
use crate::cli::{GuestFilesAction, GuestFilesArgs};

/// Why a `torpor vmm files` command failed.
#[derive(Debug, thiserror::Error)]
enum FilesError {
    #[error("{0}")]
    Unreachable(String),
    #[error("cannot read {}: {source}", path.display())]
    LocalRead { path: PathBuf, source: io::Error },
    #[error("{} is not a regular file", path.display())]
    NotAFile { path: PathBuf },
    #[error("cannot write {}: {source}", path.display())]
    LocalWrite { path: PathBuf, source: io::Error },
    #[error("bad --mode {0:?}: give permission bits in octal, e.g. 644")]
    BadMode(String),
    /// The agent refused: its errno name and message, passed through.
    #[error("{op} {path}: agent error {source}")]
    Agent {
        op: &'static str,
        path: String,
        source: ErrorReply,
    },
    #[error("{op} {path}: {source}")]
    Client {
        op: &'static str,
        path: String,
        source: ClientError,
    },
    #[error("put {path}: the guest file has {got} bytes, {sent} were sent")]
    SizeMismatch { path: String, sent: u64, got: u64 },
}

impl FilesError {
    fn from_client(op: &'static str, path: &str, e: ClientError) -> FilesError {
        let path = path.to_string();
        match e {
            ClientError::Agent(source) => FilesError::Agent { op, path, source },
            source => FilesError::Client { op, path, source },
        }
    }
}

type Agent = AgentClient<UnixStream>;

pub fn run(args: GuestFilesArgs) -> i32 {
    match files(args) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("torpor: error: {e}");
            EXIT_FAILURE
        }
    }
}

fn files(args: GuestFilesArgs) -> Result<(), FilesError> {
    let a = &args.agent;
    let connect =
        || super::guest::agent(&a.vsock_uds, a.port, a.wait_ms).map_err(FilesError::Unreachable);
    match args.action {
        GuestFilesAction::Put {
            local,
            guest_path,
            mode,
            parents,
        } => {
            // Local mistakes are reported without waiting for the agent.
            let mode = mode.as_deref().map(parse_mode).transpose()?;
            let file = open_local(&local)?;
            let upload = Upload {
                local: &local,
                guest_path: &guest_path,
                mode,
                create_parents: parents,
            };
            put(&mut connect()?, file, upload)
        }
        GuestFilesAction::Get { guest_path, local } => {
            get(&mut connect()?, &guest_path, local.as_deref())
        }
        GuestFilesAction::Ls { guest_dir } => ls(&mut connect()?, &guest_dir),
        GuestFilesAction::Stat { guest_path } => stat(&mut connect()?, &guest_path),
    }
}

fn parse_mode(text: &str) -> Result<u32, FilesError> {
    match u32::from_str_radix(text, 8) {
        Ok(mode) if mode <= 0o7777 => Ok(mode),
        _ => Err(FilesError::BadMode(text.to_string())),
    }
}

/// Reads until `buf` is full or the file ends; returns how much was read.
fn fill(file: &mut File, buf: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match file.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

fn open_local(local: &Path) -> Result<File, FilesError> {
    let local_err = |source| FilesError::LocalRead {
        path: local.to_path_buf(),
        source,
    };
    let file = File::open(local).map_err(local_err)?;
    if !file.metadata().map_err(local_err)?.is_file() {
        return Err(FilesError::NotAFile {
            path: local.to_path_buf(),
        });
    }
    Ok(file)
}

/// What `put` copies where.
struct Upload<'a> {
    local: &'a Path,
    guest_path: &'a str,
    mode: Option<u32>,
    create_parents: bool,
}

fn put(client: &mut Agent, mut file: File, up: Upload) -> Result<(), FilesError> {
    let guest_path = up.guest_path;
    let local_err = |source| FilesError::LocalRead {
        path: up.local.to_path_buf(),
        source,
    };
    let mut buf = vec![0u8; MAX_IO_CHUNK];
    let (mut sent, mut size, mut first) = (0u64, 0u64, true);
    loop {
        let n = fill(&mut file, &mut buf).map_err(local_err)?;
        // The first request truncates (an empty file is one empty write).
        if n > 0 || first {
            let req = WriteFileRequest {
                path: guest_path.to_string(),
                data: buf[..n].to_vec(),
                mode: up.mode,
                create_parents: up.create_parents,
                append: !first,
                owner: None,
            };
            size = client
                .write_file(req)
                .map_err(|e| FilesError::from_client("put", guest_path, e))?
                .size;
            sent += n as u64;
            first = false;
        }
        if n < buf.len() {
            break;
        }
    }
    if size != sent {
        return Err(FilesError::SizeMismatch {
            path: guest_path.to_string(),
            sent,
            got: size,
        });
    }
    println!("{guest_path}: {size} bytes");
    Ok(())
}

/// Where `get` writes: stdout, or a local file created once the guest file
/// proved readable (so a failed get leaves no empty file behind).
enum Sink<'a> {
    Stdout(io::StdoutLock<'static>),
    File { path: &'a Path, file: Option<File> },
}

impl Sink<'_> {
    fn write(&mut self, data: &[u8]) -> Result<(), FilesError> {
        match self {
            Sink::Stdout(out) => out
                .write_all(data)
                .map_err(|source| FilesError::LocalWrite {
                    path: PathBuf::from("-"),
                    source,
                }),
            Sink::File { path, file } => {
                let err = |source| FilesError::LocalWrite {
                    path: path.to_path_buf(),
                    source,
                };
                if file.is_none() {
                    *file = Some(File::create(path).map_err(err)?);
                }
                file.as_mut()
                    .map_or(Ok(()), |f| f.write_all(data).map_err(err))
            }
        }
    }

    fn finish(&mut self) -> Result<(), FilesError> {
        match self {
            Sink::Stdout(out) => out.flush().map_err(|source| FilesError::LocalWrite {
                path: PathBuf::from("-"),
                source,
            }),
            Sink::File { path, file } => file.as_mut().map_or(Ok(()), |f| {
                f.sync_all().map_err(|source| FilesError::LocalWrite {
                    path: path.to_path_buf(),
                    source,
                })
            }),
        }
    }
}

fn get(client: &mut Agent, guest_path: &str, local: Option<&Path>) -> Result<(), FilesError> {
    let mut sink = match local {
        None => Sink::Stdout(io::stdout().lock()),
        Some(p) if p == Path::new("-") => Sink::Stdout(io::stdout().lock()),
        Some(path) => Sink::File { path, file: None },
    };
    let mut copy = || {
        let mut offset = 0u64;
        loop {
            let chunk = client
                .read_file(guest_path, offset, None)
                .map_err(|e| FilesError::from_client("get", guest_path, e))?;
            // An empty file still makes an (empty) local file.
            sink.write(&chunk.data)?;
            offset += chunk.data.len() as u64;
            if chunk.eof || chunk.data.is_empty() {
                return sink.finish();
            }
        }
    };
    let result = copy();
    if let (
        Err(_),
        Sink::File {
            path,
            file: Some(_),
        },
    ) = (&result, &sink)
    {
        // No half-copied file is left looking like a whole one.
        let _ = std::fs::remove_file(path);
    }
    result
}

fn kind_name(kind: FileKind) -> &'static str {
    match kind {
        FileKind::File => "file",
        FileKind::Dir => "dir",
        FileKind::Symlink => "symlink",
        FileKind::Other => "other",
    }
}

/// One `ls` line: kind, octal mode, size, name (and a symlink's target).
fn ls_line(entry: &FileStat) -> String {
    let mut line = format!(
        "{:<7} {:04o} {:>12} {}",
        kind_name(entry.kind),
        entry.mode,
        entry.size,
        entry.name
    );
    if let Some(target) = &entry.link_target {
        line.push_str(" -> ");
        line.push_str(target);
    }
    line
}

fn ls(client: &mut Agent, guest_dir: &str) -> Result<(), FilesError> {
    let listing = client
        .list_dir(guest_dir)
        .map_err(|e| FilesError::from_client("ls", guest_dir, e))?;
    let mut out = io::stdout().lock();
    for entry in &listing.entries {
        let _ = writeln!(out, "{}", ls_line(entry));
    }
    if listing.truncated {
        eprintln!(
            "torpor: {guest_dir} has more entries than one listing carries; {} shown",
            listing.entries.len()
        );
    }
    Ok(())
}

fn stat(client: &mut Agent, guest_path: &str) -> Result<(), FilesError> {
    let st = client
        .stat(guest_path, false)
        .map_err(|e| FilesError::from_client("stat", guest_path, e))?;
    println!("{}", serde_json::to_string(&st).unwrap_or_default());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_are_octal_permission_bits() {
        assert_eq!(parse_mode("644").unwrap(), 0o644);
        assert_eq!(parse_mode("4755").unwrap(), 0o4755);
        assert!(parse_mode("888").is_err());
        assert!(parse_mode("17777").is_err());
    }

    #[test]
    fn ls_lines_show_kind_mode_size_name() {
        let entry = FileStat {
            name: "l".into(),
            kind: FileKind::Symlink,
            size: 3,
            mode: 0o777,
            mtime_ns: 0,
            link_target: Some("/x".into()),
            uid: None,
            gid: None,
            owner: None,
            group: None,
            st_mode: None,
            resolved: None,
            metadata: Default::default(),
        };
        assert_eq!(ls_line(&entry), "symlink 0777            3 l -> /x");
    }
}
