//! An image from an archive a client uploads ([`from_archive`]): an OCI
//! image layout as a tar (`index.json`, `blobs/sha256/...`; what
//! `skopeo copy ... oci-archive:` and `docker save` since Docker 25
//! write) or the older `docker save` form (`manifest.json`, a config
//! `<hex>.json`, `<id>/layer.tar`), either one plain or gzip-compressed.
//!
//! The archive is read twice and never unpacked as such: the first pass
//! keeps its small files (the JSON documents) in memory, up to a bound; the
//! image is resolved from them; the second pass copies only the layer
//! files the image names into the blob directory, each one checked
//! against its digest (an OCI layout's) or named by it (`docker save`'s).

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::path::{Component, Path};

use serde::Deserialize;

use crate::error::{Error, Result};
use crate::image::{self, Descriptor, Document, Image, ImageConfig, Layer, MAX_DOCUMENT};
use crate::store::{BlobStore, Digest};

/// The small files of an archive kept in memory, all together.
const MAX_SMALL_TOTAL: u64 = 64 << 20;

/// A `docker save` manifest.json entry.
#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct SaveEntry {
    config: String,
    layers: Vec<String>,
}

/// Reads the image in the archive at `path` (OCI layout or `docker
/// save`, plain or gzip) into `blob_dir`. An index with several images
/// gives its linux/amd64 one; a `docker save` of several images, its
/// first.
pub fn from_archive(path: &Path, blob_dir: &Path) -> Result<Image> {
    let store = BlobStore::open(blob_dir)?;
    let what = path.display().to_string();
    let small = read_small_files(path)?;
    let (manifest_digest, config_bytes, layers, wanted) =
        if let Some(index) = small.get("index.json") {
            from_layout(&what, index, &small)?
        } else if let Some(manifest) = small.get("manifest.json") {
            from_save(&what, manifest, &small)?
        } else {
            return Err(Error::malformed(
                &what,
                "neither an OCI layout (index.json) nor a docker save archive (manifest.json)",
            ));
        };
    let config = ImageConfig::parse(&config_bytes)?;
    config.check_platform()?;
    let config_digest = Digest::of(&config_bytes);
    store.put_bytes(&config_digest, &config_bytes, "image config")?;
    let mut layers = layers;
    for (layer, diff_id) in layers.iter_mut().zip(config.diff_ids.iter()) {
        if layer.diff_id.is_none() {
            layer.diff_id = Some(diff_id.clone());
        }
    }
    copy_layers(path, &store, &small, &wanted)?;
    Ok(Image {
        store,
        blob_dir: blob_dir.to_path_buf(),
        manifest_digest,
        config_digest,
        config,
        layers,
    })
}

/// The name of an archive member, `./` and leading `/` dropped; `None`
/// for names with `..` (never read).
fn member_name(path: &Path) -> Option<String> {
    let mut parts = Vec::new();
    for c in path.components() {
        match c {
            Component::Normal(n) => parts.push(n.to_str()?.to_string()),
            Component::CurDir | Component::RootDir => {}
            Component::ParentDir | Component::Prefix(_) => return None,
        }
    }
    Some(parts.join("/"))
}

/// The archive's tar stream (gunzipped if it is gzip).
fn open_archive(path: &Path) -> Result<tar::Archive<Box<dyn Read>>> {
    let file = File::open(path).map_err(|e| Error::io(path.display(), e))?;
    let mut file = BufReader::new(file);
    let gzip = file
        .fill_buf()
        .map_err(|e| Error::io(path.display(), e))?
        .starts_with(&[0x1f, 0x8b]);
    let reader: Box<dyn Read> = if gzip {
        Box::new(flate2::read::MultiGzDecoder::new(file))
    } else {
        Box::new(file)
    };
    Ok(tar::Archive::new(reader))
}

/// Every regular member of at most [`MAX_DOCUMENT`] bytes, by name.
fn read_small_files(path: &Path) -> Result<HashMap<String, Vec<u8>>> {
    let what = path.display().to_string();
    let bad = |e: io::Error| Error::malformed(&what, e);
    let mut archive = open_archive(path)?;
    let mut small = HashMap::new();
    let mut total = 0u64;
    for entry in archive.entries().map_err(bad)? {
        let mut entry = entry.map_err(bad)?;
        if !entry.header().entry_type().is_file() || entry.size() > MAX_DOCUMENT {
            continue;
        }
        let Some(name) = entry.path().ok().and_then(|p| member_name(&p)) else {
            continue;
        };
        total += entry.size();
        if total > MAX_SMALL_TOTAL {
            return Err(Error::malformed(
                &what,
                format!("more than {MAX_SMALL_TOTAL} bytes of small files"),
            ));
        }
        let mut bytes = Vec::with_capacity(entry.size() as usize);
        entry.read_to_end(&mut bytes).map_err(bad)?;
        small.insert(name, bytes);
    }
    Ok(small)
}

/// Where a blob of an OCI layout is in the archive.
fn blob_member(digest: &Digest) -> String {
    format!("blobs/sha256/{}", digest.hex())
}

/// A blob of the layout that the first pass kept, checked.
fn small_blob<'a>(
    what: &str,
    small: &'a HashMap<String, Vec<u8>>,
    digest: &Digest,
) -> Result<&'a [u8]> {
    let bytes = small
        .get(&blob_member(digest))
        .ok_or_else(|| Error::malformed(what, format!("blob {digest} is missing or too large")))?;
    let actual = Digest::of(bytes);
    if &actual != digest {
        return Err(Error::Digest {
            what: format!("{what}: blob"),
            expected: digest.to_string(),
            actual: actual.to_string(),
        });
    }
    Ok(bytes)
}

/// A layer to copy: where it is in the archive, and its digest.
struct Wanted {
    member: String,
    digest: Digest,
}

type Resolved = (Digest, Vec<u8>, Vec<Layer>, Vec<Wanted>);

/// An OCI layout: index.json's image (through nested indexes).
fn from_layout(what: &str, index: &[u8], small: &HashMap<String, Vec<u8>>) -> Result<Resolved> {
    let mut doc = Document::parse("index.json", index)?;
    let mut chosen: Option<Descriptor> = None;
    for _ in 0..4 {
        if let Some(manifests) = &doc.manifests {
            let d = image::choose_platform(what, manifests)?.clone();
            let digest = Digest::parse(&d.digest)?;
            doc = Document::parse(
                &format!("{what}: {digest}"),
                small_blob(what, small, &digest)?,
            )?;
            chosen = Some(d);
        } else {
            break;
        }
    }
    let manifest = chosen.ok_or_else(|| Error::malformed(what, "index.json names no image"))?;
    let manifest_digest = Digest::parse(&manifest.digest)?;
    let (Some(config), Some(layers)) = (&doc.config, &doc.layers) else {
        return Err(Error::malformed(
            format!("{what}: {manifest_digest}"),
            format!("not an image manifest ({})", doc.media_type),
        ));
    };
    let config_digest = Digest::parse(&config.digest)?;
    let config_bytes = small_blob(what, small, &config_digest)?.to_vec();
    let parsed = ImageConfig::parse(&config_bytes)?;
    let layers = image::layers_of(what, layers, &parsed)?;
    let wanted = layers
        .iter()
        .map(|l| Wanted {
            member: blob_member(&l.digest),
            digest: l.digest.clone(),
        })
        .collect();
    Ok((manifest_digest, config_bytes, layers, wanted))
}

/// A `docker save` archive: manifest.json's first image. Its layers are
/// named by their files' digests (which are their diff ids: uncompressed).
fn from_save(what: &str, manifest: &[u8], small: &HashMap<String, Vec<u8>>) -> Result<Resolved> {
    let entries: Vec<SaveEntry> = serde_json::from_slice(manifest)
        .map_err(|e| Error::malformed(format!("{what}: manifest.json"), e))?;
    let entry = entries
        .into_iter()
        .next()
        .ok_or_else(|| Error::malformed(format!("{what}: manifest.json"), "no image"))?;
    let config_name = member_name(Path::new(&entry.config))
        .ok_or_else(|| Error::malformed(what, format!("config path {:?}", entry.config)))?;
    let config_bytes = small
        .get(&config_name)
        .ok_or_else(|| Error::malformed(what, format!("config {config_name} is missing")))?
        .clone();
    let config = ImageConfig::parse(&config_bytes)?;
    if config.diff_ids.len() != entry.layers.len() {
        return Err(Error::malformed(
            what,
            format!(
                "{} layers but {} diff_ids in the config",
                entry.layers.len(),
                config.diff_ids.len()
            ),
        ));
    }
    let mut layers = Vec::new();
    let mut wanted = Vec::new();
    for (name, diff_id) in entry.layers.iter().zip(&config.diff_ids) {
        let member = member_name(Path::new(name))
            .ok_or_else(|| Error::malformed(what, format!("layer path {name:?}")))?;
        // docker save's layers are uncompressed: their files' digests
        // are the diff ids, checked as they are copied.
        wanted.push(Wanted {
            member,
            digest: diff_id.clone(),
        });
        layers.push(Layer {
            digest: diff_id.clone(),
            media_type: "application/vnd.docker.image.rootfs.diff.tar".into(),
            size: 0,
            diff_id: Some(diff_id.clone()),
        });
    }
    Ok((Digest::of(manifest), config_bytes, layers, wanted))
}

/// The second pass: each wanted member into the store, checked.
fn copy_layers(
    path: &Path,
    store: &BlobStore,
    small: &HashMap<String, Vec<u8>>,
    wanted: &[Wanted],
) -> Result<()> {
    let what = path.display().to_string();
    let mut todo: HashMap<&str, &Digest> = HashMap::new();
    for w in wanted {
        if store.has(&w.digest) {
            continue;
        }
        if let Some(bytes) = small.get(&w.member) {
            store.put_bytes(&w.digest, bytes, &format!("{what}: {}", w.member))?;
        } else {
            todo.insert(w.member.as_str(), &w.digest);
        }
    }
    if todo.is_empty() {
        return Ok(());
    }
    let bad = |e: io::Error| Error::malformed(&what, e);
    let mut archive = open_archive(path)?;
    for entry in archive.entries().map_err(bad)? {
        let mut entry = entry.map_err(bad)?;
        if !entry.header().entry_type().is_file() {
            continue;
        }
        let Some(name) = entry.path().ok().and_then(|p| member_name(&p)) else {
            continue;
        };
        if let Some(digest) = todo.remove(name.as_str()) {
            let size = entry.size();
            store.put_reader(&mut entry, Some(digest), size, &format!("{what}: {name}"))?;
        }
    }
    match todo.keys().next() {
        Some(missing) => Err(Error::malformed(
            &what,
            format!("layer {missing} is missing"),
        )),
        None => Ok(()),
    }
}
