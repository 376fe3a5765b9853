//! The error codes: the `code` of every error body a surface answers
//! (`{"error": {"code", ...}}`) and of an operation's failure
//! ([`crate::OpError`]), one kind each.

pub const INVALID_REQUEST: &str = "invalid_request";
pub const UNAUTHORIZED: &str = "unauthorized";
pub const NOT_FOUND: &str = "not_found";
pub const METHOD_NOT_ALLOWED: &str = "method_not_allowed";
pub const CONFLICT: &str = "conflict";
pub const UNSUPPORTED: &str = "unsupported";
pub const PAYLOAD_TOO_LARGE: &str = "payload_too_large";
pub const UNSUPPORTED_MEDIA_TYPE: &str = "unsupported_media_type";
pub const ADMISSION_REFUSED: &str = "admission_refused";
pub const INTERNAL: &str = "internal";
pub const NOT_IMPLEMENTED: &str = "not_implemented";
pub const TIMEOUT: &str = "timeout";
pub const FORBIDDEN: &str = "forbidden";
pub const NO_AGENT: &str = "no_agent";
pub const AGENT_ERROR: &str = "agent_error";
/// A remote pod did not answer (its sandboxes cannot be reached).
pub const POD_UNREACHABLE: &str = "pod_unreachable";
/// Something coming is not there yet (the nested pod's template).
pub const UNAVAILABLE: &str = "unavailable";
/// The pod's disk (or quota) is full: a snapshot could not be written.
pub const INSUFFICIENT_STORAGE: &str = "insufficient_storage";
/// A snapshot layer is corrupt or unreadable; the message names it.
pub const BAD_SNAPSHOT: &str = "bad_snapshot";
/// The sandbox's VM has ended (it failed or was stopped underneath us).
pub const VM_GONE: &str = "vm_gone";
/// A tenant's quota is used up (the body's `quota` names which).
pub const QUOTA_EXCEEDED: &str = "quota_exceeded";
/// Too many requests from one token (`Retry-After` says when to retry).
pub const RATE_LIMITED: &str = "rate_limited";
/// This host cannot do it (a Linux template without hardware
/// virtualization): a valid request another host could serve.
pub const HOST_UNSUPPORTED: &str = "host_unsupported";
/// The sandbox's memory was kept while its guest agent did not answer:
/// only a wake by a reboot (`mode: reboot`) brings it back.
pub const GUEST_UNRESPONSIVE: &str = "guest_unresponsive";
/// A template build's body has the schema's shape but a value the build
/// cannot use (the message names the field and step).
pub const INVALID_SPEC: &str = "invalid_spec";

/// Every code (the OpenAPI document lists the same).
pub const ALL: &[&str] = &[
    INVALID_REQUEST,
    UNAUTHORIZED,
    NOT_FOUND,
    METHOD_NOT_ALLOWED,
    CONFLICT,
    UNSUPPORTED,
    PAYLOAD_TOO_LARGE,
    UNSUPPORTED_MEDIA_TYPE,
    ADMISSION_REFUSED,
    INTERNAL,
    NOT_IMPLEMENTED,
    TIMEOUT,
    FORBIDDEN,
    NO_AGENT,
    AGENT_ERROR,
    POD_UNREACHABLE,
    UNAVAILABLE,
    INSUFFICIENT_STORAGE,
    BAD_SNAPSHOT,
    VM_GONE,
    QUOTA_EXCEEDED,
    RATE_LIMITED,
    HOST_UNSUPPORTED,
    GUEST_UNRESPONSIVE,
    INVALID_SPEC,
];
