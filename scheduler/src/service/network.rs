//! Sandbox networking in the service, when `ServiceConfig::net` is set:
//! every Linux sandbox's VMM gets virtio-net on `tap0` in a namespace of
//! its own (see `crate::net`), made when its VMM starts (create, wake,
//! restore), removed when the VMM stops (hibernate, delete, exit), kept
//! for VMMs a restarted service re-attaches to. A Linux template boots
//! with a network too (the device must be in its snapshot), in a
//! namespace of its own removed after the snapshot.

use torpor_vmm_api::{NetSpec, RateLimit};

use super::{Service, ServiceError};
use crate::model::SandboxId;
use crate::net::{EgressPolicy, NetError, SandboxNet};
use crate::store::SandboxFilter;

fn net_error(e: NetError) -> ServiceError {
    ServiceError::Internal(format!("sandbox network: {e}"))
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
        let mut nets = self.nets.lock().unwrap_or_else(|e| e.into_inner());
        let net = match nets.get(id) {
            Some(net) => net.clone(),
            None => {
                let net = manager
                    .create(id.as_str(), &self.default_egress())
                    .map_err(net_error)?;
                nets.insert(id.clone(), net.clone());
                net
            }
        };
        Ok(Some(
            net.net_spec(RateLimit::default(), RateLimit::default()),
        ))
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
        let (Some(manager), Some(net)) = (
            &self.net,
            self.nets
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(id),
        ) else {
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
        let mut nets = self.nets.lock().unwrap_or_else(|e| e.into_inner());
        for net in kept {
            nets.insert(SandboxId::new(net.sandbox.clone()), net);
        }
        Ok(())
    }
}
