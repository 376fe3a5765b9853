//! Sandbox networking in the service, when `ServiceConfig::net` is set:
//! every Linux sandbox's VMM gets virtio-net on `tap0` in a namespace of
//! its own (see `crate::net`), made when its VMM starts (create, wake,
//! restore), removed when the VMM stops (hibernate, delete, exit), kept
//! for VMMs a restarted service re-attaches to. A Linux template boots
//! with a network too (the device must be in its snapshot), in a
//! namespace of its own removed after the snapshot.

use std::sync::Arc;

use torpor_sync::Locked;
use torpor_vmm_api::{NetSpec, RateLimit};

use super::{Service, ServiceError};
use crate::model::{Sandbox, SandboxId, SandboxNetwork};
use crate::net::{EgressPolicy, NetError, PolicyPatch, SandboxNet};
use crate::store::SandboxFilter;

fn net_error(e: NetError) -> ServiceError {
    ServiceError::Internal(format!("sandbox network: {e}"))
}

/// A policy the client gave that does not hold: 400.
fn bad_policy(e: NetError) -> ServiceError {
    ServiceError::Invalid(format!("network: {e}"))
}

/// The manager's key of a template's boot network.
fn template_key(template: &str) -> String {
    format!("template-{template}")
}

impl Service {
    /// The sandbox's network for its VMM (made if it has none yet), or
    /// `None` when the service runs without networking.
    pub(super) fn sandbox_net_spec(&self, id: &SandboxId) -> Result<Option<NetSpec>, ServiceError> {
        let Some(manager) = &self.net else {
            return Ok(None);
        };
        let mut nets = self.nets.locked();
        let net = match nets.get(id) {
            Some(net) => net.clone(),
            None => {
                let net = manager
                    .create(id.as_str(), &self.stored_policy(id)?)
                    .map_err(net_error)?;
                nets.insert(id.clone(), net.clone());
                net
            }
        };
        Ok(Some(
            net.net_spec(RateLimit::default(), RateLimit::default()),
        ))
    }

    /// The sandbox's stored policy (the pod default for sandboxes made
    /// before networking was turned on), narrowed to the pod's policy as
    /// it is now (an operator who closes the pod closes stored sandboxes
    /// too).
    fn stored_policy(&self, id: &SandboxId) -> Result<EgressPolicy, ServiceError> {
        let ceiling = self.default_egress();
        Ok(self
            .store
            .get_sandbox_network(id)?
            .map(|n| n.policy.within(&ceiling))
            .unwrap_or(ceiling))
    }

    /// A new sandbox's network: the pod default with the request's
    /// changes, narrowed to the pod default (a tenant can only narrow it); `None` on a pod without networking (where a policy in the
    /// request is refused rather than silently ignored).
    pub(super) fn initial_network(
        &self,
        patch: Option<&PolicyPatch>,
    ) -> Result<Option<SandboxNetwork>, ServiceError> {
        if self.net.is_none() {
            if patch.is_some_and(|p| !p.is_empty()) {
                return Err(ServiceError::HostUnsupported(
                    "this pod runs without sandbox networking (serve --sandbox-network): \
                     a network policy cannot be set"
                        .into(),
                ));
            }
            return Ok(None);
        }
        let base = self.default_egress();
        let policy = match patch {
            Some(p) => p.apply_within(&base, &base).map_err(bad_policy)?,
            None => base,
        };
        Ok(Some(SandboxNetwork {
            policy,
            ports: Vec::new(),
            address: None,
            counters: None,
        }))
    }

    /// Fills what the host knows of the sandbox's network: its address
    /// and counters, while its network is up.
    pub(super) fn read_network(&self, sandbox: &mut Sandbox) {
        let (Some(manager), Some(network)) = (&self.net, sandbox.network.as_mut()) else {
            return;
        };
        let net = self.nets.locked().get(&sandbox.id).cloned();
        if let Some(net) = net {
            network.address = Some(net.sandbox_addr);
            match manager.counters(&net) {
                Ok(c) => network.counters = Some(c),
                Err(e) => tracing::warn!(sandbox = %sandbox.id, "network counters: {e}"),
            }
        }
    }

    /// Changes the sandbox's egress policy, narrowed to the pod's (the
    /// operator's policy is a ceiling: see `EgressPolicy::within`; stored,
    /// and applied at once if
    /// its network is up; a hibernated sandbox gets it when it wakes).
    pub fn set_network_policy(
        &self,
        id: &SandboxId,
        patch: &PolicyPatch,
    ) -> Result<Sandbox, ServiceError> {
        let Some(manager) = &self.net else {
            return Err(ServiceError::HostUnsupported(
                "this pod runs without sandbox networking (serve --sandbox-network)".into(),
            ));
        };
        let _guard = self.lock_sandbox(id)?;
        let sandbox = self.store.get_sandbox(id)?;
        if sandbox.state == crate::state::SandboxState::Deleted {
            return Err(ServiceError::NotFound {
                kind: "sandbox",
                id: id.to_string(),
            });
        }
        let mut network = sandbox.network.unwrap_or(SandboxNetwork {
            policy: self.default_egress(),
            ports: Vec::new(),
            address: None,
            counters: None,
        });
        network.policy = patch
            .apply_within(&network.policy, &self.default_egress())
            .map_err(bad_policy)?;
        self.store.set_sandbox_network(id, &network)?;
        let net = self.nets.locked().get(id).cloned();
        if let Some(net) = net {
            manager
                .set_policy(&net, &network.policy)
                .map_err(net_error)?;
        }
        drop(_guard);
        self.get_sandbox(id)
    }

    /// Per-sandbox traffic in the Prometheus text (counters restart when a
    /// sandbox's network is made again, on wake).
    pub(super) fn network_metrics(&self, reg: &mut prometheus_client::registry::Registry) {
        let Some(manager) = &self.net else { return };
        let mut nets: Vec<SandboxNet> = self.nets.locked().values().cloned().collect();
        nets.sort_by(|a, b| a.sandbox.cmp(&b.sandbox));
        let refs: Vec<&SandboxNet> = nets.iter().collect();
        let counters = match manager.counters_of(&refs) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("network counters: {e}");
                return;
            }
        };
        type Pick = fn(&crate::net::NetCounters) -> u64;
        let series: [(&str, &str, Pick); 5] = [
            (
                "torpor_sandbox_net_tx_bytes",
                "Bytes the sandbox sent",
                |c| c.tx_bytes,
            ),
            (
                "torpor_sandbox_net_tx_packets",
                "Packets the sandbox sent",
                |c| c.tx_packets,
            ),
            (
                "torpor_sandbox_net_rx_bytes",
                "Bytes the sandbox received",
                |c| c.rx_bytes,
            ),
            (
                "torpor_sandbox_net_rx_packets",
                "Packets the sandbox received",
                |c| c.rx_packets,
            ),
            (
                "torpor_sandbox_net_policy_dropped_packets",
                "Packets from the sandbox its egress policy dropped",
                |c| c.dropped_packets,
            ),
        ];
        // Counters (`_total` added by the encoder), by sandbox.
        for (name, help, pick) in series {
            let family = prometheus_client::metrics::family::Family::<
                [(&'static str, String); 1],
                prometheus_client::metrics::counter::Counter,
            >::default();
            for (net, c) in nets.iter().zip(&counters) {
                family
                    .get_or_create(&[("sandbox", net.sandbox.to_string())])
                    .inc_by(pick(c));
            }
            reg.register(name, help, family);
        }
    }

    /// Starts the pod's DNS forwarder (`config.net.dns`).
    pub(super) fn start_dns(&self) -> Result<(), ServiceError> {
        let (Some(manager), Some(dns)) = (
            &self.net,
            self.config.net.as_ref().and_then(|n| n.dns.clone()),
        ) else {
            return Ok(());
        };
        let forwarder =
            crate::net::dns::Forwarder::start(Arc::clone(manager), dns).map_err(net_error)?;
        *self.dns.locked() = Some(forwarder);
        Ok(())
    }

    fn default_egress(&self) -> EgressPolicy {
        self.config
            .net
            .as_ref()
            .map(|n| n.egress.clone())
            .unwrap_or_default()
    }

    /// Removes the sandbox's network, if it has one (its VMM is gone).
    pub(super) fn drop_sandbox_net(&self, id: &SandboxId) {
        let (Some(manager), Some(net)) = (&self.net, self.nets.locked().remove(id)) else {
            return;
        };
        if let Err(e) = manager.delete(&net) {
            tracing::warn!(sandbox = %id, "cannot remove the sandbox's network: {e}");
        }
    }

    /// A network for booting template `template`, to remove with
    /// [`Service::drop_template_net`] once it is snapshotted.
    pub(super) fn template_net(&self, template: &str) -> Result<Option<SandboxNet>, ServiceError> {
        match &self.net {
            None => Ok(None),
            Some(manager) => manager
                .create(&template_key(template), &self.default_egress())
                .map(Some)
                .map_err(net_error),
        }
    }

    pub(super) fn drop_template_net(&self, net: Option<SandboxNet>) {
        if let (Some(manager), Some(net)) = (&self.net, net) {
            if let Err(e) = manager.delete(&net) {
                tracing::warn!(template = %net.sandbox, "cannot remove the boot network: {e}");
            }
        }
    }

    /// After recovery: keeps the networks of sandboxes whose VMMs were
    /// re-attached, removes every other one (a kill -9 leaks nothing).
    pub(super) fn adopt_networks(&self) -> Result<(), ServiceError> {
        let Some(manager) = &self.net else {
            return Ok(());
        };
        let running: Vec<SandboxId> = self
            .store
            .list_sandboxes(&SandboxFilter::default())?
            .into_iter()
            .filter(|s| s.vmm.is_some())
            .map(|s| s.id)
            .collect();
        let kept = manager
            .adopt(&|id| running.iter().any(|r| r.as_str() == id))
            .map_err(net_error)?;
        for net in kept {
            let id = SandboxId::new(net.sandbox.clone());
            // The manager learns the policy back (for the DNS forwarder).
            manager
                .set_policy(&net, &self.stored_policy(&id)?)
                .map_err(net_error)?;
            self.nets.locked().insert(id, net);
        }
        Ok(())
    }
}
