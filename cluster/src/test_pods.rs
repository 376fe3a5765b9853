//! Pod rows for the placement tests (`replica.rs`, `moved.rs`,
//! `placement.rs`, `templates.rs`): one home, which no module's code
//! imports, so the tests add no edge between those modules.

use torpor_scheduler::service::held::LayerHeld;

use crate::db::PodRow;
use torpor_scheduler::model::PodId;

/// A pod's row: `headroom` MiB, silent for `silent` s, listing
/// `templates`.
pub(crate) fn pod(id: &str, headroom: f64, silent: f64, templates: &[&str]) -> PodRow {
    PodRow {
        id: PodId::new(id),
        address: "tcp:127.0.0.1:1".into(),
        token: "t".into(),
        fingerprint: None,
        load: serde_json::Value::Null,
        templates: templates.iter().map(|t| t.to_string()).collect(),
        headroom_mib: headroom,
        layers: Vec::new(),
        running: 0,
        hibernated: 0,
        silent_s: silent,
        images: Vec::new(),
    }
}

/// `p` holding `held` of `bytes` of layer `layer`, `of` whose it is.
pub(crate) fn holding(mut p: PodRow, layer: &str, of: &str, bytes: u64, held: u64) -> PodRow {
    p.layers.push(LayerHeld {
        layer: layer.into(),
        of: of.into(),
        name: None,
        bytes,
        held,
    });
    p
}
