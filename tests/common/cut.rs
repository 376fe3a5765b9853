//! A TCP proxy on loopback that a test can cut: between a client (the
//! service's S3 client) and a server (SeaweedFS), forwarding both ways
//! until it is cut, at once or once the client has sent a given number of
//! bytes more (mid-request: the store "stops" in the middle of an
//! upload). Cut, every open connection is shut down and each new one
//! closed as soon as it is accepted; restored, it forwards again. It can
//! also be made slow: each read of the server's answers delayed.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

#[derive(Default)]
struct State {
    cut: AtomicBool,
    /// Bytes clients sent through it.
    sent: AtomicU64,
    /// Cut once `sent` passes this (u64::MAX: never).
    cut_at: AtomicU64,
    /// The open connections' sockets, both sides, to shut down when cut.
    open: Mutex<Vec<TcpStream>>,
    /// Microseconds each read of the server's answers waits before it is
    /// forwarded (a slow store).
    delay_us: AtomicU64,
}

impl State {
    fn cut_now(&self) {
        self.cut.store(true, Ordering::SeqCst);
        for s in self.open.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

pub struct CutProxy {
    addr: SocketAddr,
    state: Arc<State>,
}

impl CutProxy {
    /// A proxy to `upstream` (`host:port`) on a free loopback port.
    pub fn start(upstream: &str) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(State {
            cut_at: AtomicU64::new(u64::MAX),
            ..Default::default()
        });
        let upstream = upstream.to_string();
        let st = state.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                if st.cut.load(Ordering::SeqCst) {
                    drop(client);
                    continue;
                }
                let Ok(server) = TcpStream::connect(&upstream) else {
                    continue;
                };
                {
                    let mut open = st.open.lock().unwrap();
                    open.push(client.try_clone().unwrap());
                    open.push(server.try_clone().unwrap());
                }
                let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                let (up, down) = (st.clone(), st.clone());
                std::thread::spawn(move || pump(client, server, Some(up), None));
                std::thread::spawn(move || pump(s2, c2, None, Some(down)));
            }
        });
        Self { addr, state }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Cuts once clients have sent `more` bytes beyond what they sent so
    /// far.
    pub fn cut_after(&self, more: u64) {
        let now = self.state.sent.load(Ordering::SeqCst);
        self.state.cut_at.store(now + more, Ordering::SeqCst);
    }

    /// Cuts now.
    pub fn cut(&self) {
        self.state.cut_now();
    }

    /// Whether it is cut.
    pub fn is_cut(&self) -> bool {
        self.state.cut.load(Ordering::SeqCst)
    }

    /// Makes the store slow: each read of its answers (up to 16 KiB) waits
    /// `per_read` before it is forwarded (zero: at once again).
    pub fn slow(&self, per_read: std::time::Duration) {
        self.state
            .delay_us
            .store(per_read.as_micros() as u64, Ordering::SeqCst);
    }

    /// Forwards again.
    pub fn restore(&self) {
        self.state.cut_at.store(u64::MAX, Ordering::SeqCst);
        self.state.cut.store(false, Ordering::SeqCst);
    }
}

/// Copies `from` to `to` until either closes or the proxy is cut; the
/// client's side (`counted`) counts what it sends and cuts at the mark;
/// the server's (`slowed`) waits the proxy's delay before each write.
fn pump(
    mut from: TcpStream,
    mut to: TcpStream,
    counted: Option<Arc<State>>,
    slowed: Option<Arc<State>>,
) {
    let mut buf = [0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let mut n = n;
        if let Some(st) = &slowed {
            let us = st.delay_us.load(Ordering::SeqCst);
            if us > 0 {
                std::thread::sleep(std::time::Duration::from_micros(us));
            }
            if st.cut.load(Ordering::SeqCst) {
                break;
            }
        }
        if let Some(st) = &counted {
            if st.cut.load(Ordering::SeqCst) {
                break;
            }
            let before = st.sent.fetch_add(n as u64, Ordering::SeqCst);
            let at = st.cut_at.load(Ordering::SeqCst);
            if before + n as u64 > at {
                // Forward what comes before the mark, then cut: the
                // request in flight is torn.
                n = at.saturating_sub(before) as usize;
                let _ = to.write_all(&buf[..n]);
                st.cut_now();
                break;
            }
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Both);
    let _ = from.shutdown(Shutdown::Both);
}
