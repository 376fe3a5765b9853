//! The layers a pod's heartbeats list and how much of each it holds
//! (`torpor_scheduler::service::held`), as a pod's row keeps them
//! (`pods.layers`) for placement (`placement.rs`).

use serde_json::Value;
use torpor_scheduler::service::held::LayerHeld;

/// Schema version 14: each pod's layers as its last heartbeat listed them.
pub(super) const LAYERS_COLUMN: &str =
    "ALTER TABLE pods ADD COLUMN layers jsonb NOT NULL DEFAULT '[]'::jsonb";

/// A heartbeat's layers as the row keeps them.
pub(super) fn layers_json(layers: &[LayerHeld]) -> Value {
    serde_json::to_value(layers).unwrap_or_else(|_| Value::Array(Vec::new()))
}

/// A row's layers (none if they do not read: placement then goes by
/// headroom).
pub(super) fn layers_of(v: Value) -> Vec<LayerHeld> {
    serde_json::from_value(v).unwrap_or_default()
}
