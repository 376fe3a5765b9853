//! The virtio devices of one VM on virtio-mmio: built at boot, saved with
//! snapshots, restored into clones. What differs between devices is in
//! each device's folder (its [`VirtioKind`]); [`KINDS`] lists them.

use std::any::Any;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use torpor_sync::Locked as _;
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use crate::devices::balloon::BalloonKind;
use crate::devices::block::BlockKind;
use crate::devices::kind::{PathNeeded, VirtioKind};
use crate::devices::net::NetKind;
use crate::devices::pausable::{Pausable, PauseError};
use crate::devices::virtio::{
    MmioBus, MmioBusError, MmioRestoreArgs, MmioSlot, MmioTransport, VirtioError,
};
use crate::devices::vsock::VsockKind;
use crate::devices::worker::{DeviceWorker, WorkerError};
use crate::snapshot::PageRuns;
use crate::snapshot::Persist;
use crate::vstate::vm::{Vm, VmError};

pub use crate::devices::block::{DiskConfig, OVERLAY_FILE};
pub use crate::devices::kind::{VirtioConfig, VirtioRestorePaths, VirtioStates};

/// Every kind of virtio device, in the order they are built, started and
/// saved. A new device: its folder under `devices/` with a [`VirtioKind`],
/// and a line here.
const KINDS: &[&dyn Kind] = &[&BlockKind, &VsockKind, &NetKind, &BalloonKind];

/// Errors of the virtio devices.
#[derive(Debug, thiserror::Error)]
pub enum VirtioDevicesError {
    #[error(transparent)]
    Virtio(#[from] VirtioError),
    #[error(transparent)]
    Bus(#[from] MmioBusError),
    /// A device's own error; `kind` is its [`VirtioKind::NAME`].
    #[error("{kind}: {source}")]
    Device {
        kind: &'static str,
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("this VM has no balloon device")]
    NoBalloon,
    #[error(transparent)]
    Worker(#[from] WorkerError),
    #[error(transparent)]
    Vm(#[from] VmError),
    #[error("cannot create an eventfd: {0}")]
    EventFd(std::io::Error),
    #[error(transparent)]
    PathNeeded(#[from] PathNeeded),
    #[error(transparent)]
    Pause(#[from] PauseError),
}

impl VirtioDevicesError {
    /// The device error of kind `K` this is, if it is one.
    pub fn device<K: VirtioKind>(&self) -> Option<&K::Error> {
        match self {
            Self::Device { kind, source } if *kind == K::NAME => source.downcast_ref(),
            _ => None,
        }
    }
}

fn device_error<K: VirtioKind>(e: K::Error) -> VirtioDevicesError {
    VirtioDevicesError::Device {
        kind: K::NAME,
        source: Box::new(e),
    }
}

/// The devices, their MMIO bus, and the device threads once started.
#[derive(Default, Debug)]
pub struct VirtioDevices {
    pub mmio: Arc<MmioBus>,
    /// In [`KINDS`] order.
    devices: Vec<Box<dyn Attached>>,
    workers: Mutex<Vec<DeviceWorker>>,
}

fn irq_for(vm: &Vm, slot: &MmioSlot) -> Result<EventFd, VirtioDevicesError> {
    let irq = EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)
        .map_err(VirtioDevicesError::EventFd)?;
    vm.register_irqfd(&irq, slot.irq)?;
    Ok(irq)
}

/// A [`VirtioKind`] as a value, so that [`KINDS`] can list them.
trait Kind: Sync {
    /// Its device on `bus` for a cold boot, if `config` asks for one.
    fn build(
        &self,
        vm: &Vm,
        mem: &GuestMemoryMmap,
        config: &VirtioConfig,
        bus: &mut MmioBus,
    ) -> Result<Option<Box<dyn Attached>>, VirtioDevicesError>;

    /// Its saved device on `bus`, at its saved slot, if one was saved.
    fn restore(
        &self,
        vm: &Vm,
        mem: &GuestMemoryMmap,
        states: &VirtioStates,
        paths: &VirtioRestorePaths,
        bus: &mut MmioBus,
    ) -> Result<Option<Box<dyn Attached>>, VirtioDevicesError>;

    /// Its slot and name, for the tests.
    #[cfg(test)]
    fn id(&self) -> (usize, &'static str);
}

impl<K: VirtioKind + Sync> Kind for K {
    fn build(
        &self,
        vm: &Vm,
        mem: &GuestMemoryMmap,
        config: &VirtioConfig,
        bus: &mut MmioBus,
    ) -> Result<Option<Box<dyn Attached>>, VirtioDevicesError> {
        let Some(dev) = K::build(config, mem).map_err(device_error::<K>)? else {
            return Ok(None);
        };
        let slot = MmioSlot::nth(K::SLOT)?;
        let transport = MmioTransport::new(dev, mem.clone(), irq_for(vm, &slot)?)?;
        Ok(Some(Box::new(Plugged::<K>::insert(slot, transport, bus)?)))
    }

    fn restore(
        &self,
        vm: &Vm,
        mem: &GuestMemoryMmap,
        states: &VirtioStates,
        paths: &VirtioRestorePaths,
        bus: &mut MmioBus,
    ) -> Result<Option<Box<dyn Attached>>, VirtioDevicesError> {
        let Some((slot, state)) = K::saved(states) else {
            return Ok(None);
        };
        let device = K::restore_args(paths)?;
        let args = MmioRestoreArgs {
            mem: mem.clone(),
            irq: irq_for(vm, slot)?,
            device,
        };
        let transport = MmioTransport::restore(args, state)?;
        Ok(Some(Box::new(Plugged::<K>::insert(*slot, transport, bus)?)))
    }

    #[cfg(test)]
    fn id(&self) -> (usize, &'static str) {
        (K::SLOT, K::NAME)
    }
}

/// A device of kind `K` on the bus.
struct Plugged<K: VirtioKind> {
    slot: MmioSlot,
    transport: Arc<Mutex<MmioTransport<K::Device>>>,
}

impl<K: VirtioKind> Plugged<K> {
    fn insert(
        slot: MmioSlot,
        transport: MmioTransport<K::Device>,
        bus: &mut MmioBus,
    ) -> Result<Self, MmioBusError> {
        let transport = Arc::new(Mutex::new(transport));
        bus.insert(slot.base, slot.size, transport.clone())?;
        Ok(Self { slot, transport })
    }
}

impl<K: VirtioKind> std::fmt::Debug for Plugged<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(K::NAME)
            .field("slot", &self.slot)
            .finish_non_exhaustive()
    }
}

/// A device on the bus, whatever its kind.
trait Attached: Send + Sync + std::fmt::Debug {
    fn slot(&self) -> MmioSlot;
    /// Starts its thread, if it has one.
    fn start(&self, paused: bool) -> Option<Result<DeviceWorker, WorkerError>>;
    /// Holds its transport's lock (see [`VirtioDevices::save`]).
    fn lock(&self) -> Box<dyn Held + '_>;
    /// For [`VirtioDevices::find`].
    fn as_any(&self) -> &dyn Any;
}

impl<K: VirtioKind> Attached for Plugged<K> {
    fn slot(&self) -> MmioSlot {
        self.slot
    }

    fn start(&self, paused: bool) -> Option<Result<DeviceWorker, WorkerError>> {
        K::worker(&self.transport, paused)
    }

    fn lock(&self) -> Box<dyn Held + '_> {
        Box::new(Locked::<K> {
            slot: self.slot,
            transport: self.transport.locked(),
        })
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A device whose transport lock is held.
trait Held {
    /// Puts its state into `states` (and beside them into `dir`); returns
    /// the pages it wrote since the last snapshot.
    fn save(
        &mut self,
        states: &mut VirtioStates,
        dir: &Path,
    ) -> Result<PageRuns, VirtioDevicesError>;
}

struct Locked<'a, K: VirtioKind> {
    slot: MmioSlot,
    transport: MutexGuard<'a, MmioTransport<K::Device>>,
}

impl<K: VirtioKind> Held for Locked<'_, K> {
    fn save(
        &mut self,
        states: &mut VirtioStates,
        dir: &Path,
    ) -> Result<PageRuns, VirtioDevicesError> {
        let mut state = self.transport.save();
        K::freeze(&mut state.device, dir).map_err(device_error::<K>)?;
        let dirty = self.transport.take_dirty_pages();
        *K::saved_mut(states) = Some((self.slot, state));
        Ok(dirty)
    }
}

impl VirtioDevices {
    /// Builds the devices of a cold boot; returns them and the kernel
    /// command line words that tell Linux where they are.
    pub fn build(
        vm: &Vm,
        mem: &GuestMemoryMmap,
        config: &VirtioConfig,
    ) -> Result<(Self, String), VirtioDevicesError> {
        let mut bus = MmioBus::default();
        let mut cmdline = String::new();
        let mut devices = VirtioDevices::default();
        for kind in KINDS {
            if let Some(device) = kind.build(vm, mem, config, &mut bus)? {
                cmdline.push(' ');
                cmdline.push_str(&device.slot().cmdline());
                devices.devices.push(device);
            }
        }
        devices.mmio = Arc::new(bus);
        Ok((devices, cmdline))
    }

    /// Rebuilds saved devices for a clone, at the same slots, with the
    /// clone's own overlay and vsock socket. Touches no guest memory.
    pub fn restore(
        vm: &Vm,
        mem: &GuestMemoryMmap,
        states: &VirtioStates,
        paths: &VirtioRestorePaths,
    ) -> Result<Self, VirtioDevicesError> {
        let mut bus = MmioBus::default();
        let mut devices = VirtioDevices::default();
        for kind in KINDS {
            if let Some(device) = kind.restore(vm, mem, states, paths, &mut bus)? {
                devices.devices.push(device);
            }
        }
        devices.mmio = Arc::new(bus);
        Ok(devices)
    }

    /// Starts the device threads (vsock, net, balloon) once guest memory
    /// can be touched, parked if `paused` (a VM whose vCPUs start paused).
    pub fn start(&self, paused: bool) -> Result<(), VirtioDevicesError> {
        let mut workers = self.workers.locked();
        for device in &self.devices {
            if let Some(worker) = device.start(paused) {
                workers.push(worker?);
            }
        }
        Ok(())
    }

    /// True when no device thread runs (all parked, or none): the devices
    /// touch neither guest memory nor interrupts.
    pub fn is_paused(&self) -> bool {
        self.workers.locked().iter().all(DeviceWorker::is_paused)
    }

    /// The transport of this VM's device of kind `K`, if it has one.
    fn find<K: VirtioKind>(&self) -> Option<&Arc<Mutex<MmioTransport<K::Device>>>> {
        self.devices
            .iter()
            .find_map(|d| d.as_any().downcast_ref::<Plugged<K>>())
            .map(|p| &p.transport)
    }

    /// The net device's counters, if the VM has one.
    pub fn net_metrics(&self) -> Option<crate::devices::net::NetMetrics> {
        self.find::<NetKind>()
            .map(|t| t.locked().device().metrics())
    }

    /// Sets the balloon's target; see [`balloon_status`](Self::balloon_status).
    pub fn set_balloon(
        &self,
        target_mib: u64,
    ) -> Result<torpor_vmm_api::control::BalloonStatus, VirtioDevicesError> {
        let t = self
            .find::<BalloonKind>()
            .ok_or(VirtioDevicesError::NoBalloon)?;
        let mut t = t.locked();
        crate::devices::balloon::set_target(&mut t, target_mib)
            .map_err(device_error::<BalloonKind>)?;
        Ok(t.device_mut().status())
    }

    /// The balloon's state (and a request for fresh guest statistics).
    pub fn balloon_status(
        &self,
    ) -> Result<torpor_vmm_api::control::BalloonStatus, VirtioDevicesError> {
        let t = self
            .find::<BalloonKind>()
            .ok_or(VirtioDevicesError::NoBalloon)?;
        Ok(t.locked().device_mut().status())
    }

    /// Saves every device (vCPUs and devices paused); each kind puts what
    /// goes beside its state into `dir` (virtio-blk its frozen overlay);
    /// returns the state and the pages the devices wrote since the last
    /// snapshot (KVM's dirty log does not see them).
    pub fn save(&self, dir: &Path) -> Result<(VirtioStates, PageRuns), VirtioDevicesError> {
        let mut states = VirtioStates::default();
        let mut dirty = PageRuns::default();
        // The device threads are paused; holding every lock keeps even a
        // running one off guest memory while the state is taken.
        let mut held: Vec<_> = self.devices.iter().map(|d| d.lock()).collect();
        for device in &mut held {
            dirty = dirty.union(&device.save(&mut states, dir)?);
        }
        Ok((states, dirty))
    }
}

/// Pauses the device threads. virtio-blk has none: it serves requests on
/// the vCPU thread that notified it, so paused vCPUs stop it.
impl Pausable for VirtioDevices {
    type Error = VirtioDevicesError;

    /// Pauses every thread; if one cannot be paused, those already
    /// paused run on again (nothing is left half paused).
    fn pause(&self) -> Result<(), VirtioDevicesError> {
        let workers = self.workers.locked();
        for (i, worker) in workers.iter().enumerate() {
            if let Err(e) = worker.pause() {
                for w in &workers[..i] {
                    let _ = w.resume();
                }
                return Err(e.into());
            }
        }
        Ok(())
    }

    fn resume(&self) -> Result<(), VirtioDevicesError> {
        for worker in self.workers.locked().iter() {
            worker.resume()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::testutil::guest_mem;
    use crate::devices::vsock::{VsockConfig, VsockDevice, VsockMmio};

    /// Slots and names are each kind's own.
    #[test]
    fn kinds_have_distinct_slots_and_names() {
        let ids: Vec<_> = KINDS.iter().map(|k| k.id()).collect();
        for (i, (slot, name)) in ids.iter().enumerate() {
            assert!(ids[..i].iter().all(|(s, _)| s != slot), "slot {slot} twice");
            assert!(ids[..i].iter().all(|(_, n)| n != name), "{name} twice");
            MmioSlot::nth(*slot).unwrap();
        }
        assert_eq!(ids.len(), 4);
    }

    /// The balloon requests find the balloon among the devices, and a
    /// refusal stays the balloon's own error (the control API tells a
    /// target past guest memory from an internal failure by it).
    #[test]
    fn balloon_requests_reach_the_balloon() {
        use crate::devices::balloon::{BalloonDevice, BalloonError, BalloonMmio};
        let none = VirtioDevices::default();
        assert!(matches!(
            none.balloon_status(),
            Err(VirtioDevicesError::NoBalloon)
        ));
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let dev = BalloonDevice::new(1 << 20).unwrap();
        let t = BalloonMmio::new(dev, guest_mem(1 << 20), irq).unwrap();
        let devices = VirtioDevices {
            devices: vec![Box::new(Plugged::<BalloonKind> {
                slot: MmioSlot::nth(BalloonKind::SLOT).unwrap(),
                transport: Arc::new(Mutex::new(t)),
            })],
            ..Default::default()
        };
        assert!(devices.net_metrics().is_none());
        devices.set_balloon(0).unwrap();
        let e = devices.set_balloon(1 << 20).unwrap_err();
        assert!(
            matches!(
                e.device::<BalloonKind>(),
                Some(BalloonError::TargetTooLarge(_))
            ),
            "{e:?}"
        );
        assert!(e.device::<NetKind>().is_none());
        assert!(e.to_string().starts_with("virtio-balloon: "), "{e}");
    }

    #[test]
    fn pause_and_resume_reach_the_vsock_thread() {
        let dir = tempfile::tempdir().unwrap();
        let dev = VsockDevice::new(&VsockConfig::new(dir.path().join("v.sock"))).unwrap();
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let t = VsockMmio::new(dev, guest_mem(1 << 20), irq).unwrap();
        let slot = MmioSlot::nth(VsockKind::SLOT).unwrap();
        let devices = VirtioDevices {
            devices: vec![Box::new(Plugged::<VsockKind> {
                slot,
                transport: Arc::new(Mutex::new(t)),
            })],
            ..Default::default()
        };
        assert!(devices.is_paused(), "no thread runs before start");
        devices.pause().unwrap();
        devices.start(true).unwrap();
        devices.pause().unwrap();
        assert!(devices.is_paused(), "started parked");
        devices.resume().unwrap();
        assert!(!devices.is_paused());
        devices.pause().unwrap();
        assert!(devices.is_paused());
        devices.resume().unwrap();
        assert!(!devices.is_paused());
    }
}
