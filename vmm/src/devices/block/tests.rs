//! virtio-blk tests on crafted descriptor chains (virtio-queue's mock queue)
//! and real files in a temporary directory.

use std::path::{Path, PathBuf};

use tempfile::TempDir;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

use super::*;
use crate::devices::virtio::testutil::{activate, copy_mem, guest_mem, read32, write32, Driver};
use crate::devices::virtio::{MmioRestoreArgs, VIRTIO_F_VERSION_1};
use crate::snapshot::Persist;

const MEM: usize = 4 << 20;
const DISK: u64 = 2 << 20;
const QSIZE: u16 = 256;
const HDR: u64 = 0x10000;
const STATUS: u64 = 0x20000;
const DATA: u64 = 0x100000;

/// Byte `i` of the base image.
fn pattern(i: u64) -> u8 {
    ((i / 512) ^ i) as u8
}

fn make_base(dir: &Path) -> PathBuf {
    let path = dir.join("base.img");
    let bytes: Vec<u8> = (0..DISK).map(pattern).collect();
    std::fs::write(&path, bytes).unwrap();
    path
}

struct Rig<'a> {
    mem: &'a GuestMemoryMmap,
    t: BlockMmio,
    drv: Driver<'a>,
}

fn rig<'a>(mem: &'a GuestMemoryMmap, dev: BlockDevice) -> Rig<'a> {
    let mut t =
        BlockMmio::new(dev, mem.clone(), EventFd::new(libc::EFD_NONBLOCK).unwrap()).unwrap();
    let drv = Driver::new(mem, 0x1000, QSIZE);
    activate(
        &mut t,
        VIRTIO_F_VERSION_1 | VIRTIO_BLK_F_FLUSH,
        &[&drv],
        QSIZE,
    );
    Rig { mem, t, drv }
}

fn writable(dir: &Path, base: &Path, name: &str) -> BlockDevice {
    BlockDevice::new(&BlockConfig {
        id: "disk0".into(),
        base: base.into(),
        overlay: Some(dir.join(name)),
        read_only: false,
        keep_overlay: false,
    })
    .unwrap()
}

impl Rig<'_> {
    fn header(&self, kind: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[..4].copy_from_slice(&kind.to_le_bytes());
        h[8..].copy_from_slice(&sector.to_le_bytes());
        self.mem.write_slice(&h, GuestAddress(HDR)).unwrap();
        self.mem.write_obj(0xeeu8, GuestAddress(STATUS)).unwrap();
    }

    /// Offers `bufs`, notifies, and returns (status byte, used length).
    fn run(&mut self, bufs: &[(u64, u32, bool)]) -> (u8, u32) {
        let head = self.drv.push(bufs);
        write32(&mut self.t, 0x50, 0);
        let used = self.drv.take_used();
        assert_eq!(used.len(), 1, "one request, one used entry");
        assert_eq!(used[0].0, head);
        (self.mem.read_obj(GuestAddress(STATUS)).unwrap(), used[0].1)
    }

    fn read(&mut self, sector: u64, len: u32) -> (u8, u32, Vec<u8>) {
        self.header(VIRTIO_BLK_T_IN, sector);
        let (s, n) = self.run(&[(HDR, 16, false), (DATA, len, true), (STATUS, 1, true)]);
        let mut buf = vec![0u8; len as usize];
        self.mem.read_slice(&mut buf, GuestAddress(DATA)).unwrap();
        (s, n, buf)
    }

    fn write(&mut self, sector: u64, data: &[u8]) -> (u8, u32) {
        self.header(VIRTIO_BLK_T_OUT, sector);
        self.mem.write_slice(data, GuestAddress(DATA)).unwrap();
        self.run(&[
            (HDR, 16, false),
            (DATA, data.len() as u32, false),
            (STATUS, 1, true),
        ])
    }

    fn simple(&mut self, kind: u32) -> (u8, u32) {
        self.header(kind, 0);
        self.run(&[(HDR, 16, false), (STATUS, 1, true)])
    }
}

fn expected(range: std::ops::Range<u64>) -> Vec<u8> {
    range.map(pattern).collect()
}

#[test]
fn reads_writes_and_flushes_through_the_overlay() {
    let dir = tempfile::tempdir().unwrap();
    let base = make_base(dir.path());
    let mem = guest_mem(MEM);
    let mut r = rig(&mem, writable(dir.path(), &base, "a.overlay"));
    assert_eq!(read32(&mut r.t, 0x100), (DISK / 512) as u32, "capacity");
    assert_eq!(read32(&mut r.t, 0x10c), SEG_MAX);

    let (s, n, data) = r.read(0, 8192);
    assert_eq!((s, n), (VIRTIO_BLK_S_OK, 8193));
    assert_eq!(data, expected(0..8192));

    // Two sectors inside chunk 0 (copy-up), then a write across chunks 1-2.
    assert_eq!(r.write(3, &[0x11; 1024]), (VIRTIO_BLK_S_OK, 1));
    assert_eq!(r.write(15, &[0x22; 4096]), (VIRTIO_BLK_S_OK, 1));
    let (s, _, data) = r.read(0, 16384);
    assert_eq!(s, VIRTIO_BLK_S_OK);
    let mut want = expected(0..16384);
    want[1536..2560].fill(0x11);
    want[7680..11776].fill(0x22);
    assert_eq!(data, want);
    assert_eq!(r.simple(VIRTIO_BLK_T_FLUSH), (VIRTIO_BLK_S_OK, 1));
    assert_eq!(r.t.device().disk().map().to_runs(), [(0, 3)]);

    // The base image is untouched.
    assert_eq!(std::fs::read(&base).unwrap(), expected(0..DISK));
    // Written pages were recorded for the next diff snapshot.
    assert!(r.t.take_dirty_pages().contains(DATA / 4096));
}

#[test]
fn clones_with_their_own_overlays_do_not_see_each_other() {
    let dir = TempDir::new().unwrap();
    let base = make_base(dir.path());
    let (mem_a, mem_b) = (guest_mem(MEM), guest_mem(MEM));
    let mut a = rig(&mem_a, writable(dir.path(), &base, "a.overlay"));
    let mut b = rig(&mem_b, writable(dir.path(), &base, "b.overlay"));
    assert_eq!(a.write(8, &[0xaa; 4096]).0, VIRTIO_BLK_S_OK);
    let (_, _, seen_by_b) = b.read(8, 4096);
    assert_eq!(seen_by_b, expected(4096..8192));
    assert_eq!(b.write(8, &[0xbb; 512]).0, VIRTIO_BLK_S_OK);
    let (_, _, seen_by_a) = a.read(8, 512);
    assert_eq!(seen_by_a, [0xaa; 512]);
}

#[test]
fn snapshot_freezes_the_overlay_and_restored_clones_get_private_copies() {
    let dir = TempDir::new().unwrap();
    let base = make_base(dir.path());
    let mem = guest_mem(MEM);
    let mut a = rig(&mem, writable(dir.path(), &base, "a.overlay"));
    assert_eq!(a.write(100, &[0x5a; 1024]).0, VIRTIO_BLK_S_OK);

    let mut state = a.t.save();
    let frozen = dir.path().join("snap.overlay");
    state.device.copy_overlay_to(&frozen).unwrap();
    let bytes = bincode::serialize(&state).unwrap();
    let clone_mem = guest_mem(MEM);
    let clone_drv = a.drv.resume_on(&clone_mem);
    copy_mem(&mem, &clone_mem);
    // The source VM keeps running and writing: the snapshot must not care.
    assert_eq!(a.write(100, &[0x77; 512]).0, VIRTIO_BLK_S_OK);

    let state: crate::devices::virtio::VirtioMmioState<BlockState> =
        bincode::deserialize(&bytes).unwrap();
    assert_eq!(state.device.overlay_chunks, [(12, 1)]);
    let restore = |name: &str| {
        let args = MmioRestoreArgs {
            mem: clone_mem.clone(),
            irq: EventFd::new(libc::EFD_NONBLOCK).unwrap(),
            device: BlockRestoreArgs {
                overlay_path: Some(dir.path().join(name)),
                base_path: None,
            },
        };
        BlockMmio::restore(args, &state).unwrap()
    };
    let mut c = Rig {
        mem: &clone_mem,
        t: restore("c.overlay"),
        drv: clone_drv,
    };
    assert!(c.t.is_activated());
    let (_, _, data) = c.read(100, 1024);
    assert_eq!(data, [0x5a; 1024]);
    assert_eq!(c.write(101, &[0x33; 512]).0, VIRTIO_BLK_S_OK);
    // The frozen overlay and the base did not change.
    let snap = std::fs::read(&frozen).unwrap();
    assert_eq!(snap[51200..51712], [0x5a; 512]);
    assert_eq!(snap[51712..52224], [0x5a; 512]);
    assert_eq!(std::fs::read(&base).unwrap(), expected(0..DISK));

    // A restore onto a base of another size is refused.
    let mut bad = state.clone();
    bad.device.disk_size += 512;
    let args = MmioRestoreArgs {
        mem: clone_mem.clone(),
        irq: EventFd::new(0).unwrap(),
        device: BlockRestoreArgs::default(),
    };
    assert!(BlockMmio::restore(args, &bad).is_err());
}

#[test]
fn get_id_and_read_only_disks() {
    let dir = TempDir::new().unwrap();
    let base = make_base(dir.path());
    let mem = guest_mem(MEM);
    let dev = BlockDevice::new(&BlockConfig {
        id: "rootfs".into(),
        base: base.clone(),
        overlay: None,
        read_only: true,
        keep_overlay: false,
    })
    .unwrap();
    use crate::devices::virtio::VirtioDevice;
    assert_ne!(dev.avail_features() & VIRTIO_BLK_F_RO, 0);
    let mut r = rig(&mem, dev);
    r.header(VIRTIO_BLK_T_GET_ID, 0);
    let (s, n) = r.run(&[(HDR, 16, false), (DATA, 20, true), (STATUS, 1, true)]);
    assert_eq!((s, n), (VIRTIO_BLK_S_OK, 21));
    let mut id = [0u8; 20];
    mem.read_slice(&mut id, GuestAddress(DATA)).unwrap();
    assert_eq!(&id[..7], b"rootfs\0");
    assert_eq!(r.write(0, &[1; 512]).0, VIRTIO_BLK_S_IOERR);
    assert_eq!(r.read(0, 512).2, expected(0..512));

    let no_overlay = BlockConfig {
        id: "x".into(),
        base,
        overlay: None,
        read_only: false,
        keep_overlay: false,
    };
    assert!(matches!(
        BlockDevice::new(&no_overlay),
        Err(BlockError::NoOverlay)
    ));
    let long_id = BlockConfig {
        id: "x".repeat(21),
        read_only: true,
        ..no_overlay
    };
    assert!(matches!(
        BlockDevice::new(&long_id),
        Err(BlockError::IdTooLong(21))
    ));
}

#[test]
fn malformed_requests_fail_without_touching_the_disk() {
    let dir = TempDir::new().unwrap();
    let base = make_base(dir.path());
    let mem = guest_mem(MEM);
    let mut r = rig(&mem, writable(dir.path(), &base, "a.overlay"));
    let ioerr = (VIRTIO_BLK_S_IOERR, 1);
    let (h, st) = ((HDR, 16, false), (STATUS, 1, true));

    // Writable data before readable data.
    r.header(VIRTIO_BLK_T_OUT, 0);
    assert_eq!(
        r.run(&[h, (DATA, 512, true), (DATA, 512, false), st]),
        ioerr
    );
    // Header too short.
    r.header(VIRTIO_BLK_T_IN, 0);
    assert_eq!(r.run(&[(HDR, 8, false), (DATA, 512, true), st]), ioerr);
    // Wrong direction for IN, OUT, FLUSH and GET_ID.
    assert_eq!(
        r.run(&[h, (DATA, 512, false), (DATA, 512, true), st]),
        ioerr
    );
    r.header(VIRTIO_BLK_T_OUT, 0);
    assert_eq!(r.run(&[h, (DATA, 512, true), st]), ioerr);
    r.header(VIRTIO_BLK_T_FLUSH, 0);
    assert_eq!(r.run(&[h, (DATA, 512, true), st]), ioerr);
    r.header(VIRTIO_BLK_T_GET_ID, 0);
    assert_eq!(r.run(&[h, st]), ioerr);
    // Partial sectors, past the end, overflowing sector numbers.
    assert_eq!(r.read(0, 100).0, VIRTIO_BLK_S_IOERR);
    assert_eq!(r.read(DISK / 512 - 1, 1024).0, VIRTIO_BLK_S_IOERR);
    assert_eq!(r.read(DISK / 512, 512).0, VIRTIO_BLK_S_IOERR);
    assert_eq!(r.read(u64::MAX / 256, 512).0, VIRTIO_BLK_S_IOERR);
    assert_eq!(r.write(DISK / 512 - 1, &[9; 1024]), ioerr);
    // Larger than the request limit (the disk is big enough to hold it).
    assert_eq!(
        r.read(0, MAX_REQUEST_BYTES as u32 + 512).0,
        VIRTIO_BLK_S_IOERR
    );
    // Buffers outside guest memory, and a chain straddling its end.
    r.header(VIRTIO_BLK_T_IN, 0);
    assert_eq!(r.run(&[h, (MEM as u64 + 4096, 512, true), st]), ioerr);
    assert_eq!(r.run(&[h, (MEM as u64 - 256, 512, true), st]), ioerr);
    assert_eq!(
        r.run(&[(u64::MAX - 8, 16, false), (DATA, 512, true), st]),
        ioerr
    );
    // Too many segments.
    let mut many = vec![h];
    many.extend((0..SEG_MAX as u64 + 1).map(|i| (DATA + i * 512, 512, true)));
    many.push(st);
    assert_eq!(r.run(&many), ioerr);
    // Unknown request type.
    assert_eq!(r.simple(99), (VIRTIO_BLK_S_UNSUPP, 1));

    // No writable status byte: nothing can be reported, nothing written.
    r.header(VIRTIO_BLK_T_OUT, 0);
    assert_eq!(
        r.run(&[h, (DATA, 512, false), (STATUS, 1, false)]),
        (0xee, 0)
    );
    assert_eq!(
        r.run(&[h, (DATA, 512, false), (MEM as u64, 1, true)]),
        (0xee, 0)
    );
    assert_eq!(
        r.run(&[h, (DATA, 512, false), (STATUS, 0, true)]),
        (0xee, 0)
    );

    assert_eq!(
        r.t.device().disk().map().count(),
        0,
        "nothing reached the overlay"
    );
    // The device still works afterwards.
    assert_eq!(r.read(0, 512), (VIRTIO_BLK_S_OK, 513, expected(0..512)));
}

#[test]
fn several_requests_in_one_notification_and_split_headers() {
    let dir = TempDir::new().unwrap();
    let base = make_base(dir.path());
    let mem = guest_mem(MEM);
    let mut r = rig(&mem, writable(dir.path(), &base, "a.overlay"));
    // Header split over two descriptors, data and status sharing one.
    r.header(VIRTIO_BLK_T_IN, 2);
    let h1 = r.drv.push(&[
        (HDR, 10, false),
        (HDR + 10, 6, false),
        (DATA, 512, true),
        (STATUS, 1, true),
    ]);
    mem.write_obj(0xeeu8, GuestAddress(DATA + 0x2000 + 512))
        .unwrap();
    let h2 = r.drv.push(&[(HDR, 16, false), (DATA + 0x2000, 513, true)]);
    write32(&mut r.t, 0x50, 0);
    assert_eq!(r.drv.take_used(), [(h1, 513), (h2, 513)]);
    let mut buf = [0u8; 512];
    mem.read_slice(&mut buf, GuestAddress(DATA + 0x2000))
        .unwrap();
    assert_eq!(buf.as_slice(), expected(1024..1536));
    assert_eq!(
        mem.read_obj::<u8>(GuestAddress(DATA + 0x2000 + 512))
            .unwrap(),
        0
    );
}

#[test]
fn overlay_map_runs_round_trip_and_reject_garbage() {
    let dir = TempDir::new().unwrap();
    let base = make_base(dir.path());
    let mut disk = CowDisk::open(&base, Some(&dir.path().join("o"))).unwrap();
    disk.write_at(4096 * 3, &[1; 8192]).unwrap();
    disk.write_at(4096 * 64 - 1, &[2; 2]).unwrap();
    assert_eq!(disk.map().to_runs(), [(3, 2), (63, 2)]);
    let m = OverlayMap::from_runs(disk.map().chunks(), &disk.map().to_runs()).unwrap();
    assert_eq!(m.count(), 4);
    assert!(OverlayMap::from_runs(10, &[(9, 2)]).is_err());
    assert!(OverlayMap::from_runs(10, &[(u64::MAX, 2)]).is_err());
    assert!(disk.write_at(DISK - 1, &[0; 2]).is_err());
    // Base images must be whole sectors.
    let odd = dir.path().join("odd.img");
    std::fs::write(&odd, [0u8; 1000]).unwrap();
    assert!(matches!(
        CowDisk::open(&odd, None),
        Err(DiskError::Unaligned { .. })
    ));
}

/// Requests run on the vCPU thread that notified the queue: the same
/// reads, copy-ups, writes and flushes on a thread under the vCPU filter.
#[test]
fn requests_run_under_the_vcpu_seccomp_filter() {
    if !crate::seccomp::tests::confined_child() {
        crate::seccomp::tests::run_in_confined_child(
            "devices::block::tests::requests_run_under_the_vcpu_seccomp_filter",
        );
        return;
    }
    let dir = TempDir::new().unwrap();
    let base = make_base(dir.path());
    let mem = guest_mem(MEM);
    std::thread::scope(|s| {
        s.spawn(|| {
            // Opened first, as the VMM opens its disks before the vCPUs run.
            let mut r = rig(&mem, writable(dir.path(), &base, "a.overlay"));
            crate::seccomp::enter(crate::seccomp::ThreadKind::Vcpu);
            let (st, _, data) = r.read(0, 8192);
            assert_eq!(st, VIRTIO_BLK_S_OK);
            assert_eq!(data, expected(0..8192));
            assert_eq!(r.write(3, &[0x11; 1024]), (VIRTIO_BLK_S_OK, 1));
            assert_eq!(r.write(15, &[0x22; 4096]), (VIRTIO_BLK_S_OK, 1));
            let (st, _, data) = r.read(0, 512 * 4);
            assert_eq!(st, VIRTIO_BLK_S_OK);
            assert_eq!(&data[1536..2048], &[0x11; 512]);
            assert_eq!(r.simple(VIRTIO_BLK_T_FLUSH), (VIRTIO_BLK_S_OK, 1));
        })
        .join()
        .expect("the confined vCPU-side thread");
    });
}

/// Fuzzing found (`fuzz/`, target snapshot_state): a state file's disk
/// size sized the overlay map before it was checked against the base
/// image, so a huge one aborted the VMM on allocation. Now the size is
/// checked first, and overlapping runs (which made building the map cost
/// runs x chunks) are refused.
#[test]
fn saved_sizes_and_runs_are_checked_before_use() {
    let dir = TempDir::new().unwrap();
    let base = make_base(dir.path());
    let mem = guest_mem(MEM);
    let a = rig(&mem, writable(dir.path(), &base, "a.overlay"));
    let state = a.t.save();
    let restore = |state: &crate::devices::virtio::VirtioMmioState<BlockState>| {
        let args = MmioRestoreArgs {
            mem: mem.clone(),
            irq: EventFd::new(libc::EFD_NONBLOCK).unwrap(),
            device: BlockRestoreArgs {
                overlay_path: Some(dir.path().join("own.overlay")),
                base_path: None,
            },
        };
        BlockMmio::restore(args, state).map(drop)
    };
    restore(&state).expect("the saved state restores");

    let mut huge = state.clone();
    huge.device.disk_size = 0x11c0_0000_0000_0000;
    match restore(&huge) {
        Err(e) => assert!(e.to_string().contains("saved disk"), "{e}"),
        Ok(()) => panic!("a disk size the base does not have was restored"),
    }

    let mut overlapping = state.clone();
    let chunks = DISK / CHUNK_SIZE;
    overlapping.device.overlay_chunks = vec![(0, chunks); 100_000];
    match restore(&overlapping) {
        Err(e) => assert!(e.to_string().contains("not after chunk"), "{e}"),
        Ok(()) => panic!("overlapping runs were accepted"),
    }
    assert!(OverlayMap::from_runs(8, &[(0, 2), (2, 3), (6, 2)]).is_ok());
    assert!(OverlayMap::from_runs(8, &[(2, 2), (0, 1)]).is_err());
}

#[test]
fn a_kept_overlay_reopens_with_what_was_written_and_the_base_elsewhere() {
    let dir = tempfile::tempdir().unwrap();
    let base = make_base(dir.path());
    let mem = guest_mem(MEM);
    {
        let mut r = rig(&mem, writable(dir.path(), &base, "kept.overlay"));
        assert_eq!(r.write(3, &[0x11; 1024]), (VIRTIO_BLK_S_OK, 1));
        assert_eq!(r.write(64, &[0x22; 4096]), (VIRTIO_BLK_S_OK, 1));
        assert_eq!(r.simple(VIRTIO_BLK_T_FLUSH), (VIRTIO_BLK_S_OK, 1));
    }
    // The VMM ended without a snapshot: no map but the file's own.
    let kept = BlockDevice::new(&BlockConfig {
        id: "disk0".into(),
        base: base.clone(),
        overlay: Some(dir.path().join("kept.overlay")),
        read_only: false,
        keep_overlay: true,
    })
    .unwrap();
    assert_eq!(kept.disk().map().to_runs(), [(0, 1), (8, 1)]);
    let mut r = rig(&mem, kept);
    let (s, _, data) = r.read(0, 40960);
    assert_eq!(s, VIRTIO_BLK_S_OK);
    let mut want = expected(0..40960);
    want[1536..2560].fill(0x11);
    want[32768..36864].fill(0x22);
    assert_eq!(data, want);

    // A fresh (not kept) open of the same file starts empty again.
    let fresh = writable(dir.path(), &base, "kept.overlay");
    assert_eq!(fresh.disk().map().count(), 0);

    // An overlay of another size than the base is refused.
    let other = dir.path().join("short.overlay");
    std::fs::File::create(&other)
        .unwrap()
        .set_len(4096)
        .unwrap();
    let refused = BlockDevice::new(&BlockConfig {
        id: "disk0".into(),
        base,
        overlay: Some(other),
        read_only: false,
        keep_overlay: true,
    });
    assert!(refused.is_err());
}
