//! The two images QEMU boots L1 with: an initramfs (busybox, modules, the
//! init, the command script, shared libraries of carried executables) and,
//! when files are carried, a payload disk (ext4 made by `mkfs.ext4 -d`,
//! without mounting anything on the host).

use std::fs;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::assets::L1Assets;
use crate::cpio::Cpio;
use crate::{io_err, NestedError};

/// Console markers the L1 init prints around the command script.
pub const MARK_INIT: &str = "TORPOR-NESTED-INIT";
pub const MARK_BEGIN: &str = "TORPOR-NESTED-BEGIN";
pub const MARK_END: &str = "TORPOR-NESTED-END rc=";
/// What L1's init prints every [`HEARTBEAT_SECS`] while the script runs:
/// an L1 whose console goes silent is frozen, not busy.
pub const MARK_ALIVE: &str = "TORPOR-NESTED-ALIVE";
pub const HEARTBEAT_SECS: u64 = 60;

/// The L1 init: mount the pseudo filesystems, load kvm (and virtio for the
/// payload disk), link carried files into place, run the script between
/// markers, report its exit code, power off.
const INIT: &str = r#"#!/bin/busybox sh
/bin/busybox mkdir -p /bin /sbin /usr/bin /usr/sbin /proc /sys /dev /tmp /run /root /payload
/bin/busybox --install -s
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /run
# cgroup v2 for the VMMs' jails (memory, pids, cpu limits per sandbox).
mkdir -p /sys/fs/cgroup
mount -t cgroup2 cgroup2 /sys/fs/cgroup || echo "TORPOR-NESTED: cannot mount cgroup2"
# No transparent huge pages in L1: while an L2 guest touched hundreds of
# MiB, L1's kernel under TCG hung with khugepaged blocked for minutes, or
# a vCPU thread's kernel stack overflowed and it panicked (3 runs in 5);
# khugepaged and compaction move the very pages L2 runs on.
echo never > /sys/kernel/mm/transparent_hugepage/enabled || echo "TORPOR-NESTED: THP stays on"
echo never > /sys/kernel/mm/transparent_hugepage/defrag 2>/dev/null
echo "TORPOR-NESTED-INIT uptime=$(cut -d' ' -f1 /proc/uptime)"
for m in $(cat /lib/modules/load-order); do
  insmod "/lib/modules/$m" || echo "TORPOR-NESTED: insmod $m failed"
done
if [ -f /nested/payload ]; then
  i=0
  while [ ! -b /dev/vda ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i + 1)); done
  # discard: what L1 deletes is given back to the host's sparse image.
  mount -t ext4 -o discard /dev/vda /payload || echo "TORPOR-NESTED: cannot mount the payload disk"
  while IFS= read -r g; do
    mkdir -p "$(dirname "$g")"
    ln -sf "/payload/files$g" "$g"
  done </nested/links
fi
if [ -f /nested/net ]; then
  # QEMU's user network: the guest is 10.0.2.15, the gateway 10.0.2.2.
  ip link set lo up
  i=0
  while [ ! -e /sys/class/net/eth0 ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i + 1)); done
  ip link set eth0 up && ip addr add 10.0.2.15/24 dev eth0 && ip route add default via 10.0.2.2 ||
    echo "TORPOR-NESTED: cannot bring up eth0"
fi
echo "TORPOR-NESTED-READY uptime=$(cut -d' ' -f1 /proc/uptime)"
cd /root
echo TORPOR-NESTED-BEGIN
(while sleep 60; do echo "TORPOR-NESTED-ALIVE uptime=$(cut -d' ' -f1 /proc/uptime)"; done) &
sh /nested/run.sh </dev/null 2>&1
rc=$?
echo "TORPOR-NESTED-END rc=$rc"
sync
umount /payload 2>/dev/null
poweroff -f
"#;

/// A file carried into L1.
#[derive(Debug, Clone)]
pub struct Carried {
    pub host: PathBuf,
    pub guest: String,
}

/// Checks a guest path: absolute, plain, and not on top of what the init uses.
pub fn check_guest_path(guest: &str) -> Result<(), NestedError> {
    let bad = |why: &str| NestedError::BadGuestPath {
        path: guest.to_string(),
        why: why.to_string(),
    };
    if !guest.starts_with('/') {
        return Err(bad("it must be absolute"));
    }
    if guest.contains('\n') || guest.contains('\0') {
        return Err(bad("it contains a newline or NUL"));
    }
    if guest.split('/').any(|c| c == ".." || c == ".") {
        return Err(bad("it contains . or .."));
    }
    let reserved = [
        "/proc", "/sys", "/dev", "/nested", "/payload", "/init", "/bin", "/lib",
    ];
    let top = format!("/{}", guest.split('/').nth(1).unwrap_or(""));
    if reserved.contains(&top.as_str()) || guest.trim_end_matches('/').is_empty() {
        return Err(bad("it is under a directory the L1 init owns"));
    }
    Ok(())
}

/// Builds the initramfs for one run.
pub fn initramfs(
    assets: &L1Assets,
    script: &str,
    carried: &[Carried],
    payload: bool,
    net: bool,
) -> Result<Vec<u8>, NestedError> {
    let mut cpio = Cpio::new();
    cpio.file("init", 0o755, INIT.as_bytes());
    cpio.file("bin/busybox", 0o755, &read(&assets.busybox)?);
    let mut order = String::new();
    for m in &assets.modules {
        let name = m
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| io_err(m, std::io::ErrorKind::InvalidInput.into()))?;
        cpio.file(&format!("lib/modules/{name}"), 0o644, &read(m)?);
        order.push_str(name);
        order.push('\n');
    }
    cpio.file("lib/modules/load-order", 0o644, order.as_bytes());
    cpio.file("nested/run.sh", 0o755, script.as_bytes());
    if net {
        cpio.file("nested/net", 0o644, b"");
    }
    if payload {
        cpio.file("nested/payload", 0o644, b"");
        let links: String = carried.iter().map(|c| format!("{}\n", c.guest)).collect();
        cpio.file("nested/links", 0o644, links.as_bytes());
    }
    // Dynamically linked executables need their loader and libraries.
    let mut libs: Vec<PathBuf> = Vec::new();
    for c in carried {
        for lib in shared_libraries(&c.host) {
            if !libs.contains(&lib) {
                libs.push(lib);
            }
        }
    }
    for lib in &libs {
        let guest = lib.to_string_lossy();
        if guest.starts_with("/bin/") {
            continue;
        }
        cpio.file(&guest, 0o755, &read(lib)?);
    }
    Ok(cpio.finish())
}

/// The loader and libraries of a dynamically linked ELF executable, as `ldd`
/// names them; empty for anything else (or when `ldd` is missing).
pub fn shared_libraries(path: &Path) -> Vec<PathBuf> {
    let executable = fs::metadata(path)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false);
    let mut magic = [0u8; 4];
    let elf = fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .map(|_| &magic == b"\x7fELF")
        .unwrap_or(false);
    if !executable || !elf {
        return Vec::new();
    }
    let Ok(out) = Command::new("ldd").arg(path).output() else {
        return Vec::new();
    };
    parse_ldd(&String::from_utf8_lossy(&out.stdout))
}

fn parse_ldd(text: &str) -> Vec<PathBuf> {
    text.lines()
        .filter_map(|line| {
            let line = line.trim();
            let candidate = match line.split_once("=>") {
                Some((_, rest)) => rest.split_whitespace().next()?,
                None => line.split_whitespace().next()?,
            };
            candidate.starts_with('/').then(|| PathBuf::from(candidate))
        })
        .collect()
}

/// Builds the payload disk: an ext4 image holding every carried file under
/// `files/<guest path>`, with `spare` bytes free beyond a little room
/// (sparse: unwritten space takes nothing on the host). Returns the image
/// path.
pub fn payload_disk(work: &Path, carried: &[Carried], spare: u64) -> Result<PathBuf, NestedError> {
    let root = work.join("payload");
    let mut total: u64 = 0;
    for c in carried {
        let dest = root.join("files").join(c.guest.trim_start_matches('/'));
        if let Some(parent) = dest.parent() {
            fs::create_dir_all(parent).map_err(|e| io_err(parent, e))?;
        }
        let meta = fs::metadata(&c.host).map_err(|e| io_err(&c.host, e))?;
        total += meta.len();
        if fs::hard_link(&c.host, &dest).is_err() {
            fs::copy(&c.host, &dest).map_err(|e| io_err(&c.host, e))?;
        }
    }
    let image = work.join("payload.ext4");
    // Room for metadata and for what the script writes next to the files.
    let size = (total + total / 5 + (64 << 20) + spare).div_ceil(1 << 20) << 20;
    let file = fs::File::create(&image).map_err(|e| io_err(&image, e))?;
    file.set_len(size).map_err(|e| io_err(&image, e))?;
    drop(file);
    let out = Command::new("mkfs.ext4")
        .args([
            "-q",
            "-F",
            "-O",
            "^has_journal",
            "-E",
            "root_owner=0:0",
            "-d",
        ])
        .arg(&root)
        .arg(&image)
        .output()
        .map_err(|e| NestedError::Tool {
            tool: "mkfs.ext4 (install e2fsprogs)".into(),
            detail: e.to_string(),
        })?;
    if !out.status.success() {
        return Err(NestedError::Tool {
            tool: "mkfs.ext4".into(),
            detail: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(image)
}

fn read(path: &Path) -> Result<Vec<u8>, NestedError> {
    fs::read(path).map_err(|e| io_err(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ldd_output_is_parsed() {
        let text = "\tlinux-vdso.so.1 (0x00007ffd)\n\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x7f)\n\t/lib64/ld-linux-x86-64.so.2 (0x7f)\n";
        assert_eq!(
            parse_ldd(text),
            vec![
                PathBuf::from("/lib/x86_64-linux-gnu/libc.so.6"),
                PathBuf::from("/lib64/ld-linux-x86-64.so.2")
            ]
        );
        assert!(parse_ldd("\tnot a dynamic executable\n").is_empty());
    }

    #[test]
    fn guest_paths_are_checked() {
        assert!(check_guest_path("/opt/torpor/torpor").is_ok());
        assert!(check_guest_path("relative").is_err());
        assert!(check_guest_path("/proc/x").is_err());
        assert!(check_guest_path("/opt/../proc").is_err());
        assert!(check_guest_path("/").is_err());
        assert!(check_guest_path("/a\nb").is_err());
    }

    #[test]
    fn init_prints_the_markers_the_parser_expects() {
        assert!(INIT.contains(MARK_INIT));
        assert!(INIT.contains(&format!("echo {MARK_BEGIN}")));
        assert!(INIT.contains(&format!(
            "while sleep {HEARTBEAT_SECS}; do echo \"{MARK_ALIVE}"
        )));
        assert!(INIT.contains(&format!("\"{MARK_END}$rc\"")));
    }
}
