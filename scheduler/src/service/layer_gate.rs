//! The gate on what a VMM reports about snapshot layers. A VMM writes each
//! layer's `lineage.json` (the chain it sits on), and a VMM is hostile: a
//! compromised one can name any directory there. The service mounts every
//! layer of a chain into the next VMM's jail, sealed (root's, 0755/0644:
//! at the start inside the sandbox's own directory, when it became shared
//! outside it), so an unchecked chain would hand one sandbox another's
//! files. A chain is used only once every layer in it is either
//!
//! - a directory directly inside the owner's own directory (a sandbox's
//!   `sandboxes/<id>/`, a template's `templates/<id>/`), or
//! - a layer the store already knows for the owner: the snapshots it names
//!   (the sandbox's own, its checkpoints', its template's) and every
//!   recorded layer under them (a fork's source's checkpoint, the source's
//!   older layers, the template's snapshot). A recorded layer must sit on
//!   its recorded parent.
//!
//! and every layer is a plain absolute path under the data directory (no
//! `.` or `..`, nothing to canonicalise) whose directories below the data
//! directory are real directories, not symbolic links. Anything else fails
//! the operation with `bad_snapshot` naming the layer.

use std::collections::{HashMap, HashSet};
use std::path::{Component, Path, PathBuf};

use torpor_vmm_api::{ErrorKind, VmError};

use super::layers::LayerChain;
use super::ServiceError;
use crate::store::KnownLayer;

/// Where an owner's layers may be.
#[derive(Debug)]
pub(super) struct Scope {
    /// The (canonical) data directory: every layer is under it.
    pub data_dir: PathBuf,
    /// The owner's own directory: layers directly in it are its own.
    pub own_dir: PathBuf,
    /// What the store knows for the owner: dir → recorded parent (None: a
    /// root the store names but has not recorded).
    pub known: HashMap<PathBuf, Option<Option<PathBuf>>>,
}

impl Scope {
    pub fn new(data_dir: &Path, own_dir: &Path, known: Vec<KnownLayer>) -> Self {
        Self {
            data_dir: data_dir.to_path_buf(),
            own_dir: own_dir.to_path_buf(),
            known: known.into_iter().map(|k| (k.dir, k.parent)).collect(),
        }
    }
}

/// A layer the gate refuses, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("layer {} is refused: {reason}", layer.display())]
pub(super) struct Refused {
    pub layer: PathBuf,
    pub reason: String,
}

impl Refused {
    fn new(layer: &Path, reason: impl Into<String>) -> Self {
        Self {
            layer: layer.to_path_buf(),
            reason: reason.into(),
        }
    }

    /// As the service reports it: `bad_snapshot`, naming the layer.
    pub fn into_error(self, top: &Path) -> ServiceError {
        let layer = self.layer.clone();
        ServiceError::Vm(
            VmError::new(
                ErrorKind::BadSnapshot,
                format!("snapshot {}: {self}", top.display()),
            )
            .with_layer(layer),
        )
    }
}

/// Whether `path` is absolute and written plainly: only normal components
/// after the root, no `.`, `..`, doubled or trailing separators.
fn plain(path: &Path) -> bool {
    let mut parts = path.components();
    if parts.next() != Some(Component::RootDir) {
        return false;
    }
    parts.all(|c| matches!(c, Component::Normal(_)))
        && path.components().collect::<PathBuf>().as_os_str() == path.as_os_str()
}

/// `dir` is a real directory under the data directory, and so is every
/// directory between the two (none a symbolic link: the service would
/// follow it elsewhere).
pub(super) fn real_dir(data_dir: &Path, dir: &Path) -> Result<(), Refused> {
    if !plain(dir) || !dir.starts_with(data_dir) || dir == data_dir {
        return Err(Refused::new(
            dir,
            format!("not a plain path under {}", data_dir.display()),
        ));
    }
    for step in dir.ancestors().take_while(|a| *a != data_dir) {
        let meta = std::fs::symlink_metadata(step)
            .map_err(|e| Refused::new(dir, format!("{}: {e}", step.display())))?;
        if meta.file_type().is_symlink() {
            return Err(Refused::new(
                dir,
                format!("{} is a symbolic link", step.display()),
            ));
        }
        if !meta.is_dir() {
            return Err(Refused::new(
                dir,
                format!("{} is not a directory", step.display()),
            ));
        }
    }
    Ok(())
}

/// Checks the chain `layers` (base first) a VMM reported for the layer
/// `top` against `scope`; the chain as the store records it (each layer
/// with its parent) when every layer passes.
pub(super) fn check_chain(
    top: &Path,
    layers: &[PathBuf],
    scope: &Scope,
) -> Result<LayerChain, Refused> {
    if layers.last().map(PathBuf::as_path) != Some(top) {
        return Err(Refused::new(top, "the chain does not end in it"));
    }
    let mut seen = HashSet::new();
    let mut chain = LayerChain::with_capacity(layers.len());
    for (i, layer) in layers.iter().enumerate() {
        let parent = i.checked_sub(1).map(|p| layers[p].clone());
        if !seen.insert(layer) {
            return Err(Refused::new(layer, "listed twice"));
        }
        real_dir(&scope.data_dir, layer)?;
        let own = layer.parent() == Some(scope.own_dir.as_path());
        match scope.known.get(layer) {
            Some(Some(recorded)) if *recorded != parent => {
                return Err(Refused::new(
                    layer,
                    format!(
                        "recorded on {}, not on {}",
                        shown(recorded.as_deref()),
                        shown(parent.as_deref())
                    ),
                ));
            }
            Some(_) => {}
            None if own => {}
            None => {
                return Err(Refused::new(
                    layer,
                    format!(
                        "neither in {} nor a layer the store knows for it",
                        scope.own_dir.display()
                    ),
                ));
            }
        }
        chain.push((layer.clone(), parent));
    }
    Ok(chain)
}

fn shown(p: Option<&Path>) -> String {
    p.map_or_else(|| "nothing".into(), |p| p.display().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// data/sandboxes/{mine,victim}/…, data/templates/t/snapshot.
    struct Fixture {
        _scratch: tempfile::TempDir,
        data: PathBuf,
    }

    impl Fixture {
        fn new() -> Self {
            let scratch = tempfile::tempdir().unwrap();
            let data = std::fs::canonicalize(scratch.path()).unwrap();
            for d in [
                "sandboxes/mine/snap-1",
                "sandboxes/mine/snap-2",
                "sandboxes/victim/snap-1",
                "sandboxes/source/ckpt-a",
                "templates/t/snapshot",
            ] {
                std::fs::create_dir_all(data.join(d)).unwrap();
            }
            Self {
                _scratch: scratch,
                data,
            }
        }

        fn p(&self, rel: &str) -> PathBuf {
            self.data.join(rel)
        }

        /// `mine`, which the store knows to sit on the template (recorded)
        /// through the source's checkpoint (recorded on the template).
        fn scope(&self) -> Scope {
            let known = vec![
                KnownLayer {
                    dir: self.p("templates/t/snapshot"),
                    parent: Some(None),
                },
                KnownLayer {
                    dir: self.p("sandboxes/source/ckpt-a"),
                    parent: Some(Some(self.p("templates/t/snapshot"))),
                },
            ];
            Scope::new(&self.data, &self.p("sandboxes/mine"), known)
        }

        fn check(&self, layers: &[&str]) -> Result<LayerChain, Refused> {
            let layers: Vec<PathBuf> = layers.iter().map(|l| self.p(l)).collect();
            check_chain(layers.last().unwrap(), &layers, &self.scope())
        }
    }

    #[test]
    fn own_and_known_layers_pass() {
        let f = Fixture::new();
        let chain = f
            .check(&[
                "templates/t/snapshot",
                "sandboxes/source/ckpt-a",
                "sandboxes/mine/snap-1",
                "sandboxes/mine/snap-2",
            ])
            .unwrap();
        assert_eq!(chain.len(), 4);
        assert_eq!(chain[0], (f.p("templates/t/snapshot"), None));
        assert_eq!(
            chain[3],
            (
                f.p("sandboxes/mine/snap-2"),
                Some(f.p("sandboxes/mine/snap-1"))
            )
        );
        // A full snapshot of its own.
        f.check(&["sandboxes/mine/snap-1"]).unwrap();
    }

    #[test]
    fn another_sandboxs_layer_is_refused() {
        let f = Fixture::new();
        let e = f
            .check(&["sandboxes/victim/snap-1", "sandboxes/mine/snap-1"])
            .unwrap_err();
        assert_eq!(e.layer, f.p("sandboxes/victim/snap-1"));
        assert!(e.reason.contains("neither"), "{e}");
        // Or a directory of its own elsewhere, or the data directory.
        let e = f
            .check(&["sandboxes/victim", "sandboxes/mine/snap-1"])
            .unwrap_err();
        assert_eq!(e.layer, f.p("sandboxes/victim"));
        let e = f.check(&["", "sandboxes/mine/snap-1"]).unwrap_err();
        assert!(e.reason.contains("plain"), "{e}");
    }

    #[test]
    fn dot_dot_and_unplain_paths_are_refused() {
        let f = Fixture::new();
        for bad in [
            "sandboxes/mine/../victim/snap-1",
            "sandboxes/mine/./snap-1",
            "sandboxes//mine/snap-1",
            "sandboxes/mine/snap-1/",
        ] {
            let layers = vec![
                PathBuf::from(format!("{}/{bad}", f.data.display())),
                f.p("sandboxes/mine/snap-2"),
            ];
            let e = check_chain(&layers[1], &layers, &f.scope()).unwrap_err();
            assert_eq!(e.layer, layers[0], "{bad}");
            assert!(e.reason.contains("plain"), "{bad}: {e}");
        }
        let layers = vec![PathBuf::from("/etc"), f.p("sandboxes/mine/snap-1")];
        assert!(check_chain(&layers[1], &layers, &f.scope()).is_err());
        let layers = vec![PathBuf::from("relative"), f.p("sandboxes/mine/snap-1")];
        assert!(check_chain(&layers[1], &layers, &f.scope()).is_err());
    }

    #[test]
    fn symlinks_are_refused() {
        let f = Fixture::new();
        // A layer of its own that is a link to another sandbox's.
        std::os::unix::fs::symlink(f.p("sandboxes/victim/snap-1"), f.p("sandboxes/mine/link"))
            .unwrap();
        let e = f
            .check(&["sandboxes/mine/link", "sandboxes/mine/snap-1"])
            .unwrap_err();
        assert!(e.reason.contains("symbolic link"), "{e}");
        // A link on the way to a layer.
        std::os::unix::fs::symlink(f.p("sandboxes/victim"), f.p("sandboxes/mine/sub")).unwrap();
        let e = f
            .check(&["sandboxes/mine/sub/snap-1", "sandboxes/mine/snap-1"])
            .unwrap_err();
        assert!(e.reason.contains("symbolic link"), "{e}");
        // A known layer replaced by a link.
        std::fs::remove_dir(f.p("sandboxes/source/ckpt-a")).unwrap();
        std::os::unix::fs::symlink(
            f.p("sandboxes/victim/snap-1"),
            f.p("sandboxes/source/ckpt-a"),
        )
        .unwrap();
        let e = f
            .check(&[
                "templates/t/snapshot",
                "sandboxes/source/ckpt-a",
                "sandboxes/mine/snap-1",
            ])
            .unwrap_err();
        assert_eq!(e.layer, f.p("sandboxes/source/ckpt-a"));
        // A file where a layer should be.
        std::fs::write(f.p("sandboxes/mine/file"), b"").unwrap();
        assert!(f.check(&["sandboxes/mine/file"]).is_err());
        // A layer that is not there.
        assert!(f.check(&["sandboxes/mine/gone"]).is_err());
    }

    #[test]
    fn known_layers_keep_their_recorded_parents() {
        let f = Fixture::new();
        // The source's checkpoint is recorded on the template: not a base.
        let e = f
            .check(&["sandboxes/source/ckpt-a", "sandboxes/mine/snap-1"])
            .unwrap_err();
        assert!(e.reason.contains("recorded on"), "{e}");
        let e = f
            .check(&[
                "sandboxes/mine/snap-1",
                "templates/t/snapshot",
                "sandboxes/mine/snap-2",
            ])
            .unwrap_err();
        assert_eq!(e.layer, f.p("templates/t/snapshot"));
    }

    #[test]
    fn the_chain_ends_in_its_top_once() {
        let f = Fixture::new();
        let layers = vec![f.p("sandboxes/mine/snap-1")];
        let e = check_chain(&f.p("sandboxes/mine/snap-2"), &layers, &f.scope()).unwrap_err();
        assert!(e.reason.contains("does not end"), "{e}");
        let e = f
            .check(&[
                "sandboxes/mine/snap-1",
                "sandboxes/mine/snap-1",
                "sandboxes/mine/snap-2",
            ])
            .unwrap_err();
        assert!(e.reason.contains("twice"), "{e}");
        let e = check_chain(&f.p("x"), &[], &f.scope()).unwrap_err();
        assert!(e.reason.contains("does not end"), "{e}");
    }

    #[test]
    fn refusals_are_bad_snapshots_naming_the_layer() {
        let f = Fixture::new();
        let e = f
            .check(&["sandboxes/victim/snap-1", "sandboxes/mine/snap-1"])
            .unwrap_err()
            .into_error(&f.p("sandboxes/mine/snap-1"));
        let ServiceError::Vm(vm) = &e else {
            panic!("{e:?}")
        };
        assert_eq!(vm.kind, ErrorKind::BadSnapshot);
        assert_eq!(
            vm.layer.as_deref(),
            Some(f.p("sandboxes/victim/snap-1").as_path())
        );
        assert!(e.to_string().contains("sandboxes/victim/snap-1"), "{e}");
    }
}
