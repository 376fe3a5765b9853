//! Cache-aware placement (issue 29): a create ([`crate::replica::place`])
//! and a wake on another pod (`moved.rs`'s `move_target`) prefer the pod
//! that holds the most bytes of the layers they need, then the one with
//! the most admission headroom.
//!
//! Each pod's heartbeat lists, for each of its templates' layers and its
//! hibernated sandboxes' that is stored in the object store, the layer's
//! manifest, whose it is (a template's id and name, a sandbox's id), its
//! bytes and how many of them the pod holds: all of a layer whose files
//! are whole on its disk, else those its chunk cache has
//! (`torpor_scheduler::service::held`; at most 256 layers, the most held
//! first). The replica writes them to the pod's row (`pods.layers`,
//! schema version 14, `layers.rs`) and scores each pod up by the bytes it
//! holds of the needed layers: a create's, its template's layers as that
//! pod lists it; a wake's, its template's layer and its own snapshot's.
//! The pods within an eighth of the best score ([`CLOSE`]) rank first, by
//! headroom (a move: those listing the template first, as before); a
//! create then picks at random among the first `PLACEMENT_CHOICES` of
//! them. A pod that reports no layers (no object store, an older build)
//! scores 0, so with no figures anywhere placement is what it was: by
//! headroom.

use std::collections::HashSet;

use torpor_scheduler::model::Sandbox;
#[cfg(test)]
use torpor_scheduler::model::TemplateId;
use torpor_scheduler::service::held::LayerHeld;

use super::db::PodRow;

/// Scores within this fraction of the best tie (1/8: a few chunks more of
/// a large layer do not outweigh headroom).
pub const CLOSE: (u64, u64) = (1, 8);

/// The bytes and the bytes held of the layers `pod` reports that
/// `needed` picks, each layer once; none if it reports none of them.
fn held_of(pod: &PodRow, needed: impl Fn(&LayerHeld) -> bool) -> Option<(u64, u64)> {
    let mut seen = HashSet::new();
    pod.layers
        .iter()
        .filter(|l| needed(l) && seen.insert(l.layer.as_str()))
        .map(|l| (l.bytes, l.held.min(l.bytes)))
        .reduce(|a, b| (a.0 + b.0, a.1 + b.1))
}

/// Whether `l` is a layer of template `key` (its id or name).
fn of_template(l: &LayerHeld, key: &str) -> bool {
    l.of == key || l.name.as_deref() == Some(key)
}

/// The bytes of template `key`'s layers, the most any of `pods` reports:
/// what a pod that lists the template but reports none of its layers
/// (not stored from that pod yet) is taken to hold, its files being whole
/// on its disk as those of every template a pod lists are.
pub fn template_bytes<'a>(pods: impl IntoIterator<Item = &'a PodRow>, key: &str) -> u64 {
    pods.into_iter()
        .filter_map(|p| held_of(p, |l| of_template(l, key)))
        .map(|(bytes, _)| bytes)
        .max()
        .unwrap_or(0)
}

/// The bytes `pod` holds of template `key`'s layers (by id or name, as
/// that pod lists it): what a create from it there need not fetch;
/// `whole` ([`template_bytes`]) when it lists the template but reports
/// none of its layers.
pub fn template_held(pod: &PodRow, key: &str, whole: u64) -> u64 {
    match held_of(pod, |l| of_template(l, key)) {
        Some((_, held)) => held,
        None if pod.templates.iter().any(|t| t == key) => whole,
        None => 0,
    }
}

/// The bytes `pod` holds of what a wake of `sandbox` on it needs: its own
/// snapshot's layer, and its template's (`template_layer`, the manifest
/// the template is stored as, or the layer of the template by its id as
/// that pod lists it; `whole`, [`template_bytes`], when it lists the
/// template but reports none of its layers).
pub fn sandbox_held(
    pod: &PodRow,
    sandbox: &Sandbox,
    template_layer: Option<&str>,
    whole: u64,
) -> u64 {
    let own = sandbox.stored_snapshot.as_deref();
    let key = sandbox.template.as_str();
    let templates = |l: &LayerHeld| Some(l.layer.as_str()) == template_layer || of_template(l, key);
    let reported = held_of(pod, |l| Some(l.layer.as_str()) == own || templates(l));
    let listed = pod.templates.iter().any(|t| t == key);
    let unreported = if listed && !pod.layers.iter().any(templates) {
        whole
    } else {
        0
    };
    reported.map_or(0, |h| h.1) + unreported
}

/// Whether `score` ties with `best` ([`CLOSE`]).
fn close(score: u64, best: u64) -> bool {
    let (n, d) = CLOSE;
    u128::from(score) * u128::from(d) >= u128::from(best) * u128::from(d - n)
}

/// `pods` best first, and how many rank first: those whose `held` is
/// within [`CLOSE`] of the most, by `prefer` then headroom; then the
/// others by `held`, `prefer`, headroom.
pub fn ranked<'a>(
    pods: impl IntoIterator<Item = &'a PodRow>,
    held: impl Fn(&PodRow) -> u64,
    prefer: impl Fn(&PodRow) -> bool,
) -> (Vec<&'a PodRow>, usize) {
    let scored: Vec<(&PodRow, u64, bool)> =
        pods.into_iter().map(|p| (p, held(p), prefer(p))).collect();
    let best = scored.iter().map(|s| s.1).max().unwrap_or(0);
    let mut keyed: Vec<(bool, u64, bool, &PodRow)> = scored
        .into_iter()
        .map(|(p, h, pref)| {
            let top = close(h, best);
            (top, if top { 0 } else { h }, pref, p)
        })
        .collect();
    keyed.sort_by(|a, b| {
        b.0.cmp(&a.0)
            .then(b.1.cmp(&a.1))
            .then(b.2.cmp(&a.2))
            .then(b.3.headroom_mib.total_cmp(&a.3.headroom_mib))
    });
    let top = keyed.iter().filter(|k| k.0).count();
    (keyed.into_iter().map(|k| k.3).collect(), top)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_pods::{holding, pod};

    #[test]
    fn bytes_held_rank_first_then_headroom() {
        const MIB: u64 = 1 << 20;
        let pods = [
            holding(
                pod("full", 100.0, 0.1, &["t"]),
                "m1",
                "t",
                100 * MIB,
                100 * MIB,
            ),
            holding(
                pod("near", 50.0, 0.1, &["t"]),
                "m1",
                "t",
                100 * MIB,
                90 * MIB,
            ),
            holding(
                pod("some", 900.0, 0.1, &["t"]),
                "m1",
                "t",
                100 * MIB,
                40 * MIB,
            ),
            pod("none", 4000.0, 0.1, &["t"]),
        ];
        let whole = template_bytes(&pods, "t");
        assert_eq!(whole, 100 * MIB);
        let (order, top) = ranked(&pods, |p| template_held(p, "t", whole), |_| false);
        let ids: Vec<&str> = order.iter().map(|p| p.id.as_str()).collect();
        // 90 of 100 MiB ties with 100 (within an eighth): by headroom.
        // `none` lists the template but reports no layer of it (not stored
        // from there yet): whole on its disk, it ties too.
        assert_eq!(ids, ["none", "full", "near", "some"]);
        assert_eq!(top, 3);
        // Nothing held anywhere: all tie, by headroom.
        let bare = [pod("a", 10.0, 0.1, &[]), pod("b", 20.0, 0.1, &[])];
        let whole = template_bytes(&bare, "t");
        let (order, top) = ranked(&bare, |p| template_held(p, "t", whole), |_| false);
        assert_eq!((order[0].id.as_str(), top), ("b", 2));
    }

    #[test]
    fn a_layer_counts_once_and_never_past_its_bytes() {
        let p = holding(pod("p", 1.0, 0.1, &["t"]), "m1", "t", 10, 10);
        let p = holding(p, "m1", "t", 10, 10);
        let p = holding(p, "m2", "sbx_1", 5, 9);
        assert_eq!(template_held(&p, "t", 99), 10);
        let mut s = Sandbox::new(TemplateId::new("t"), 64, 1, 1000);
        s.stored_snapshot = Some("m2".into());
        assert_eq!(sandbox_held(&p, &s, Some("m1"), 99), 15);
        s.stored_snapshot = None;
        assert_eq!(sandbox_held(&p, &s, None, 99), 10);
        // A pod listing the template, none of its layers reported: whole.
        let bare = pod("q", 1.0, 0.1, &["t"]);
        assert_eq!(template_held(&bare, "t", 99), 99);
        assert_eq!(sandbox_held(&bare, &s, Some("m1"), 99), 99);
        assert_eq!(template_held(&pod("r", 1.0, 0.1, &[]), "t", 99), 0);
    }
}
