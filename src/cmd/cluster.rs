//! `torpor serve --cluster` (a stateless API replica) and the cluster side
//! of `torpor pod serve --cluster` (heartbeats and the work queue).

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use torpor_api::auth::tokens::{TenantsFile, TENANTS_FILE};
use torpor_api::auth::Auth;
use torpor_cluster::pod::{Journal, PodIdentity};
use torpor_cluster::{Cluster, ClusterConfig, ClusterUrls};
use torpor_scheduler::model::PodId;
use torpor_scheduler::service::Service;

use crate::cli::{PodServeArgs, ServeArgs};

fn config(urls: &str) -> Result<ClusterConfig, String> {
    let urls: ClusterUrls = urls
        .parse()
        .map_err(|e: torpor_cluster::ClusterError| e.to_string())?;
    Ok(ClusterConfig::new(urls))
}

/// One API replica: no pod of its own, every command to a pod's queue.
pub fn serve_replica(args: ServeArgs, urls: &str) -> Result<(), String> {
    let mut config = config(urls)?;
    config.wait = Duration::from_millis(args.cluster_wait_ms.max(1));
    config.down_after = Duration::from_millis(args.cluster_down_after_ms.max(1));
    config.lost_after = Duration::from_millis(args.cluster_lost_after_ms.max(1));
    config.io_timeout = Duration::from_millis(args.service.request_timeout_ms.max(1));
    config.create_start = Duration::from_millis(args.cluster_create_start_ms);
    config.create_grace = Duration::from_millis(args.cluster_create_grace_ms);
    config.placement_choices = args.cluster_placement_choices.max(1);
    let data_dir = args
        .data_dir
        .clone()
        .unwrap_or_else(super::server::default_data_dir);
    {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&data_dir)
            .map_err(|e| format!("cannot create {}: {e}", data_dir.display()))?;
    }
    // Tenants and tokens live in PostgreSQL, shared by every replica: a
    // tenants file here (from before, or the operator's) and `--token` are
    // seeds, written there idempotently.
    let seed_path = data_dir.join(TENANTS_FILE);
    let seed = TenantsFile::load(&seed_path).map_err(|e| e.to_string())?;
    let request_timeout = config.wait + Duration::from_secs(5);
    let proxy_identity = super::server::proxy_identity(&args, &data_dir)?;
    let listen: SocketAddr = args.listen;
    super::server::runtime()?.block_on(async move {
        let cluster = Cluster::connect(config).await.map_err(|e| e.to_string())?;
        println!(
            "torpor serve: cluster replica (PostgreSQL schema migrated, JetStream streams ready)"
        );
        let (auth, first) = Auth::shared(cluster.db(), &args.token, &seed)
            .await
            .map_err(|e| format!("the tenants in PostgreSQL: {e}"))?;
        if !seed.tokens.is_empty() || !seed.quotas.is_empty() {
            println!(
                "torpor serve: the tokens and quotas of {} are in PostgreSQL too",
                seed_path.display()
            );
        }
        if let Some(token) = first {
            println!("torpor serve: created the cluster's first admin token; it is shown this once, keep it:");
            println!("torpor serve: admin token: {token}");
        }
        let api = torpor_api::ApiConfig {
            auth: Some(auth),
            request_timeout,
            proxy_domain: Some(args.proxy_domain.clone()),
            ..Default::default()
        };
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let api = torpor_api::Api::new(cluster, api);
        // E2B's routes and envd on a listener of their own, as embedded
        // serve's; on the same API (tokens, rate limits shared).
        if let Some(e2b_listen) = args.e2b_listen {
            let e2b = tokio::net::TcpListener::bind(e2b_listen)
                .await
                .map_err(|e| format!("cannot listen on {e2b_listen}: {e}"))?;
            let e2b_addr = e2b.local_addr().map_err(|e| e.to_string())?;
            println!("torpor serve: E2B API on http://{e2b_addr}");
            let app = with_request_context(api.e2b_router());
            tokio::spawn(async move {
                if let Err(e) = torpor_api::serve_app(e2b, app, super::server::ctrl_c()).await {
                    tracing::error!("E2B listener: {e}");
                }
            });
        }
        if let Some(proxy_listen) = args.proxy_listen {
            let app = with_request_context(api.e2b_router());
            super::server::serve_proxy(app, proxy_listen, &args.proxy_domain, proxy_identity)
                .await?;
        }
        println!("torpor serve: listening on http://{addr}");
        let app = with_request_context(api.router());
        torpor_api::serve_app(listener, app, super::server::ctrl_c())
            .await
            .map_err(|e| e.to_string())
    })
}

/// A replica's `app` with the request context its commands need (their
/// `Idempotency-Key`: `torpor_api::request_context`).
fn with_request_context(app: axum::Router) -> axum::Router {
    app.layer(axum::middleware::from_fn(
        torpor_api::request_context::scope,
    ))
}

/// Starts the pod's cluster side (on the current runtime) once its API
/// listens at `address`.
pub fn start_pod(
    args: &PodServeArgs,
    service: &Arc<Service>,
    data_dir: &Path,
    address: String,
    token: &str,
    fingerprint: Option<String>,
) -> Result<(), String> {
    let Some(urls) = args.cluster.as_deref() else {
        return Ok(());
    };
    let mut config = config(urls)?;
    config.heartbeat = Duration::from_millis(args.heartbeat_ms.max(50));
    let id = args.pod_id.clone().ok_or("--cluster needs --pod-id")?;
    if !torpor_cluster::wire::valid_pod_id(&id) {
        return Err(format!("--pod-id {id:?}: 1-64 of a-z, 0-9 and -"));
    }
    let journal = Journal::open(&data_dir.join("cluster-journal.db")).map_err(|e| e.to_string())?;
    let me = PodIdentity {
        id: PodId::new(id.clone()),
        address,
        token: token.to_string(),
        fingerprint,
    };
    println!("torpor pod: in the cluster as pod {id} (work queue torpor.work.{id})");
    let service = service.clone();
    tokio::spawn(async move {
        if let Err(e) = torpor_cluster::pod::run(service, me, Arc::new(journal), config).await {
            eprintln!("torpor pod: the cluster side stopped: {e}");
            std::process::exit(1);
        }
    });
    Ok(())
}
