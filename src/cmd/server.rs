//! What `torpor serve`, `torpor pod serve` and a cluster's replica share:
//! the default data directory, token files, the async runtime, the
//! signal that stops them, the guest-port listener and its identity, and
//! where the per-VM `torpor-vmm` is. Below `serve`, `cluster` and the
//! nested pod's bring-up, which all call it.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use torpor_api::tls::Identity;

use crate::cli::ServeArgs;

/// Where state lives unless `--data-dir` or TORPOR_DATA_DIR says otherwise.
pub(crate) fn default_data_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("TORPOR_DATA_DIR") {
        return dir.into();
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return "/var/lib/torpor".into();
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| ".".into());
    home.join(".local/share/torpor")
}

/// The token in `path`, or a new random one written there (mode 0600);
/// whether it was created.
pub(crate) fn token_file(path: &Path) -> Result<(String, bool), String> {
    if let Ok(t) = std::fs::read_to_string(path) {
        let t = t.trim().to_string();
        if t.is_empty() {
            return Err(format!("{} is empty", path.display()));
        }
        return Ok((t, false));
    }
    let mut raw = [0u8; 24];
    // SAFETY: getrandom writes at most raw.len() bytes into raw.
    if unsafe { libc::getrandom(raw.as_mut_ptr().cast(), raw.len(), 0) } != raw.len() as isize {
        return Err("cannot get random bytes for the API token".into());
    }
    let token: String = raw.iter().map(|b| format!("{b:02x}")).collect();
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .create_new(true)
        .write(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
    std::io::Write::write_all(&mut f, token.as_bytes()).map_err(|e| e.to_string())?;
    Ok((token, true))
}

pub(crate) fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))
}

/// The identity of `--proxy-listen` when it serves TLS: the given
/// wildcard certificate, or a self-signed one for `*.DOMAIN` (made once in
/// DATA_DIR/proxy-tls).
pub(crate) fn proxy_identity(
    args: &ServeArgs,
    data_dir: &Path,
) -> Result<Option<Identity>, String> {
    if !args.proxy_tls && args.proxy_tls_cert.is_none() {
        return Ok(None);
    }
    let who = "torpor serve: guest ports";
    let identity = match (&args.proxy_tls_cert, &args.proxy_tls_key) {
        (Some(cert), Some(key)) => Identity::from_files(cert, key).map_err(|e| e.to_string())?,
        _ => {
            let dir = data_dir.join("proxy-tls");
            let domain = args.proxy_domain.trim_end_matches('.');
            let names = vec![format!("*.{domain}"), domain.to_string()];
            let (identity, made) =
                Identity::load_or_create(&dir, &names).map_err(|e| e.to_string())?;
            if made {
                println!(
                    "{who}: made a TLS certificate for *.{domain} in {}",
                    dir.display()
                );
            }
            identity
        }
    };
    println!(
        "{who}: TLS certificate fingerprint {}",
        identity.fingerprint()
    );
    Ok(Some(identity))
}

/// `--proxy-listen`: guest ports (and envd) alone on `addr`.
pub(crate) async fn serve_proxy(
    app: axum::Router,
    addr: SocketAddr,
    domain: &str,
    identity: Option<Identity>,
) -> Result<(), String> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    let bound = listener.local_addr().map_err(|e| e.to_string())?;
    let scheme = if identity.is_some() { "https" } else { "http" };
    println!("torpor serve: guest ports on {scheme}://{bound} ({scheme}://PORT-ID.{domain})");
    tokio::spawn(async move {
        let served = match identity {
            Some(identity) => {
                torpor_api::serve_tls_app_h2(listener, &identity, app, ctrl_c()).await
            }
            None => torpor_api::serve_app(listener, app, ctrl_c()).await,
        };
        if let Err(e) = served {
            tracing::error!("guest-port listener: {e}");
        }
    });
    Ok(())
}

/// SIGINT or SIGTERM (what service managers send): the graceful stop,
/// which ends the standby shells; sandboxes' VMMs run on (a restart
/// re-attaches to them).
pub(crate) async fn ctrl_c() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// The `torpor-vmm` binary beside this executable: the per-VM process,
/// which links only the VMM crates.
pub(crate) fn vmm_exe() -> Result<std::path::PathBuf, String> {
    let me =
        std::env::current_exe().map_err(|e| format!("cannot find the torpor executable: {e}"))?;
    let vmm = me.with_file_name("torpor-vmm");
    if vmm.is_file() {
        Ok(vmm)
    } else {
        Err(format!(
            "{} is missing: torpor-vmm, the per-VM process, is installed beside torpor \
             (`cargo build --release` builds both; `cargo run` builds only torpor)",
            vmm.display()
        ))
    }
}
