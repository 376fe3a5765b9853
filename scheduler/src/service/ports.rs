//! Exposed ports in the service (`POST /v1/sandboxes/{id}/ports`): each
//! is a listener of the pod's [`PortProxy`], stored with the sandbox's
//! network so that a restarted service listens again (on the same host
//! port when it is free), and closed when the sandbox is deleted. A
//! connection to the port of a hibernated sandbox wakes it ([`Waker`]).

use std::net::SocketAddrV4;
use std::sync::Weak;

use torpor_sync::Locked;

use super::{Service, ServiceError};
use crate::model::{ExposedPort, Sandbox, SandboxId, SandboxNetwork};
use crate::net::ports::{PortError, PortTarget};
use crate::state::SandboxState;
use crate::store::SandboxFilter;

/// Admission of a wake that no API request carries: a connection to an
/// exposed port of a hibernated sandbox. The API's gate installs one
/// ([`Service::set_wake_gate`]) that admits it against the sandbox's
/// tenant's quotas, as a resume through the API is.
pub trait WakeGate: Send + Sync + std::fmt::Debug {
    /// Admits waking `sandbox` (hibernated); what it returns holds the
    /// admission until the wake is done. A refusal leaves it hibernated.
    fn admit_wake(
        &self,
        service: &Service,
        sandbox: &Sandbox,
    ) -> Result<Box<dyn std::any::Any + Send>, ServiceError>;
}

impl Service {
    /// Installs the admission of port-traffic wakes (once; later calls
    /// are ignored).
    pub fn set_wake_gate(&self, gate: std::sync::Arc<dyn WakeGate>) {
        let _ = self.wake_gate.set(gate);
    }
}

/// Where a sandbox's guest port is now: wakes the sandbox first (a client
/// connecting counts as activity, like E2B's `connect`), admitted by the
/// [`WakeGate`] if it is hibernated.
pub(super) struct Waker(pub(super) Weak<Service>);

impl PortTarget for Waker {
    fn target(&self, sandbox: &str, guest_port: u16) -> Result<SocketAddrV4, String> {
        let service = self.0.upgrade().ok_or("the service is stopping")?;
        let id = SandboxId::new(sandbox);
        let _admitted = match (service.wake_gate.get(), service.get_sandbox(&id)) {
            (Some(gate), Ok(s)) if s.state == SandboxState::Hibernated => Some(
                gate.admit_wake(&service, &s)
                    .map_err(|e| format!("the wake is not admitted: {e}"))?,
            ),
            _ => None,
        };
        service.connect(&id).map_err(|e| e.to_string())?;
        let net = service.nets.locked().get(&id).cloned();
        net.map(|n| SocketAddrV4::new(n.sandbox_addr, guest_port))
            .ok_or_else(|| format!("sandbox {id} runs without a network device"))
    }
}

fn port_error(e: PortError) -> ServiceError {
    match e {
        PortError::Exists(_) => ServiceError::ResourceConflict(e.to_string()),
        PortError::NotExposed(p) => ServiceError::NotFound {
            kind: "exposed port",
            id: p.to_string(),
        },
        PortError::BadPort | PortError::TooMany => ServiceError::Invalid(e.to_string()),
        PortError::Listen(_) => ServiceError::Internal(e.to_string()),
    }
}

fn no_networking() -> ServiceError {
    ServiceError::HostUnsupported(
        "this pod runs without sandbox networking (serve --sandbox-network): no exposed ports"
            .into(),
    )
}

impl Service {
    fn live_sandbox(&self, id: &SandboxId) -> Result<Sandbox, ServiceError> {
        let sandbox = self.store.get_sandbox(id)?;
        if sandbox.state == SandboxState::Deleted {
            return Err(ServiceError::NotFound {
                kind: "sandbox",
                id: id.to_string(),
            });
        }
        Ok(sandbox)
    }

    fn network_of(&self, sandbox: &Sandbox) -> SandboxNetwork {
        sandbox.network.clone().unwrap_or_else(|| SandboxNetwork {
            policy: self
                .config
                .net
                .as_ref()
                .map(|n| n.egress.clone())
                .unwrap_or_default(),
            ports: Vec::new(),
            address: None,
            counters: None,
        })
    }

    /// Exposes the sandbox's `guest_port` on a free port of the pod.
    pub fn expose_port(
        &self,
        id: &SandboxId,
        guest_port: u16,
    ) -> Result<ExposedPort, ServiceError> {
        let proxy = self.ports.as_ref().ok_or_else(no_networking)?;
        let _guard = self.lock_sandbox(id)?;
        let sandbox = self.live_sandbox(id)?;
        let mut network = self.network_of(&sandbox);
        let addr = proxy
            .expose(id.as_str(), guest_port, 0)
            .map_err(port_error)?;
        let port = ExposedPort {
            guest_port,
            address: addr.to_string(),
        };
        network.ports.retain(|p| p.guest_port != guest_port);
        network.ports.push(port.clone());
        network.ports.sort_by_key(|p| p.guest_port);
        if let Err(e) = self.store.set_sandbox_network(id, &network) {
            let _ = proxy.unexpose(id.as_str(), guest_port);
            return Err(e.into());
        }
        Ok(port)
    }

    /// The sandbox's exposed ports.
    pub fn list_ports(&self, id: &SandboxId) -> Result<Vec<ExposedPort>, ServiceError> {
        let sandbox = self.live_sandbox(id)?;
        Ok(sandbox.network.map(|n| n.ports).unwrap_or_default())
    }

    /// Stops exposing the sandbox's `guest_port`.
    pub fn unexpose_port(&self, id: &SandboxId, guest_port: u16) -> Result<(), ServiceError> {
        let proxy = self.ports.as_ref().ok_or_else(no_networking)?;
        let _guard = self.lock_sandbox(id)?;
        let sandbox = self.live_sandbox(id)?;
        let mut network = self.network_of(&sandbox);
        if !network.ports.iter().any(|p| p.guest_port == guest_port) {
            return Err(port_error(PortError::NotExposed(guest_port)));
        }
        network.ports.retain(|p| p.guest_port != guest_port);
        self.store.set_sandbox_network(id, &network)?;
        match proxy.unexpose(id.as_str(), guest_port) {
            Ok(()) | Err(PortError::NotExposed(_)) => Ok(()),
            Err(e) => Err(port_error(e)),
        }
    }

    /// The sandbox is deleted: its ports close and are forgotten.
    pub(super) fn close_ports(&self, sandbox: &Sandbox) {
        let Some(proxy) = &self.ports else { return };
        proxy.unexpose_all(sandbox.id.as_str());
        if let Some(mut network) = sandbox.network.clone().filter(|n| !n.ports.is_empty()) {
            network.ports.clear();
            if let Err(e) = self.store.set_sandbox_network(&sandbox.id, &network) {
                tracing::warn!(sandbox = %sandbox.id, "cannot forget its exposed ports: {e}");
            }
        }
    }

    /// At open: listens again for every stored port of every sandbox not
    /// deleted, on its old host port if that is free (else on a new one,
    /// stored).
    pub(super) fn restore_ports(&self) -> Result<(), ServiceError> {
        let Some(proxy) = &self.ports else {
            return Ok(());
        };
        for sandbox in self.store.list_sandboxes(&SandboxFilter::default())? {
            let Some(mut network) = sandbox.network.clone() else {
                continue;
            };
            if sandbox.state == SandboxState::Deleted || network.ports.is_empty() {
                continue;
            }
            let mut changed = false;
            for port in network.ports.iter_mut() {
                let old = port
                    .address
                    .parse::<std::net::SocketAddr>()
                    .map(|a| a.port())
                    .unwrap_or(0);
                let id = sandbox.id.as_str();
                let addr = match proxy.expose(id, port.guest_port, old) {
                    Ok(a) => a,
                    Err(PortError::Listen(_)) if old != 0 => {
                        proxy.expose(id, port.guest_port, 0).map_err(port_error)?
                    }
                    Err(e) => return Err(port_error(e)),
                };
                if addr.to_string() != port.address {
                    port.address = addr.to_string();
                    changed = true;
                }
            }
            if changed {
                self.store.set_sandbox_network(&sandbox.id, &network)?;
            }
        }
        Ok(())
    }
}
