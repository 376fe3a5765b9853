//! Gratuitous ARP after a restore. Every clone of a snapshot comes up with
//! its template's MAC and IPv4 address behind a new tap: the host side's
//! neighbour cache may hold nothing (a new namespace) or a stale entry, so
//! the agent's `resumed` hook announces each configured IPv4 address once
//! (an ARP request for the address itself, to the broadcast address, as
//! `arping -U` does), through an `AF_PACKET` socket.

use std::ffi::CStr;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// Ethernet + ARP request: 42 bytes.
pub const ARP_FRAME_LEN: usize = 42;
const ETH_P_ARP: u16 = 0x0806;

/// The gratuitous ARP request announcing `ip` at `mac`.
pub fn gratuitous_arp(mac: [u8; 6], ip: Ipv4Addr) -> [u8; ARP_FRAME_LEN] {
    let mut f = [0u8; ARP_FRAME_LEN];
    f[0..6].copy_from_slice(&[0xff; 6]);
    f[6..12].copy_from_slice(&mac);
    f[12..14].copy_from_slice(&ETH_P_ARP.to_be_bytes());
    f[14..16].copy_from_slice(&1u16.to_be_bytes()); // Ethernet
    f[16..18].copy_from_slice(&0x0800u16.to_be_bytes()); // IPv4
    f[18] = 6;
    f[19] = 4;
    f[20..22].copy_from_slice(&1u16.to_be_bytes()); // request
    f[22..28].copy_from_slice(&mac);
    f[28..32].copy_from_slice(&ip.octets());
    // Target hardware address unknown (zero), target protocol address the
    // sender's own.
    f[38..42].copy_from_slice(&ip.octets());
    f
}

/// One interface address to announce.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Announce {
    pub interface: String,
    pub ip: Ipv4Addr,
}

/// IPv4 addresses of interfaces that are up, not loopback.
pub fn ipv4_addresses() -> io::Result<Vec<Announce>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list we free below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let mut out = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, alive
        // until freeifaddrs.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        let flags = ifa.ifa_flags as libc::c_int;
        if ifa.ifa_addr.is_null() || flags & libc::IFF_UP == 0 || flags & libc::IFF_LOOPBACK != 0 {
            continue;
        }
        // SAFETY: ifa_addr is non-null and points at a sockaddr.
        if i32::from(unsafe { (*ifa.ifa_addr).sa_family }) != libc::AF_INET {
            continue;
        }
        // SAFETY: an AF_INET address is a sockaddr_in.
        let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        let name = unsafe { CStr::from_ptr(ifa.ifa_name) };
        out.push(Announce {
            interface: name.to_string_lossy().into_owned(),
            ip: Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)),
        });
    }
    // SAFETY: `head` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

/// The interface's Ethernet address (`SIOCGIFHWADDR` on socket `fd`).
fn hardware_address(fd: libc::c_int, name: &str) -> io::Result<[u8; 6]> {
    // SAFETY: ifreq is plain data; all-zero is valid.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    if name.len() >= req.ifr_name.len() {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    for (dst, &src) in req.ifr_name.iter_mut().zip(name.as_bytes()) {
        *dst = src as libc::c_char;
    }
    // SAFETY: SIOCGIFHWADDR reads the name and writes the address into
    // `req`, which lives across the call.
    if unsafe { libc::ioctl(fd, libc::SIOCGIFHWADDR, &mut req) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel filled the hardware-address member of the union.
    let data = unsafe { req.ifr_ifru.ifru_hwaddr.sa_data };
    let mut mac = [0u8; 6];
    for (m, &d) in mac.iter_mut().zip(&data) {
        *m = d as u8;
    }
    Ok(mac)
}

/// Sends the gratuitous ARP for `a` out of its interface.
pub fn send(a: &Announce) -> io::Result<()> {
    let name = std::ffi::CString::new(a.interface.as_str())
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: `name` is a NUL-terminated string.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    if index == 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: plain socket creation; the descriptor is owned right away.
    let raw = unsafe {
        libc::socket(
            libc::AF_PACKET,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            i32::from(ETH_P_ARP.to_be()),
        )
    };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` is a new descriptor nobody else owns.
    let sock = unsafe { OwnedFd::from_raw_fd(raw) };
    let mac = hardware_address(sock.as_raw_fd(), &a.interface)?;
    // SAFETY: sockaddr_ll is plain data; all-zero is valid.
    let mut to: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    to.sll_family = libc::AF_PACKET as u16;
    to.sll_protocol = ETH_P_ARP.to_be();
    to.sll_ifindex = index as i32;
    to.sll_halen = 6;
    to.sll_addr[..6].copy_from_slice(&[0xff; 6]);
    let frame = gratuitous_arp(mac, a.ip);
    // SAFETY: `frame` and `to` are valid for the lengths given; the socket
    // is open.
    let rc = unsafe {
        libc::sendto(
            sock.as_raw_fd(),
            frame.as_ptr().cast(),
            frame.len(),
            0,
            (&to as *const libc::sockaddr_ll).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_frame_is_an_arp_request_for_our_own_address() {
        let mac = [6, 0, 0xac, 0x10, 0, 2];
        let f = gratuitous_arp(mac, Ipv4Addr::new(172, 16, 0, 2));
        assert_eq!(&f[..6], &[0xff; 6], "broadcast");
        assert_eq!(&f[6..12], &mac);
        assert_eq!(&f[12..14], &[0x08, 0x06]);
        assert_eq!(&f[20..22], &[0, 1], "request");
        assert_eq!(&f[22..28], &mac, "sender MAC");
        assert_eq!(&f[28..32], &[172, 16, 0, 2], "sender IP");
        assert_eq!(&f[32..38], &[0; 6], "target MAC unknown");
        assert_eq!(&f[38..42], &[172, 16, 0, 2], "target IP = sender IP");
    }

    /// A namespace with a veth pair: the agent announces on one end, the
    /// test reads the other with a packet socket.
    #[test]
    fn the_announcement_leaves_through_the_interface() {
        use std::process::Command;
        // scripts/test leaves this out without root (tests/needs).
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        assert!(root, "needs root for a network namespace");
        let ns = format!("tga-{}", std::process::id());
        let ip = |args: &[&str]| {
            Command::new("ip")
                .args(["-n", &ns])
                .args(args)
                .status()
                .is_ok_and(|s| s.success())
        };
        assert!(
            Command::new("ip")
                .args(["netns", "add", &ns])
                .status()
                .is_ok_and(|s| s.success()),
            "cannot create a network namespace"
        );
        struct Del(String);
        impl Drop for Del {
            fn drop(&mut self) {
                let _ = std::process::Command::new("ip")
                    .args(["netns", "del", &self.0])
                    .status();
            }
        }
        let _del = Del(ns.clone());
        assert!(ip(&[
            "link", "add", "ga0", "type", "veth", "peer", "name", "gb0"
        ]));
        assert!(ip(&["addr", "add", "192.0.2.5/24", "dev", "ga0"]));
        assert!(ip(&["link", "set", "ga0", "up"]));
        assert!(ip(&["link", "set", "gb0", "up"]));
        let file = std::fs::File::open(format!("/run/netns/{ns}")).unwrap();
        let got = std::thread::scope(|s| {
            s.spawn(|| {
                // SAFETY: setns on a namespace descriptor we hold; only
                // this thread moves.
                let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
                assert_eq!(rc, 0);
                let name = std::ffi::CString::new("gb0").unwrap();
                // SAFETY: `name` is NUL-terminated.
                let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
                // SAFETY: plain socket creation; closed below.
                let fd = unsafe {
                    libc::socket(
                        libc::AF_PACKET,
                        libc::SOCK_RAW,
                        i32::from(ETH_P_ARP.to_be()),
                    )
                };
                assert!(fd >= 0);
                // SAFETY: all-zero sockaddr_ll is valid; filled below.
                let mut at: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
                at.sll_family = libc::AF_PACKET as u16;
                at.sll_protocol = ETH_P_ARP.to_be();
                at.sll_ifindex = index as i32;
                let timeout = libc::timeval {
                    tv_sec: 5,
                    tv_usec: 0,
                };
                // SAFETY: `at` and `timeout` are valid for the sizes given.
                unsafe {
                    assert_eq!(
                        libc::bind(
                            fd,
                            (&at as *const libc::sockaddr_ll).cast(),
                            std::mem::size_of::<libc::sockaddr_ll>() as u32
                        ),
                        0
                    );
                    libc::setsockopt(
                        fd,
                        libc::SOL_SOCKET,
                        libc::SO_RCVTIMEO,
                        (&timeout as *const libc::timeval).cast(),
                        std::mem::size_of::<libc::timeval>() as u32,
                    );
                }
                let list = ipv4_addresses().unwrap();
                let ours = list
                    .iter()
                    .find(|a| a.interface == "ga0")
                    .expect("ga0's address listed")
                    .clone();
                assert_eq!(ours.ip, Ipv4Addr::new(192, 0, 2, 5));
                send(&ours).unwrap();
                let mut buf = [0u8; 128];
                // SAFETY: `buf` is writable for its length.
                let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0) };
                assert!(
                    n >= ARP_FRAME_LEN as isize,
                    "no frame: {}",
                    std::io::Error::last_os_error()
                );
                let mac = hardware_address(fd, "ga0").unwrap();
                // SAFETY: `fd` is ours, closed once.
                unsafe { libc::close(fd) };
                (buf[..ARP_FRAME_LEN].to_vec(), mac)
            })
            .join()
            .unwrap()
        });
        let (frame, mac) = got;
        assert_eq!(
            frame,
            gratuitous_arp(mac, Ipv4Addr::new(192, 0, 2, 5)).to_vec()
        );
    }

    #[test]
    fn loopback_is_never_announced() {
        let list = ipv4_addresses().unwrap();
        assert!(list.iter().all(|a| !a.ip.is_loopback()), "{list:?}");
    }
}
