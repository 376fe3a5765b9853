//! torpor-agent: the in-guest agent of torpor, and the protocol the host
//! speaks to it (see `PROTOCOL.md` next to this crate).
//!
//! The agent listens on AF_VSOCK (port [`DEFAULT_VSOCK_PORT`]) or, for tests
//! on the host, a unix socket. Frames are a `u32` big-endian length and JSON
//! ([`frame`]); messages are [`proto::Request`] and [`proto::Reply`]. The
//! host side uses [`AgentClient`]; the agent side is [`Agent`].
//!
//! std + serde only, no async runtime: the binary is linked statically and
//! runs as the first service of the guest.

pub mod announce;
pub mod b64;
pub mod client;
pub mod exec;
pub mod files;
pub mod frame;
pub mod portfwd;
pub mod procs;
pub mod proto;
pub mod proto_procs;
pub mod proto_stat;
pub mod resumed;
pub mod server;
pub mod sink;
pub mod standin;
pub mod system;
pub mod users;
pub mod volumes;
pub mod vsock;
pub mod watch;
pub mod xattrs;

pub use client::{AgentClient, AttachEvent, ClientError, ExecOutput, OutputKind};
pub use frame::{FrameError, MAX_FRAME};
pub use proto::{AGENT_VERSION, PROTOCOL_VERSION};
pub use server::{Agent, AgentConfig, ListenAddr, Listener, DEFAULT_VSOCK_PORT};
pub use system::{FakeCall, FakeOps, IdentityPage, RealOps, SystemOps};
