//! The virtio devices of one VM (virtio-blk, virtio-vsock, virtio-net,
//! virtio-balloon on virtio-mmio):
//! built at boot, saved with snapshots, restored into clones.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use torpor_sync::Locked;
use torpor_vmm_api::launch::NetSpec;
use vm_memory::{GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};
use vmm_sys_util::eventfd::EventFd;

use crate::devices::balloon::{
    BalloonDevice, BalloonError, BalloonMmio, BalloonRestoreArgs, BalloonState,
};
use crate::devices::block::{
    BlockConfig, BlockDevice, BlockError, BlockMmio, BlockRestoreArgs, BlockState,
};
use crate::devices::net::{NetDevice, NetError, NetMmio, NetRestoreArgs, NetState};
use crate::devices::pausable::{Pausable, PauseError};
use crate::devices::virtio::{
    MmioBus, MmioBusError, MmioRestoreArgs, MmioSlot, VirtioError, VirtioMmioState,
};
use crate::devices::vsock::{
    VsockConfig, VsockDevice, VsockError, VsockMmio, VsockRestoreArgs, VsockState,
};
use crate::devices::worker::{DeviceWorker, WorkerError};
use crate::persist::Persist;
use crate::snapshot::PageRuns;
use crate::vstate::vm::{Vm, VmError};

/// Slot 0 is the disk (so Linux names it /dev/vda), slot 1 vsock, slot 2
/// the network card (eth0), slot 3 the balloon.
const BLOCK_SLOT: usize = 0;
const VSOCK_SLOT: usize = 1;
const NET_SLOT: usize = 2;
const BALLOON_SLOT: usize = 3;
/// Name of the frozen disk overlay inside a snapshot directory.
pub const OVERLAY_FILE: &str = "disk0.overlay";

/// A disk: a base image never written, and this VM's own overlay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskConfig {
    pub image: PathBuf,
    pub overlay: PathBuf,
    pub read_only: bool,
}

/// Which virtio devices a cold boot gets.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VirtioConfig {
    pub disk: Option<DiskConfig>,
    /// Host unix socket of the vsock device (Firecracker's hybrid vsock).
    pub vsock_uds: Option<PathBuf>,
    /// virtio-net on a tap.
    pub net: Option<NetSpec>,
    /// virtio-balloon (free page reporting, statistics, a target).
    pub balloon: bool,
}

/// Where a clone's devices keep their host-side files.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VirtioRestorePaths {
    pub disk_overlay: Option<PathBuf>,
    pub vsock_uds: Option<PathBuf>,
    /// The clone's tap (by name, in its network namespace) and limits;
    /// `None` reopens the saved tap name.
    pub net: Option<NetSpec>,
}

/// Saved virtio state, part of `DeviceStates`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct VirtioStates {
    pub block: Option<(MmioSlot, VirtioMmioState<BlockState>)>,
    pub vsock: Option<(MmioSlot, VirtioMmioState<VsockState>)>,
    pub net: Option<(MmioSlot, VirtioMmioState<NetState>)>,
    pub balloon: Option<(MmioSlot, VirtioMmioState<BalloonState>)>,
}

/// Errors of the virtio devices.
#[derive(Debug, thiserror::Error)]
pub enum VirtioDevicesError {
    #[error(transparent)]
    Virtio(#[from] VirtioError),
    #[error(transparent)]
    Bus(#[from] MmioBusError),
    #[error("virtio-blk: {0}")]
    Block(#[from] BlockError),
    #[error("virtio-vsock: {0}")]
    Vsock(#[from] VsockError),
    #[error("virtio-net: {0}")]
    Net(#[from] NetError),
    #[error("virtio-balloon: {0}")]
    Balloon(#[from] BalloonError),
    #[error("this VM has no balloon device")]
    NoBalloon,
    #[error(transparent)]
    Worker(#[from] WorkerError),
    #[error(transparent)]
    Vm(#[from] VmError),
    #[error("cannot create an eventfd: {0}")]
    EventFd(std::io::Error),
    #[error("a snapshot with a disk needs --disk-overlay for the clone's own overlay")]
    OverlayNeeded,
    #[error(transparent)]
    Pause(#[from] PauseError),
}

/// The devices, their MMIO bus, and the device threads (vsock, net) once
/// started.
#[derive(Default, Debug)]
pub struct VirtioDevices {
    pub mmio: Arc<MmioBus>,
    block: Option<(MmioSlot, Arc<Mutex<BlockMmio>>)>,
    vsock: Option<(MmioSlot, Arc<Mutex<VsockMmio>>)>,
    net: Option<(MmioSlot, Arc<Mutex<NetMmio>>)>,
    balloon: Option<(MmioSlot, Arc<Mutex<BalloonMmio>>)>,
    workers: Mutex<Vec<DeviceWorker>>,
}

fn irq_for(vm: &Vm, slot: &MmioSlot) -> Result<EventFd, VirtioDevicesError> {
    let irq = EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)
        .map_err(VirtioDevicesError::EventFd)?;
    vm.register_irqfd(&irq, slot.irq)?;
    Ok(irq)
}

fn spawn_worker<D: crate::devices::worker::EpollDevice>(
    transport: &Arc<Mutex<crate::devices::virtio::MmioTransport<D>>>,
    paused: bool,
) -> Result<DeviceWorker, WorkerError> {
    if paused {
        DeviceWorker::spawn_paused(transport.clone())
    } else {
        DeviceWorker::spawn(transport.clone())
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
        if let Some(disk) = &config.disk {
            let slot = MmioSlot::nth(BLOCK_SLOT)?;
            let dev = BlockDevice::new(&BlockConfig {
                id: "rootfs".into(),
                base: disk.image.clone(),
                overlay: Some(disk.overlay.clone()),
                read_only: disk.read_only,
            })?;
            let blk = Arc::new(Mutex::new(BlockMmio::new(
                dev,
                mem.clone(),
                irq_for(vm, &slot)?,
            )?));
            bus.insert(slot.base, slot.size, blk.clone())?;
            cmdline.push(' ');
            cmdline.push_str(&slot.cmdline());
            devices.block = Some((slot, blk));
        }
        if let Some(uds) = &config.vsock_uds {
            let slot = MmioSlot::nth(VSOCK_SLOT)?;
            let dev = VsockDevice::new(&VsockConfig::new(uds.clone()))?;
            let vsock = Arc::new(Mutex::new(VsockMmio::new(
                dev,
                mem.clone(),
                irq_for(vm, &slot)?,
            )?));
            bus.insert(slot.base, slot.size, vsock.clone())?;
            cmdline.push(' ');
            cmdline.push_str(&slot.cmdline());
            devices.vsock = Some((slot, vsock));
        }
        if let Some(spec) = &config.net {
            let slot = MmioSlot::nth(NET_SLOT)?;
            let dev = NetDevice::new(spec)?;
            let net = Arc::new(Mutex::new(NetMmio::new(
                dev,
                mem.clone(),
                irq_for(vm, &slot)?,
            )?));
            bus.insert(slot.base, slot.size, net.clone())?;
            cmdline.push(' ');
            cmdline.push_str(&slot.cmdline());
            devices.net = Some((slot, net));
        }
        if config.balloon {
            let slot = MmioSlot::nth(BALLOON_SLOT)?;
            let mem_bytes = mem.iter().map(|r| r.len()).sum();
            let balloon = Arc::new(Mutex::new(BalloonMmio::new(
                BalloonDevice::new(mem_bytes)?,
                mem.clone(),
                irq_for(vm, &slot)?,
            )?));
            bus.insert(slot.base, slot.size, balloon.clone())?;
            cmdline.push(' ');
            cmdline.push_str(&slot.cmdline());
            devices.balloon = Some((slot, balloon));
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
        if let Some((slot, state)) = &states.block {
            let overlay = paths
                .disk_overlay
                .clone()
                .ok_or(VirtioDevicesError::OverlayNeeded)?;
            let args = MmioRestoreArgs {
                mem: mem.clone(),
                irq: irq_for(vm, slot)?,
                device: BlockRestoreArgs {
                    overlay_path: Some(overlay),
                    base_path: None,
                },
            };
            let blk = Arc::new(Mutex::new(BlockMmio::restore(args, state)?));
            bus.insert(slot.base, slot.size, blk.clone())?;
            devices.block = Some((*slot, blk));
        }
        if let Some((slot, state)) = &states.vsock {
            let args = MmioRestoreArgs {
                mem: mem.clone(),
                irq: irq_for(vm, slot)?,
                device: VsockRestoreArgs {
                    uds_path: paths.vsock_uds.clone(),
                    cid: None,
                },
            };
            let vsock = Arc::new(Mutex::new(VsockMmio::restore(args, state)?));
            bus.insert(slot.base, slot.size, vsock.clone())?;
            devices.vsock = Some((*slot, vsock));
        }
        if let Some((slot, state)) = &states.net {
            let args = MmioRestoreArgs {
                mem: mem.clone(),
                irq: irq_for(vm, slot)?,
                device: NetRestoreArgs {
                    spec: paths.net.clone(),
                    clock: None,
                },
            };
            let net = Arc::new(Mutex::new(NetMmio::restore(args, state)?));
            bus.insert(slot.base, slot.size, net.clone())?;
            devices.net = Some((*slot, net));
        }
        if let Some((slot, state)) = &states.balloon {
            let args = MmioRestoreArgs {
                mem: mem.clone(),
                irq: irq_for(vm, slot)?,
                device: BalloonRestoreArgs,
            };
            let balloon = Arc::new(Mutex::new(BalloonMmio::restore(args, state)?));
            bus.insert(slot.base, slot.size, balloon.clone())?;
            devices.balloon = Some((*slot, balloon));
        }
        devices.mmio = Arc::new(bus);
        Ok(devices)
    }

    /// Starts the device threads (vsock, net) once guest memory can be
    /// touched, parked if `paused` (a VM whose vCPUs start paused).
    pub fn start(&self, paused: bool) -> Result<(), VirtioDevicesError> {
        let mut workers = self.workers.locked();
        if let Some((_, vsock)) = &self.vsock {
            workers.push(spawn_worker(vsock, paused)?);
        }
        if let Some((_, net)) = &self.net {
            workers.push(spawn_worker(net, paused)?);
        }
        if let Some((_, balloon)) = &self.balloon {
            workers.push(spawn_worker(balloon, paused)?);
        }
        Ok(())
    }

    /// True when no device thread runs (all parked, or none): the devices
    /// touch neither guest memory nor interrupts.
    pub fn is_paused(&self) -> bool {
        self.workers.locked().iter().all(DeviceWorker::is_paused)
    }

    /// The net device's counters, if the VM has one.
    pub fn net_metrics(&self) -> Option<crate::devices::net::NetMetrics> {
        self.net
            .as_ref()
            .map(|(_, t)| t.locked().device().metrics())
    }

    /// Sets the balloon's target; see [`balloon_status`](Self::balloon_status).
    pub fn set_balloon(
        &self,
        target_mib: u64,
    ) -> Result<torpor_vmm_api::control::BalloonStatus, VirtioDevicesError> {
        let (_, t) = self.balloon.as_ref().ok_or(VirtioDevicesError::NoBalloon)?;
        let mut t = t.locked();
        crate::devices::balloon::set_target(&mut t, target_mib)?;
        Ok(t.device_mut().status())
    }

    /// The balloon's state (and a request for fresh guest statistics).
    pub fn balloon_status(
        &self,
    ) -> Result<torpor_vmm_api::control::BalloonStatus, VirtioDevicesError> {
        let (_, t) = self.balloon.as_ref().ok_or(VirtioDevicesError::NoBalloon)?;
        Ok(t.locked().device_mut().status())
    }

    /// Saves every device (vCPUs and devices paused); freezes the disk
    /// overlay into `dir`; returns the state and the pages the devices
    /// wrote since the last snapshot (KVM's dirty log does not see them).
    pub fn save(
        &self,
        dir: &std::path::Path,
    ) -> Result<(VirtioStates, PageRuns), VirtioDevicesError> {
        let mut states = VirtioStates::default();
        let mut dirty = PageRuns::default();
        // The device threads are paused; holding both locks keeps even a
        // running one off guest memory while the state is taken.
        let mut blk = self.block.as_ref().map(|(s, d)| (*s, d.locked()));
        let mut vsock = self.vsock.as_ref().map(|(s, d)| (*s, d.locked()));
        let mut net = self.net.as_ref().map(|(s, d)| (*s, d.locked()));
        let mut balloon = self.balloon.as_ref().map(|(s, d)| (*s, d.locked()));
        if let Some((slot, t)) = blk.as_mut() {
            let mut state = t.save();
            state.device.copy_overlay_to(&dir.join(OVERLAY_FILE))?;
            dirty = dirty.union(&t.take_dirty_pages());
            states.block = Some((*slot, state));
        }
        if let Some((slot, t)) = vsock.as_mut() {
            states.vsock = Some((*slot, t.save()));
            dirty = dirty.union(&t.take_dirty_pages());
        }
        if let Some((slot, t)) = net.as_mut() {
            states.net = Some((*slot, t.save()));
            dirty = dirty.union(&t.take_dirty_pages());
        }
        if let Some((slot, t)) = balloon.as_mut() {
            states.balloon = Some((*slot, t.save()));
            dirty = dirty.union(&t.take_dirty_pages());
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

    #[test]
    fn pause_and_resume_reach_the_vsock_thread() {
        let dir = tempfile::tempdir().unwrap();
        let dev = VsockDevice::new(&VsockConfig::new(dir.path().join("v.sock"))).unwrap();
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let t = VsockMmio::new(dev, guest_mem(1 << 20), irq).unwrap();
        let devices = VirtioDevices {
            vsock: Some((MmioSlot::nth(VSOCK_SLOT).unwrap(), Arc::new(Mutex::new(t)))),
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
