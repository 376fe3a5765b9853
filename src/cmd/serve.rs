//! `torpor serve`: the REST API, the scheduler and the store, with one local
//! pod in this process (and, on a PVM host, the nested pod it runs for
//! Linux templates). Embedded defaults: SQLite in the data directory and
//! the built-in probe template. `torpor pod serve`: one pod alone, its API
//! on a unix socket or TCP (a cluster's pod with `--cluster`; the nested
//! pod's inside its VM). `--cluster`: an API replica ([`super::cluster`]).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use torpor_api::nested::Nested;
use torpor_api::tls::{self, Identity};
use torpor_scheduler::service::{HostGuests, Service, ServiceConfig};

use super::nested_parts::InterpreterImage;
use super::server::{
    ctrl_c, default_data_dir, proxy_identity, runtime, serve_proxy, token_file, vmm_exe,
};
use super::{EXIT_FAILURE, EXIT_OK};
use crate::cli::{PodServeArgs, ServeArgs, ServiceFlags};

/// The tokens file of `data_dir`, set up for a first start: unless admin
/// tokens are given on the command line, a tokens file without tokens gets
/// an admin token, printed once (or, in a data directory from before the
/// tokens file, its `token` becomes that admin token, stored hashed).
pub(crate) fn tenants_file(args: &ServeArgs, data_dir: &Path) -> Result<PathBuf, String> {
    use torpor_api::auth::tokens::{TenantsFile, TENANTS_FILE};
    use torpor_api::auth::{Auth, Scope, ADMIN_TENANT};
    let path = data_dir.join(TENANTS_FILE);
    if !args.token.is_empty() {
        return Ok(path);
    }
    let legacy = data_dir.join("token");
    let mut file = TenantsFile::load(&path).map_err(|e| e.to_string())?;
    if file.tokens.is_empty() {
        if let Ok(old) = std::fs::read_to_string(&legacy) {
            let old = old.trim();
            if !old.is_empty() {
                file.import(ADMIN_TENANT, Scope::Admin, old)
                    .map_err(|e| e.to_string())?;
                file.save(&path).map_err(|e| e.to_string())?;
                println!(
                    "torpor serve: the token in {} is now an admin token (stored hashed in {})",
                    legacy.display(),
                    path.display()
                );
                return Ok(path);
            }
        }
    }
    if let Some(token) = Auth::bootstrap(&path).map_err(|e| e.to_string())? {
        println!("torpor serve: created the first admin token; it is shown this once, keep it:");
        println!("torpor serve: admin token: {token}");
        println!(
            "torpor serve: (TORPOR_TOKEN=... torpor token create --tenant NAME makes a tenant's)"
        );
    }
    Ok(path)
}

pub fn run(args: ServeArgs) -> i32 {
    exit_status(serve(args))
}

pub fn run_pod(args: PodServeArgs) -> i32 {
    exit_status(serve_pod(args))
}

fn exit_status(result: Result<(), String>) -> i32 {
    match result {
        Ok(()) => EXIT_OK,
        Err(e) => {
            eprintln!("torpor: error: {e}");
            EXIT_FAILURE
        }
    }
}

/// `--sandbox-network` and its egress flags.
fn sandbox_networking(
    flags: &ServiceFlags,
) -> Result<torpor_scheduler::service::SandboxNetworking, String> {
    use torpor_scheduler::net::{dns, EgressPolicy, HostPort, NetConfig, Target};
    let targets = |list: &[String]| -> Result<Vec<Target>, String> {
        list.iter()
            .map(|c| c.parse::<Target>().map_err(|e| e.to_string()))
            .collect()
    };
    let egress = EgressPolicy {
        allow_internet: !flags.no_internet,
        allow_out: targets(&flags.allow_out)?,
        deny_out: targets(&flags.deny_out)?,
    };
    egress.check().map_err(|e| e.to_string())?;
    let dns = match flags.sandbox_dns_port {
        0 => None,
        port => {
            let upstream = match flags.sandbox_dns_upstream {
                Some(u) => u,
                None => {
                    let conf = std::fs::read_to_string("/etc/resolv.conf")
                        .map_err(|e| format!("cannot read /etc/resolv.conf: {e}"))?;
                    dns::upstream_from_resolv_conf(&conf).ok_or(
                        "/etc/resolv.conf names no nameserver: give --sandbox-dns-upstream",
                    )?
                }
            };
            Some(dns::DnsConfig::new(port, upstream))
        }
    };
    Ok(torpor_scheduler::service::SandboxNetworking {
        names: NetConfig {
            dns_port: dns.as_ref().map(|d| d.listen.port()),
            host_allow: flags
                .host_allow
                .iter()
                .map(|h| h.parse::<HostPort>().map_err(|e| e.to_string()))
                .collect::<Result<_, _>>()?,
            ..Default::default()
        },
        egress,
        dns,
        ..Default::default()
    })
}

/// The local pod's service in `data_dir`; `who` prefixes what it prints.
fn open_service(
    who: &str,
    data_dir: &Path,
    flags: &ServiceFlags,
    no_nested_pod: bool,
) -> Result<Arc<Service>, String> {
    // What the service creates is its own: sockets, overlays, logs, the
    // store, the token (VMMs' files are handed to their uids explicitly).
    // SAFETY: umask takes and returns a mode only.
    unsafe { libc::umask(0o077) };
    {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(data_dir)
            .map_err(|e| format!("cannot create {}: {e}", data_dir.display()))?;
    }
    let mut config = ServiceConfig::new(data_dir.to_path_buf(), vmm_exe()?);
    config.jail = if flags.no_jail {
        eprintln!(
            "{who}: warning: VMMs run without a jail (--no-jail), with the service's \
             privileges: a guest that escapes its VMM owns this host"
        );
        None
    } else {
        Some(torpor_scheduler::service::jail::JailConfig {
            uid_base: flags.jail_uid_base,
            uids: flags.jail_uids,
            sandbox_memory_max_mib: flags.sandbox_memory_max_mib,
        })
    };
    config.host = host_guests().clone();
    config.policy_interval_ms = flags.policy_interval_ms;
    config.history_interval_ms = flags.history_interval_ms;
    config.object_store = flags.object_store.clone();
    config.checkpoint_interval = flags
        .checkpoint_interval_s
        .filter(|&n| n > 0)
        .map(std::time::Duration::from_secs);
    config.lazy_wake = flags.lazy_wake;
    config.hibernate_ack = flags.hibernate_ack.ack();
    config.chunk_cache_mib = flags.chunk_cache_mib;
    config.volumes_relay = match (flags.volumes_relay, &flags.volumes_relay_token_file) {
        (Some(addr), Some(file)) => {
            let token = std::fs::read_to_string(file)
                .map_err(|e| format!("cannot read {}: {e}", file.display()))?
                .trim()
                .to_string();
            Some(torpor_scheduler::volumes::VolumesRelay { addr, token })
        }
        _ => None,
    };
    config.volumes_dir = match (&flags.volumes_dir, flags.volumes_relay) {
        (Some(dir), _) => Some(dir.clone()),
        (None, Some(_)) => None,
        (None, None) => Some(data_dir.join("volumes")),
    };
    config.volume_max_bytes = flags.volume_max_mib << 20;
    config.default_keep_alive_ms = flags.keep_alive_ms;
    config.exec_timeout_ms = flags.exec_timeout_ms.max(1);
    config.standby_pool = flags.standby_pool;
    config.standby_pool_max = flags.standby_pool_max;
    config.standby_pool_idle_ms = flags.standby_pool_idle_ms;
    config.standby_refill_threads = flags.standby_refill_threads;
    config.memory_backend = flags.memory_backend.backend();
    torpor_scheduler::service::vmm_process::set_spawn_mode(flags.vmm_spawn.mode());
    config.dirty_tracking = flags.dirty_tracking.tracking();
    config.images_dir = flags.images_dir.clone();
    config.deleted_retention_ms = flags.deleted_retention_ms;
    config.record_trace = flags.record_trace.clone();
    if flags.sandbox_network {
        config.net = Some(sandbox_networking(flags)?);
    }
    println!("{who}: data dir {}", data_dir.display());
    if let Some(store) = &config.object_store {
        println!("{who}: snapshots stored in {store}");
        if let Some(every) = config.checkpoint_interval {
            println!(
                "{who}: running sandboxes checkpointed there every {} s",
                every.as_secs()
            );
        }
    }
    let host = &config.host;
    let kinds: Vec<&str> = host.kinds().iter().map(|k| k.as_str()).collect();
    println!(
        "{who}: the local pod runs template kinds: {} ({})",
        if kinds.is_empty() {
            "none".to_string()
        } else {
            kinds.join(", ")
        },
        host.summary
    );
    if let Some(why) = host.linux_refusal() {
        println!("{who}: no Linux templates here: {why}");
        if who == "torpor serve" && no_nested_pod {
            println!(
                "{who}: Linux templates need the nested host, which --no-nested-pod turns off"
            );
        }
    }
    let service = Service::open(config).map_err(|e| e.to_string())?;
    println!("{who}: built-in template `probe` is ready");
    Ok(service)
}

fn serve(args: ServeArgs) -> Result<(), String> {
    if let Some(urls) = args.cluster.clone() {
        return super::cluster::serve_replica(args, &urls);
    }
    let data_dir = args.data_dir.clone().unwrap_or_else(default_data_dir);
    let service = open_service("torpor serve", &data_dir, &args.service, args.no_nested_pod)?;
    let tenants_file = tenants_file(&args, &data_dir)?;
    let request_timeout = Duration::from_millis(args.service.request_timeout_ms.max(1));
    let nested = Nested::new(service.clone(), request_timeout);
    // The template builder the nested pod's follower builds
    // `code-interpreter-v1` with: serve's API, once made below.
    let builder = super::nested_templates::Builder::default();
    if data_dir.join("federation.db").exists() {
        println!(
            "torpor serve: {} (pods registered by an earlier torpor) is no longer read: \
             several hosts run as a cluster (--cluster, see docs/operators.md)",
            data_dir.join("federation.db").display()
        );
    }
    // Serves the nested pod's sandboxes their volumes, while serve runs.
    let mut volume_gateway = None;
    if host_guests().linux_refusal().is_none() {
        if args.nested_pod {
            println!("torpor serve: the local pod runs Linux itself; --nested-pod is not needed");
        }
        let config = super::nested_parts::NestedPodConfig {
            kernel: args.nested_kernel.clone(),
            rootfs: args.nested_rootfs.clone(),
            interpreter: InterpreterImage::Missing("the local pod builds `base` only".into()),
            mem_mib: args.nested_mem_mib,
            host_cpus: args.nested_host_cpus,
            // Real VMX/SVM: none of TCG's secondary-vCPU faults.
            vcpus: 2,
            builder: builder.clone(),
        };
        super::nested_parts::local_on_demand(nested.clone(), service.clone(), config);
    } else if !args.no_nested_pod {
        let config = super::nested_parts::NestedPodConfig {
            kernel: args.nested_kernel.clone(),
            rootfs: args.nested_rootfs.clone(),
            interpreter: if args.no_nested_interpreter {
                InterpreterImage::Missing("--no-nested-interpreter".into())
            } else {
                InterpreterImage::find(args.nested_interpreter_rootfs.clone())
            },
            mem_mib: args.nested_mem_mib,
            host_cpus: args.nested_host_cpus,
            vcpus: args.nested_vcpus,
            builder: builder.clone(),
        };
        let template = super::nested_templates::BASE;
        let interpreter = super::nested_templates::INTERPRETER;
        match &config.interpreter {
            InterpreterImage::Missing(why) => {
                println!("torpor serve: `{interpreter}` is not offered: {why}")
            }
            InterpreterImage::Given(path) => println!(
                "torpor serve: `{interpreter}` (the code interpreter) is offered too, from {}",
                path.display()
            ),
            InterpreterImage::Cached => println!(
                "torpor serve: `{interpreter}` (the code interpreter) is offered too, its image \
                 made from the cached tree of scripts/build-rootfs --variant interpreter"
            ),
        }
        volume_gateway = Some(super::nested_pod::volume_gateway(
            &nested, &service, &data_dir,
        )?);
        if super::nested_pod::resume(&nested, &data_dir, &config)? {
            println!(
                "torpor serve: the nested host for Linux templates ran before this start: \
                 re-attaching to it, or starting a new one"
            );
        } else if args.nested_pod {
            super::nested_pod::start(nested.clone(), &data_dir, config)?;
            println!(
                "torpor serve: starting the nested host for Linux templates (QEMU/TCG, about a \
                 core while it runs); template `{template}` follows in a few minutes"
            );
        } else {
            super::nested_pod::on_demand(nested.clone(), &data_dir, config);
            println!(
                "torpor serve: the Linux template `{template}` runs in a nested host started on \
                 its first request (503 with Retry-After until it is ready; --no-nested-pod \
                 turns it off)"
            );
        }
    }
    if args.no_nested_pod {
        super::nested_pod::stop_recorded(&nested, &data_dir);
    }
    let (guest_kernel, guest_agent) =
        super::nested_parts::guest_files(&args.nested_kernel, &args.guest_agent);
    match (&guest_kernel, &guest_agent) {
        (Some(kernel), Some(agent)) => println!(
            "torpor serve: templates built from OCI images boot {} with the agent {}",
            kernel.display(),
            agent.display()
        ),
        (None, _) => println!(
            "torpor serve: no guest kernel known (give --nested-kernel, or run \
             scripts/build-guest-kernel): builds from OCI images answer 501"
        ),
        (_, None) => println!(
            "torpor serve: no guest agent known (give --guest-agent): builds from OCI \
             images answer 501"
        ),
    }
    let api = torpor_api::ApiConfig {
        tokens: args.token.clone(),
        tenants_file: Some(tenants_file),
        request_timeout,
        proxy_domain: Some(args.proxy_domain.clone()),
        builds_dir: Some(data_dir.join("builds")),
        volumes_dir: Some(data_dir.join("volumes")),
        volume_limits: torpor_api::volumes::Limits {
            per_tenant: args.volumes_per_tenant,
            bytes: args.service.volume_max_mib << 20,
        },
        guest_kernel,
        guest_agent,
        registry_ca: args.registry_ca.clone(),
        private_registries: args.private_registries.clone(),
        ..Default::default()
    };
    let proxy_identity = proxy_identity(&args, &data_dir)?;
    let listen: SocketAddr = args.listen;
    let identity = if args.tls || args.tls_cert.is_some() {
        Some(identity(
            "torpor serve",
            &data_dir,
            &args.tls_cert,
            &args.tls_key,
        )?)
    } else {
        None
    };
    runtime()?.block_on(async move {
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        // One API for every listener: tokens, quotas and rate limits shared.
        let api = torpor_api::Api::new(nested, api);
        // Set once: a second set (none is made) would be refused.
        let _ = builder.set(super::nested_templates::ServeApi {
            api: api.clone(),
            runtime: tokio::runtime::Handle::current(),
        });
        if let Some(e2b_listen) = args.e2b_listen {
            let e2b = tokio::net::TcpListener::bind(e2b_listen)
                .await
                .map_err(|e| format!("cannot listen on {e2b_listen}: {e}"))?;
            let e2b_addr = e2b.local_addr().map_err(|e| e.to_string())?;
            println!("torpor serve: E2B API on http://{e2b_addr}");
            let app = api.e2b_router();
            tokio::spawn(async move {
                if let Err(e) = torpor_api::serve_app(e2b, app, ctrl_c()).await {
                    tracing::error!("E2B listener: {e}");
                }
            });
        }
        if let Some(proxy_listen) = args.proxy_listen {
            let app = api.proxy_router();
            serve_proxy(app, proxy_listen, &args.proxy_domain, proxy_identity).await?;
        }
        match identity {
            Some(identity) => {
                println!("torpor serve: listening on https://{addr}");
                torpor_api::serve_tls_app(listener, &identity, api.router(), ctrl_c()).await
            }
            None => {
                println!("torpor serve: listening on http://{addr}");
                torpor_api::serve_app(listener, api.router(), ctrl_c()).await
            }
        }
        .map_err(|e| e.to_string())?;
        drop(volume_gateway);
        service.close();
        Ok::<(), String>(())
    })
}

/// `torpor pod serve`: the same service and API, one pod alone.
fn serve_pod(args: PodServeArgs) -> Result<(), String> {
    let data_dir = args.data_dir.clone().unwrap_or_else(default_data_dir);
    let service = open_service("torpor pod", &data_dir, &args.service, false)?;
    let (token, created) = token_file(&args.token_file)?;
    if created {
        println!(
            "torpor pod: created a token in {}",
            args.token_file.display()
        );
    }
    let api = torpor_api::ApiConfig {
        tokens: vec![token.clone()],
        request_timeout: Duration::from_millis(args.service.request_timeout_ms.max(1)),
        ..Default::default()
    };
    runtime()?.block_on(async move {
        if let Some(path) = args.listen.strip_prefix("unix:") {
            // A socket left by a pod that died: nothing listens on it.
            if std::os::unix::net::UnixStream::connect(path).is_err() {
                let _ = std::fs::remove_file(path);
            }
            let listener = tokio::net::UnixListener::bind(path)
                .map_err(|e| format!("cannot listen on {path}: {e}"))?;
            super::cluster::start_pod(
                &args,
                &service,
                &data_dir,
                format!("unix:{path}"),
                &token,
                None,
            )?;
            println!("torpor pod: listening on unix:{path}");
            torpor_api::serve_unix(listener, service.clone(), api, ctrl_c())
                .await
                .map_err(|e| e.to_string())?;
            let _ = std::fs::remove_file(path);
        } else if let Some(addr) = args.listen.strip_prefix("tcp:") {
            if args.plain_tcp && !torpor_api::pods::is_loopback(addr) {
                return Err(format!(
                    "--plain-tcp on {addr}: plain TCP is for loopback addresses only (the \
                     token and the sandboxes' traffic would cross the network in clear)"
                ));
            }
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
            let addr = listener.local_addr().map_err(|e| e.to_string())?;
            if args.plain_tcp {
                super::cluster::start_pod(
                    &args,
                    &service,
                    &data_dir,
                    format!("tcp:{addr}"),
                    &token,
                    None,
                )?;
                println!("torpor pod: listening on tcp:{addr} (plain, loopback)");
                torpor_api::serve(listener, service.clone(), api, ctrl_c()).await
            } else {
                let identity = identity("torpor pod", &data_dir, &args.tls_cert, &args.tls_key)?;
                super::cluster::start_pod(
                    &args,
                    &service,
                    &data_dir,
                    format!("tls:{addr}"),
                    &token,
                    Some(identity.fingerprint().to_string()),
                )?;
                println!("torpor pod: listening on tls:{addr}");
                torpor_api::serve_tls(listener, &identity, service.clone(), api, ctrl_c()).await
            }
            .map_err(|e| e.to_string())?;
        } else {
            return Err(format!(
                "--listen {}: expected unix:/PATH or tcp:ADDR:PORT",
                args.listen
            ));
        }
        service.close();
        Ok::<(), String>(())
    })
}

/// The TLS identity given by `cert`/`key`, else the one in DATA_DIR/tls
/// (made on first start); prints its fingerprint, which clients pin.
fn identity(
    who: &str,
    data_dir: &Path,
    cert: &Option<PathBuf>,
    key: &Option<PathBuf>,
) -> Result<Identity, String> {
    let identity = match (cert, key) {
        (Some(cert), Some(key)) => Identity::from_files(cert, key).map_err(|e| e.to_string())?,
        _ => {
            let dir = data_dir.join("tls");
            let (identity, made) =
                Identity::load_or_create(&dir, &tls::default_names()).map_err(|e| e.to_string())?;
            if made {
                println!("{who}: made a TLS certificate in {}", dir.display());
            }
            identity
        }
    };
    println!(
        "{who}: TLS certificate fingerprint {}",
        identity.fingerprint()
    );
    Ok(identity)
}

/// This host's guest support, from `torpor doctor`'s probe of /dev/kvm
/// (made once per process).
pub fn host_guests() -> &'static HostGuests {
    use torpor_vmm::doctor::{self, Verdict, VirtKind};
    static HOST: std::sync::OnceLock<HostGuests> = std::sync::OnceLock::new();
    HOST.get_or_init(|| {
        let report = doctor::run();
        let verdict = report.verdict();
        HostGuests {
            linux: verdict == Verdict::LinuxAndProbe,
            probe: verdict != Verdict::None,
            pvm: report.virtualization.kind == VirtKind::Pvm,
            summary: report.summary.clone(),
        }
    })
}
