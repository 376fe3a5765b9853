//! End to end with a real Linux guest on hardware virtualization: inside the
//! nested host, `torpor vmm` boots our guest kernel with the Debian rootfs
//! on virtio-blk (a copy-on-write overlay over the image), torpor-agent
//! starts as init's first service, and commands run through the agent over
//! virtio-vsock: echo, python3, a non-zero exit, a timeout; files go in and
//! out through `torpor vmm files`. That guest's snapshot then restores into
//! three clones with their own disks, RNG, current wall clock and files
//! (one L1 boot and one L2 boot for all of it).
//!
//! Needs the guest kernel (`scripts/build-guest-kernel`), the agent
//! (`scripts/build-agent`) and the rootfs (`scripts/build-rootfs`); `scripts/setup test`
//! builds them (cached outside the repository). Missing pieces fail the test
//! with the command that makes them; `TORPOR_SKIP_NESTED=1 scripts/test` leaves it out
//! (the test itself never skips).

mod common;

use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::linux::{binary_content, linux_host, run_logged};
use torpor_agent::proto::MAX_IO_CHUNK;

const TIMEOUT: Duration = Duration::from_secs(900);

/// Where the test's binary file sits in L1.
const BLOB: &str = "/opt/torpor/blob.bin";

/// A file with every byte value, more than one agent I/O chunk long and not
/// a multiple of it; returns its scratch dir, path and length.
fn blob(tag: &str) -> (tempfile::TempDir, PathBuf, usize) {
    let dir = tempfile::Builder::new()
        .prefix(&format!("torpor-nested-{tag}-blob-"))
        .tempdir()
        .unwrap();
    let data = binary_content(MAX_IO_CHUNK + 123_457);
    let path = dir.path().join("blob.bin");
    std::fs::write(&path, &data).unwrap();
    (dir, path, data.len())
}

/// The value after `key ` on the line starting with `key `.
fn field<'a>(out: &'a str, key: &str) -> &'a str {
    out.lines()
        .find_map(|l| l.strip_prefix(key).and_then(|r| r.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no {key:?} line:\n{out}"))
        .trim()
}

/// The checks of a file round trip through `torpor vmm files` (the script
/// part is `FILES_ROUND_TRIP` with `$V` the vsock socket and `$D` the guest
/// directory), with `tag` in front of every line.
fn check_round_trip(o: &str, tag: &str, dir: &str, len: usize) {
    let line = |key: &str| format!("{tag}{key}");
    assert!(
        o.contains(&format!("{tag}{dir}/blob.bin: {len} bytes\n{tag}put-rc=0")),
        "{tag}: put of the binary file failed:\n{o}"
    );
    assert!(
        o.contains(&line("get-rc=0")) && o.contains(&line("round-trip-identical")),
        "{tag}: the file came back different:\n{o}"
    );
    let host_sha = field(o, &line("host-sha"));
    assert_eq!(host_sha.len(), 64, "{o}");
    assert_eq!(
        field(o, &line("guest-sha")),
        host_sha,
        "{tag}: sha256sum in the guest differs from the file sent:\n{o}"
    );
    assert!(
        o.contains(&format!("{tag}guest-cat hello files\n")),
        "{tag}: exec cat does not see the small file:\n{o}"
    );
    assert!(
        o.contains(&format!("{tag}get-stdout hello files\n")),
        "{tag}: get to stdout failed:\n{o}"
    );
    assert!(
        o.contains(&format!(
            "{tag}ls file    0644 {len:>12} blob.bin\n{tag}ls file    0644 {:>12} small.txt\n",
            "hello files\n".len()
        )),
        "{tag}: the listing is wrong:\n{o}"
    );
    assert!(
        o.contains(&format!(
            "{tag}missing torpor: error: get {dir}/missing: agent error ENOENT"
        )) && o.contains(&line("missing-rc=1")),
        "{tag}: a missing guest path did not give the agent's ENOENT:\n{o}"
    );
}

/// Puts `$BLOB` and a small file into `$D` of the guest behind `$V`, reads
/// them back and lists them; every line starts with `$P`.
const FILES_ROUND_TRIP: &str = r#"
files() { $T vmm files --vsock-uds $V "$@"; }
files put --parents $BLOB $D/blob.bin > /tmp/put.out; rc=$?
sed "s/^/$P/" /tmp/put.out; echo "${P}put-rc=$rc"
echo "hello files" > /tmp/small.txt
files put /tmp/small.txt $D/small.txt >/dev/null
rm -f /tmp/back.bin; files get $D/blob.bin /tmp/back.bin; echo "${P}get-rc=$?"
cmp $BLOB /tmp/back.bin && echo "${P}round-trip-identical"
echo "${P}host-sha $(sha256sum < $BLOB | cut -d' ' -f1)"
$T vmm exec --vsock-uds $V -- sh -c "sha256sum < $D/blob.bin | cut -d' ' -f1" | sed "s/^/${P}guest-sha /"
$T vmm exec --vsock-uds $V -- cat $D/small.txt | sed "s/^/${P}guest-cat /"
files get $D/small.txt - | sed "s/^/${P}get-stdout /"
files ls $D | sed "s/^/${P}ls /"
files get $D/missing /tmp/missing 2>&1 | sed "s/^/${P}missing /"
files get $D/missing /tmp/missing 2>/dev/null; echo "${P}missing-rc=$?"
"#;

/// The checks of the template VM's first life: commands through the agent
/// (echo, python3, a non-zero exit, a timeout, a file) and a file round
/// trip, all before it is snapshotted.
fn check_commands(o: &str, blob_len: usize) {
    assert!(
        o.contains("hello-from-the-guest\nrc=0"),
        "echo through the agent failed:\n{o}"
    );
    assert!(
        o.contains("py 42 1\nrc=0"),
        "python3 in the guest (1 vCPU) failed:\n{o}"
    );
    assert!(
        o.contains("to-stderr\nrc=3"),
        "non-zero exit not reported:\n{o}"
    );
    assert!(
        o.contains("data\n"),
        "file write and read in the guest failed:\n{o}"
    );
    let timeout_rc = o
        .lines()
        .skip_while(|l| !l.contains("py 42"))
        .filter(|l| l.starts_with("rc="))
        .nth(2);
    assert!(
        timeout_rc.is_some_and(|l| l != "rc=0"),
        "the timed-out command did not fail:\n{o}"
    );
    check_round_trip(o, "tpl-", "/root/xfer", blob_len);
}

/// Seconds since the epoch on this host.
fn host_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// Slack allowed around the L1 readings that bracket a guest's `date +%s`
/// (whole seconds on both sides, and a slow TCG guest between them).
const CLOCK_SLACK_S: i64 = 3;

/// One L1 boot, one L2 boot: the guest boots and runs commands through
/// the agent, then becomes the template of three clones.
#[test]
fn nested_linux_guest_boots_runs_commands_and_restores_into_isolated_clones() {
    let (_blob_dir, blob_path, blob_len) = blob("linux");
    let (host, _scratch) = linux_host("linux", &[(blob_path, BLOB)]);
    // The template is snapshotted, then L1 waits, so a clone that kept the
    // template's clock would be STALE_S behind.
    let script = format!(
        r#"
test -c /dev/kvm || {{ echo 'L1 has no /dev/kvm'; exit 97; }}
# The VMMs run jailed, as on any host (L1's init mounts cgroup2; from its
# initramfs root the jail moves its root over / instead of pivot_root).
T=/opt/torpor/torpor BLOB={BLOB} STALE_S=30
$T vmm --kernel /opt/torpor/vmlinux --disk /opt/torpor/rootfs.ext4 --disk-overlay /tmp/ov0 \
   --vsock-uds /tmp/v0.sock --mem-mib 512 --vcpus 1 \
   --cmdline "console=ttyS0 reboot=k panic=-1 quiet root=/dev/vda rw init=/sbin/init" \
   --serial /tmp/c0.log --control-socket /tmp/c0.sock &
x() {{ $T vmm exec --vsock-uds /tmp/v0.sock --wait-ms 300000 --timeout-ms "${{TMO:-60000}}" -- "$@"; echo "rc=$?"; }}
t0=$(cut -d' ' -f1 /proc/uptime)
x echo hello-from-the-guest
t1=$(cut -d' ' -f1 /proc/uptime)
echo "boot-to-exec: L1 uptime $t0 -> $t1"
x python3 -c 'import os; print("py", 6 * 7, os.cpu_count())'
x sh -c 'echo to-stderr >&2; exit 3'
TMO=500 x sleep 30
x sh -c 'echo data > /root/f && cat /root/f && cat /proc/sys/kernel/random/boot_id'
V=/tmp/v0.sock D=/root/xfer P=tpl-
{FILES_ROUND_TRIP}
$T vmm exec --vsock-uds /tmp/v0.sock --wait-ms 300000 -- sh -c 'echo base > /root/mark; sync; echo template-ready'
$T vmm pause --socket /tmp/c0.sock >/dev/null
$T vmm snapshot --socket /tmp/c0.sock --out /tmp/tpl >/dev/null && echo snapshot-taken
$T vmm shutdown --socket /tmp/c0.sock >/dev/null; wait
sleep $STALE_S
for i in 1 2 3; do
  $T vmm --restore /tmp/tpl --disk-overlay /tmp/ov$i --vsock-uds /tmp/v$i.sock \
     --serial /tmp/c$i.log --control-socket /tmp/c$i.sock &
done
# Before the hook: what the restored clock says (for the log only).
g=$($T vmm exec --vsock-uds /tmp/v1.sock --wait-ms 120000 -- date +%s)
echo "before-resumed-1 L1 $(date +%s) guest $g"
for i in 1 2 3; do
  $T vmm resumed --vsock-uds /tmp/v$i.sock --wait-ms 120000 | sed "s/^/resumed-$i /"
done
for i in 1 2 3; do
  h0=$(date +%s)
  g=$($T vmm exec --vsock-uds /tmp/v$i.sock -- date +%s)
  h1=$(date +%s)
  echo "clock-$i $h0 $g $h1"
done
# Files: a round trip in clone 1; what clone 1 wrote is absent in clone 2.
V=/tmp/v1.sock D=/root/clone1 P=clone1-
{FILES_ROUND_TRIP}
$T vmm files --vsock-uds /tmp/v2.sock stat /root/clone1/blob.bin 2>&1 | sed "s/^/clone2-stat /"
$T vmm files --vsock-uds /tmp/v2.sock ls /root | sed "s/^/clone2-ls /"
$T vmm files --vsock-uds /tmp/v2.sock get /root/mark - | sed "s/^/clone2-mark /"
for i in 1 2 3; do
  $T vmm exec --vsock-uds /tmp/v$i.sock --wait-ms 120000 -- \
     sh -c "echo clone-$i saw \$(cat /root/mark); echo clone$i > /root/mark; echo rng-\$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')"
  echo "rc=$?"
done
for i in 1 2 3; do
  $T vmm exec --vsock-uds /tmp/v$i.sock -- sh -c "echo final-$i \$(cat /root/mark)"
done
for i in 1 2 3; do $T vmm shutdown --socket /tmp/c$i.sock >/dev/null; done
wait
"#
    );
    let started = host_now();
    let out = run_logged(&host, "nested_linux", &script, TIMEOUT);
    let ended = host_now();
    let o = &out.stdout;
    assert_ne!(out.exit_code, 97, "{o}");
    check_commands(o, blob_len);
    assert!(
        o.contains("template-ready") && o.contains("snapshot-taken"),
        "{o}"
    );
    for i in 1..=3 {
        // Each clone starts from the template's disk and memory, and its
        // writes stay its own.
        assert!(
            o.contains(&format!("clone-{i} saw base")),
            "clone {i} did not see the template's disk:\n{o}"
        );
        assert!(
            o.contains(&format!("final-{i} clone{i}\n")),
            "clone {i}'s disk is not its own:\n{o}"
        );
    }
    for i in 1..=3 {
        // The host's post-restore hook: the agent read the identity page
        // (generation 1), set the clock and reseeded the RNG.
        let line = o
            .lines()
            .find(|l| l.starts_with(&format!("resumed-{i} ")))
            .unwrap_or_else(|| panic!("no resumed report from clone {i}:\n{o}"));
        assert!(line.contains("\"generation\":1"), "{line}");
        assert!(line.contains("\"clock\":{\"status\":\"ok\""), "{line}");
    }
    eprintln!("clone 1 before resumed: {}", field(o, "before-resumed-1"));
    for i in 1..=3 {
        // The wall clock is current: the guest's `date +%s` lies between
        // two L1 readings taken around it, and L1's clock is this host's.
        let clock: Vec<i64> = field(o, &format!("clock-{i}"))
            .split_whitespace()
            .map(|v| {
                v.parse()
                    .unwrap_or_else(|_| panic!("clock-{i}: {v:?}\n{o}"))
            })
            .collect();
        let [l1_before, guest, l1_after] = clock[..] else {
            panic!("clock-{i} needs three readings:\n{o}")
        };
        eprintln!("clone {i}: guest date {guest}, L1 {l1_before}..{l1_after}");
        assert!(
            (l1_before - CLOCK_SLACK_S..=l1_after + CLOCK_SLACK_S).contains(&guest),
            "clone {i}'s wall clock is not current: guest {guest}, L1 {l1_before}..{l1_after}"
        );
        assert!(
            (started - CLOCK_SLACK_S..=ended + CLOCK_SLACK_S).contains(&l1_before),
            "L1's clock {l1_before} is not this host's ({started}..{ended})"
        );
    }
    let rngs: std::collections::HashSet<&str> =
        o.lines().filter(|l| l.starts_with("rng-")).collect();
    assert_eq!(
        rngs.len(),
        3,
        "clones must not produce the same random bytes:\n{o}"
    );
    // Files in a clone: the round trip works, and stays in that clone.
    check_round_trip(o, "clone1-", "/root/clone1", blob_len);
    assert!(
        o.contains("clone2-stat torpor: error: stat /root/clone1/blob.bin: agent error ENOENT"),
        "clone 2 sees a file clone 1 wrote:\n{o}"
    );
    assert!(
        o.contains("clone2-ls file")
            && !o
                .lines()
                .any(|l| l.starts_with("clone2-ls") && l.ends_with(" clone1")),
        "clone 2 lists clone 1's directory:\n{o}"
    );
    assert!(
        o.contains("clone2-mark base\n"),
        "clone 2 cannot read the template's file:\n{o}"
    );
}
