//! Layer cache keys: each step's layer is named by a hex SHA-256 over its
//! parent's key, the step's canonical JSON (without `force`) and its input
//! content's hash (a COPY's `files_hash`), so a layer is reused exactly
//! when everything before it and the step itself are the same. ENV,
//! WORKDIR and USER steps are layers too: they change what later steps
//! mean. The last layer is the started template: the start command, its
//! ready check and the sandbox's shape (vCPUs, memory).
//!
//! The chain begins at the caller's key for the source
//! ([`source_key`]), which holds what identifies the source's content
//! (the image's digest, the template's build, the upload's hash) and
//! never a credential: a registry's username and password are left out
//! of every key, and no step can hold one.
//!
//! Whether a layer may come from the cache is data ([`LayerKey::cacheable`]):
//! none with `skip_cache`; none from the first step with `force` on (E2B's
//! template manager forces every step after a forced one). A forced layer
//! keeps its key: it is built anew and replaces the cached one.

use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::spec::{BuildSpec, Source, Step};

/// Hashed into every key: a change of the key's layout changes them all.
pub const KEY_VERSION: &str = "torpor-build/layer/v1";

/// Which layer a key names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "type", content = "index", rename_all = "snake_case")]
pub enum Layer {
    /// The step at this index of `spec.steps`.
    Step(usize),
    /// The started template, after the last step.
    Start,
}

/// One layer's cache key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LayerKey {
    /// Which layer.
    pub layer: Layer,
    /// Lowercase hex SHA-256.
    pub key: String,
    /// Whether a cached layer under `key` may be used.
    pub cacheable: bool,
}

/// The keys of a spec's layers: one per step, in order, then
/// [`Layer::Start`]. `source_key` names the first layer ([`source_key`]).
pub fn layer_keys(spec: &BuildSpec, source_key: &str) -> Vec<LayerKey> {
    let mut keys = Vec::with_capacity(spec.steps.len() + 1);
    let mut parent = source_key.to_string();
    let mut cacheable = !spec.skip_cache;
    for (index, step) in spec.steps.iter().enumerate() {
        cacheable &= !step.force();
        let input = match step {
            Step::Copy { files_hash, .. } => files_hash.as_str(),
            _ => "",
        };
        let key = hash(&["step", &parent, &canonical_step(step), input]);
        keys.push(LayerKey {
            layer: Layer::Step(index),
            key: key.clone(),
            cacheable,
        });
        parent = key;
    }
    let start = serde_json::json!({
        "start": spec.start,
        "cpu_count": spec.cpu_count,
        "memory_mib": spec.memory_mib,
    });
    keys.push(LayerKey {
        layer: Layer::Start,
        key: hash(&["start", &parent, &canonical(&start)]),
        cacheable,
    });
    keys
}

/// The key of a build's first layer: the source as the spec names it,
/// without credentials, and `resolved`, what identifies its content and
/// its preparation (an image's manifest digest, a template's build id, an
/// upload's hash; with the executor's provisioning version).
pub fn source_key(source: &Source, resolved: &str) -> String {
    let named = match source {
        Source::Template { name } => serde_json::json!({"type": "template", "name": name}),
        Source::Image { reference, .. } => {
            serde_json::json!({"type": "image", "reference": reference})
        }
        Source::Upload { hash } => serde_json::json!({"type": "upload", "hash": hash}),
    };
    hash(&["source", &canonical(&named), resolved])
}

/// A step's JSON without its `force` ([`canonical`]; absent optional
/// fields left out): what its key hashes.
pub fn canonical_step(step: &Step) -> String {
    let mut value = serde_json::to_value(step).unwrap_or_default();
    if let Some(object) = value.as_object_mut() {
        object.remove("force");
    }
    canonical(&value)
}

/// `value` as compact JSON with every object's keys sorted, whatever
/// order serde_json's map keeps (its `preserve_order` feature may be on
/// in another crate of a build).
pub fn canonical(value: &serde_json::Value) -> String {
    use serde_json::Value;
    match value {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            let fields: Vec<String> = keys
                .into_iter()
                .map(|k| format!("{}:{}", Value::String(k.clone()), canonical(&map[k])))
                .collect();
            format!("{{{}}}", fields.join(","))
        }
        Value::Array(items) => {
            let items: Vec<String> = items.iter().map(canonical).collect();
            format!("[{}]", items.join(","))
        }
        other => other.to_string(),
    }
}

/// SHA-256 over [`KEY_VERSION`] and `parts`, each length-prefixed (so no
/// two lists of parts hash the same bytes).
fn hash(parts: &[&str]) -> String {
    let mut h = Sha256::new();
    for part in std::iter::once(KEY_VERSION).chain(parts.iter().copied()) {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    hex(&h.finalize())
}

/// Lowercase hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}
