//! `torpor serve`: the REST API, the scheduler and the store, with one local
//! pod, in this process. Embedded defaults: SQLite in the data directory
//! and the built-in probe template.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use torpor_scheduler::service::{Service, ServiceConfig};

use super::{EXIT_FAILURE, EXIT_OK};
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

/// Tokens from flags, else from the token file in the data directory
/// (created with a random token on first start, mode 0600).
fn tokens(args: &ServeArgs, data_dir: &std::path::Path) -> Result<Vec<String>, String> {
    if !args.token.is_empty() {
        return Ok(args.token.clone());
    }
    let path = data_dir.join("token");
    if let Ok(t) = std::fs::read_to_string(&path) {
        return Ok(vec![t.trim().to_string()]);
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
        .open(&path)
        .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
    std::io::Write::write_all(&mut f, token.as_bytes()).map_err(|e| e.to_string())?;
    println!("torpor serve: created an API token in {}", path.display());
    Ok(vec![token])
}

pub fn run(args: ServeArgs) -> i32 {
    match serve(args) {
        Ok(()) => EXIT_OK,
        Err(e) => {
            eprintln!("torpor: error: {e}");
            EXIT_FAILURE
        }
    }
}

fn serve(args: ServeArgs) -> Result<(), String> {
    let data_dir = args.data_dir.clone().unwrap_or_else(default_data_dir);
    std::fs::create_dir_all(&data_dir)
        .map_err(|e| format!("cannot create {}: {e}", data_dir.display()))?;
    let tokens = tokens(&args, &data_dir)?;
    let exe =
        std::env::current_exe().map_err(|e| format!("cannot find the torpor executable: {e}"))?;
    let mut config = ServiceConfig::new(data_dir.clone(), exe);
    config.policy_interval_ms = args.policy_interval_ms;
    config.default_keep_alive_ms = args.keep_alive_ms;
    config.exec_timeout_ms = args.exec_timeout_ms.max(1);
    println!("torpor serve: data dir {}", data_dir.display());
    let host = torpor_scheduler::service::host_guests();
    let kinds: Vec<&str> = host.kinds().iter().map(|k| k.as_str()).collect();
    println!(
        "torpor serve: the local pod runs template kinds: {} ({})",
        if kinds.is_empty() {
            "none".to_string()
        } else {
            kinds.join(", ")
        },
        host.summary
    );
    if let Some(why) = host.linux_refusal() {
        println!("torpor serve: no Linux templates here: {why}");
    }
    let service: Arc<Service> = Service::open(config).map_err(|e| e.to_string())?;
    println!("torpor serve: built-in template `probe` is ready");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))?;
    let listen: SocketAddr = args.listen;
    let api = torpor_api::ApiConfig {
        tokens,
        request_timeout: std::time::Duration::from_millis(args.request_timeout_ms.max(1)),
        ..Default::default()
    };
    let result = runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        println!("torpor serve: listening on http://{addr}");
        let shutdown = async {
            let _ = tokio::signal::ctrl_c().await;
        };
        torpor_api::serve(listener, service.clone(), api, shutdown)
            .await
            .map_err(|e| e.to_string())?;
        service.close();
        Ok::<(), String>(())
    });
    result
}
