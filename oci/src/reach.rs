//! Which registries a pull may reach ([`Reach`]): a server that pulls
//! what its tenants name refuses registries that resolve to addresses
//! only it can reach (loopback, private networks, link-local, the cloud
//! metadata address...) unless its operator named them.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::error::{Error, Result};

/// The registries a pull may reach.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Reach {
    /// Any (a caller that trusts its references: a CLI, a test).
    #[default]
    Any,
    /// Those whose every address is global, and those named here
    /// (`host` or `host:port`, as a reference names its registry).
    Global {
        /// Registries allowed whatever their addresses.
        except: Vec<String>,
    },
}

/// `registry`'s host and port (`[v6]:port`, `host:port`, `host`).
pub(crate) fn host_port(registry: &str) -> (&str, Option<u16>) {
    if let Some(rest) = registry.strip_prefix('[') {
        let (host, tail) = rest.split_once(']').unwrap_or((rest, ""));
        return (host, tail.strip_prefix(':').and_then(|p| p.parse().ok()));
    }
    match registry.rsplit_once(':') {
        Some((host, port)) => match port.parse() {
            Ok(port) => (host, Some(port)),
            Err(_) => (registry, None),
        },
        None => (registry, None),
    }
}

/// Whether `ip` is reachable from anywhere (not loopback, private,
/// link-local, shared, unique local, documentation, multicast, reserved).
pub fn is_global(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => is_global_v4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => is_global_v4(v4),
            None => is_global_v6(v6),
        },
    }
}

fn is_global_v4(ip: Ipv4Addr) -> bool {
    let [a, b, c, _] = ip.octets();
    !(ip.is_unspecified()
        || ip.is_loopback()
        || ip.is_private()
        || ip.is_link_local()
        || ip.is_broadcast()
        || ip.is_documentation()
        || ip.is_multicast()
        || a == 0
        // Shared address space (carrier-grade NAT), 100.64.0.0/10.
        || (a == 100 && (b & 0xc0) == 64)
        // IETF protocol assignments, 192.0.0.0/24.
        || (a == 192 && b == 0 && c == 0)
        // Benchmarking, 198.18.0.0/15.
        || (a == 198 && (b & 0xfe) == 18)
        // Reserved, 240.0.0.0/4.
        || a >= 240)
}

fn is_global_v6(ip: Ipv6Addr) -> bool {
    let first = ip.segments()[0];
    !(ip.is_unspecified()
        || ip.is_loopback()
        || ip.is_multicast()
        // Unique local, fc00::/7.
        || (first & 0xfe00) == 0xfc00
        // Link-local, fe80::/10, and the old site-local, fec0::/10.
        || (first & 0xffc0) == 0xfe80
        || (first & 0xffc0) == 0xfec0
        // Documentation, 2001:db8::/32.
        || (first == 0x2001 && ip.segments()[1] == 0x0db8))
}

/// Refuses `registry` under `reach` when one of its addresses is not
/// global and it is not named an exception. `default_port` is the
/// protocol's (443 or 80).
pub(crate) async fn check(registry: &str, reach: &Reach, default_port: u16) -> Result<()> {
    let Reach::Global { except } = reach else {
        return Ok(());
    };
    if except.iter().any(|e| e.eq_ignore_ascii_case(registry)) {
        return Ok(());
    }
    let (host, port) = host_port(registry);
    let addresses = tokio::net::lookup_host((host, port.unwrap_or(default_port)))
        .await
        .map_err(|e| Error::Unresolved {
            registry: registry.to_string(),
            detail: e.to_string(),
        })?;
    for address in addresses {
        if !is_global(address.ip()) {
            return Err(Error::NotGlobal {
                registry: registry.to_string(),
                address: address.ip(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registries_split_into_host_and_port() {
        assert_eq!(host_port("ghcr.io"), ("ghcr.io", None));
        assert_eq!(host_port("127.0.0.1:5000"), ("127.0.0.1", Some(5000)));
        assert_eq!(host_port("[::1]:5000"), ("::1", Some(5000)));
        assert_eq!(host_port("[fd00::1]"), ("fd00::1", None));
    }

    #[test]
    fn only_addresses_anyone_reaches_are_global() {
        for ip in ["1.1.1.1", "8.8.8.8", "2606:4700::1111", "::ffff:8.8.8.8"] {
            assert!(is_global(ip.parse().unwrap()), "{ip}");
        }
        for ip in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "255.255.255.255",
            "224.0.0.1",
            "192.0.0.8",
            "198.18.0.1",
            "240.0.0.1",
            "::1",
            "::",
            "fd00::1",
            "fe80::1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
            "2001:db8::1",
            "ff02::1",
        ] {
            assert!(!is_global(ip.parse().unwrap()), "{ip}");
        }
    }

    #[tokio::test]
    async fn a_registry_on_a_private_address_is_refused_unless_named() {
        let global = Reach::Global { except: vec![] };
        let err = check("127.0.0.1:5000", &global, 443).await.unwrap_err();
        assert!(
            matches!(&err, Error::NotGlobal { registry, address }
                if registry == "127.0.0.1:5000" && address.is_loopback()),
            "{err}"
        );
        assert!(err.to_string().contains("127.0.0.1:5000"), "{err}");
        let err = check("localhost:5000", &global, 443).await.unwrap_err();
        assert!(matches!(err, Error::NotGlobal { .. }), "{err}");
        let err = check("[::ffff:169.254.169.254]", &global, 443)
            .await
            .unwrap_err();
        assert!(matches!(err, Error::NotGlobal { .. }), "{err}");
        // Named by the operator, or no policy at all: allowed.
        let named = Reach::Global {
            except: vec!["LOCALHOST:5000".into()],
        };
        check("localhost:5000", &named, 443).await.unwrap();
        check("127.0.0.1:5000", &Reach::Any, 443).await.unwrap();
        // A global address passes (no lookup: it is one).
        check("1.1.1.1", &global, 443).await.unwrap();
    }
}
