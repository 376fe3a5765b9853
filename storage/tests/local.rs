//! The storage suite (`common/mod.rs`) on a local directory: the embedded
//! default store.

mod common;

use std::time::Duration;

use common::Backend;
use torpor_storage::{Storage, StoreConfig};

fn backend() -> Backend {
    let dir = tempfile::tempdir().unwrap();
    let config = StoreConfig::parse(dir.path().join("objects").to_str().unwrap()).unwrap();
    let storage = Storage::open_with(&config, common::test_options()).unwrap();
    let mut b = Backend::new(storage, Duration::from_millis(30));
    // The store's directory lives as long as the scratch one.
    b.scratch = dir;
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_round_trip_of_a_sparse_multi_chunk_file() {
    common::round_trip_of_a_sparse_multi_chunk_file(&backend()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_dedupe_across_layers_sharing_most_chunks() {
    common::dedupe_across_layers_sharing_most_chunks(&backend()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_corrupted_chunk_is_detected_and_named() {
    common::corrupted_chunk_is_detected_and_named(&backend()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_lru_cache_holds_its_bound() {
    common::lru_cache_holds_its_bound(&backend()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_downloads_through_the_cache_fetch_only_what_it_lacks() {
    common::downloads_through_the_cache_fetch_only_what_it_lacks(&backend()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_deleted_manifest_unshared_chunks_are_collected() {
    common::deleted_manifest_unshared_chunks_are_collected(&backend()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_gc_spares_the_chunks_of_an_upload_in_progress() {
    common::gc_spares_the_chunks_of_an_upload_in_progress(&backend()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_gc_taking_a_reused_chunk_mid_upload_is_repaired() {
    common::gc_taking_a_reused_chunk_mid_upload_is_repaired(&backend()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_gc_spares_the_pending_manifest_of_an_upload() {
    common::gc_spares_the_pending_manifest_of_an_upload(&backend()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_upload_waits_for_a_running_gc_then_repairs() {
    common::upload_waits_for_a_running_gc_then_repairs(&backend()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_a_stale_lease_is_removed() {
    common::a_stale_lease_is_removed(&backend()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_named_layers_point_at_their_manifests() {
    common::named_layers_point_at_their_manifests(&backend()).await;
}
