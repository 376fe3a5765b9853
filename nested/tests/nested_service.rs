//! End to end through the REST API with a real Linux guest: inside the
//! nested host (hardware virtualization), `torpor serve` builds a Linux
//! template from the guest kernel and the Debian rootfs, creates a sandbox
//! from it, runs commands and moves files through the API (the `torpor
//! sandbox` CLI is the HTTP client), hibernates it, and checks that the next
//! exec woke it transparently, with its disk and a wall clock the
//! post-restore hook set. Then memory comes back (virtio-balloon): a guest
//! allocates and frees 256 MiB and its VMM's PSS drops by 200 MiB within
//! [`RETURN_LIMIT_S`] while a second clone's template pages stay shared;
//! the hibernation diff of the guest that freed it is smaller than one
//! holding it; an inflated balloon survives hibernation and wake.
//!
//! Needs the guest kernel, the agent and the rootfs like `nested_linux.rs`
//! (`scripts/setup test` builds them); `TORPOR_SKIP_NESTED=1 scripts/test` leaves it out
//! (the test itself never skips).

mod common;

use std::time::Duration;

use common::linux::{field, linux_host, run_logged};

/// The burst a guest allocates and frees (MiB), and what must come back.
const BURST_MIB: u64 = 256;
const RETURNED_MIB: u64 = 200;
/// How long the guest may take to give it back (free page reporting: the
/// guest kernel reports free pages 2 s after they gather, a sixteenth of
/// them per pass; the nested guest runs far slower than native).
const RETURN_LIMIT_S: u64 = 180;

const SCRIPT: &str = r#"
test -c /dev/kvm || { echo 'L1 has no /dev/kvm'; exit 97; }
ip link set lo up 2>/dev/null || ifconfig lo 127.0.0.1 up
T=/opt/torpor/torpor
export TORPOR_API=http://127.0.0.1:7700 TORPOR_TOKEN=nested-token
# /opt/torpor/* are symlinks into L1's payload disk and images are opened
# through no symlink: the files themselves move into the images directory.
IMAGES="$(dirname "$(readlink -f /opt/torpor/rootfs.ext4)")/images"
mkdir -p "$IMAGES/debian"
mv "$(readlink -f /opt/torpor/vmlinux)" "$(readlink -f /opt/torpor/rootfs.ext4)" "$IMAGES/debian/"
# L1's /tmp is a tmpfs: a guest's write to a hole of its memory file also
# puts a shmem page in the file, charged to its VMM (docs/vmm.md,
# Restore), so the burst below needs more than 512 + 96 MiB.
$T serve --data-dir /tmp/data --token nested-token --keep-alive-ms 3600000 \
   --images-dir "$IMAGES" --request-timeout-ms 600000 \
   --sandbox-memory-max-mib 1280 --volume-max-mib 4 >/tmp/serve.log 2>&1 &
SERVE=$!
i=0; until $T template list >/dev/null 2>&1 || [ $i -ge 150 ]; do sleep 0.2; i=$((i+1)); done
sed 's/^/serve-log /' /tmp/serve.log
t0=$(cut -d' ' -f1 /proc/uptime)
@TEMPLATE_CREATE_SH@
tpl_create /tmp/tpl debian --kind linux --image debian --mem-mib 512 --vcpus 1
echo "template rc=$? id=$(cat /tmp/tpl) uptime=$t0..$(cut -d' ' -f1 /proc/uptime)"
$T template get debian | sed 's/^/template-info /'
SBX=$($T sandbox create --template debian 2>/tmp/create.err)
echo "sandbox rc=$? id=$SBX err=$(cat /tmp/create.err)"
$T sandbox exec "$SBX" -- echo hello-through-the-api; echo "exec1 rc=$?"
$T sandbox exec "$SBX" -- python3 -c 'import os, socket; print("py", 6 * 7, os.cpu_count(), socket.gethostname())'
echo "exec2 rc=$?"
$T sandbox exec "$SBX" -- sh -c 'echo to-stderr >&2; exit 5'; echo "exec3 rc=$?"
$T sandbox exec "$SBX" --stream -- sh -c 'echo s1; sleep 3; echo s2' |
  while read -r l; do echo "streamed $l at=$(cut -d' ' -f1 /proc/uptime)"; done
$T sandbox exec "$SBX" --stream -- sh -c 'echo stream-err >&2; exit 4'; echo "stream rc=$?"
printf 'file-through-the-api\n' >/tmp/note.txt
$T sandbox files put "$SBX" /root/api/note.txt --from /tmp/note.txt; echo "put rc=$?"
echo "get: $($T sandbox files get "$SBX" /root/api/note.txt)"
$T sandbox files ls "$SBX" /root/api | sed 's/^/ls /'
$T sandbox files get "$SBX" /root/api/missing; echo "missing rc=$?"
$T sandbox hibernate "$SBX"
$T sandbox get "$SBX" | grep '^state' | sed 's/^/after-hibernate /'
sleep 20
$T sandbox exec "$SBX" --json -- date +%s >/tmp/woke.json; echo "woke rc=$?"
tr -d '\n ' </tmp/woke.json; echo
echo "clock host=$(date +%s) guest=$(sed -n 's/.*"stdout": *"\([0-9]*\).*/\1/p' /tmp/woke.json)"
echo "after-wake: $($T sandbox exec "$SBX" -- cat /root/api/note.txt)"
$T sandbox exec "$SBX" -- cat /proc/sys/kernel/hostname | sed 's/^/hostname /'

# --- a volume in the guest (E2B's volumeMounts: NFS through the agent) -----
# Made through E2B's volume API, a file put in it on the host side, then a
# sandbox that mounts it (`/v1`'s volume_mounts): reads, writes, a process
# with its working directory and an open file in it across a hibernation.
api() { wget -q -O - --header "Content-Type: application/json" "$@"; }
VOL=$(api --header "X-API-KEY: nested-token" --post-data '{"name":"shared"}' \
  http://127.0.0.1:7700/volumes | sed -n 's/.*"volumeID": *"\([^"]*\)".*/\1/p')
echo "volume id=$VOL"
printf 'from-the-host\n' >"/tmp/data/volumes/$VOL/content/hello.txt"
VS=$(api --header "Authorization: Bearer nested-token" \
  --post-data '{"template":"debian","volume_mounts":[{"name":"shared","path":"/mnt/shared"}]}' \
  http://127.0.0.1:7700/v1/sandboxes | sed -n 's/.*"id": *"\(sbx_[^"]*\)".*/\1/p')
echo "volume-sandbox id=$VS"
vx() { $T sandbox exec "$VS" -- timeout 60 "$@"; }
echo "volume-read: $(vx cat /mnt/shared/hello.txt)"
vx sh -c 'echo from-the-guest >/mnt/shared/guest.txt && mkdir -p /mnt/shared/d && echo kept >/mnt/shared/d/f'
echo "volume-write rc=$?"
echo "volume-host: $(cat "/tmp/data/volumes/$VOL/content/guest.txt") $(cat "/tmp/data/volumes/$VOL/content/d/f")"
echo "volume-owner: $(vx stat -c '%u:%g' /mnt/shared/guest.txt)"
vx sh -c 'cd /mnt/shared/d && setsid sh -c "echo \$\$ >/tmp/volpid; exec 3</mnt/shared/d/f; while sleep 1; do :; done" </dev/null >/dev/null 2>&1 &'
$T sandbox hibernate "$VS" >/dev/null; echo "volume-hibernate rc=$?"
printf 'while-hibernated\n' >"/tmp/data/volumes/$VOL/content/later.txt"
echo "volume-after-wake: $(vx cat /mnt/shared/guest.txt /mnt/shared/later.txt | tr '\n' ' ')"
echo "volume-cwd: $(vx sh -c 'p=$(cat /tmp/volpid); readlink /proc/$p/cwd; cat /proc/$p/fd/3' | tr '\n' ' ')"
# The volume's size limit (--volume-max-mib 4) holds for what the guest
# writes: the write past it fails, the host's file stops short, and a
# removal frees the room again.
echo "volume-quota: $(vx sh -c 'dd if=/dev/zero of=/mnt/shared/big bs=1M count=8 conv=fsync 2>&1; echo rc=$?' | grep -o 'Disk quota exceeded\|rc=[0-9]*' | sort -u | tr '\n' ' ')"
echo "volume-quota-file size=$(stat -c %s "/tmp/data/volumes/$VOL/content/big")"
vx rm -f /mnt/shared/big
echo "volume-quota-freed: $(vx sh -c 'head -c 3000000 /dev/zero >/mnt/shared/again && sync && echo ok')"
# Its entries too (4 MiB: at most 1,024 names): empty files stop being
# made at the limit, the host holds no more, and removing them frees it.
# (Over a thousand creates through NFS under TCG: more than vx's minute.)
echo "volume-entries: $($T sandbox exec "$VS" -- timeout 300 sh -c 'mkdir /mnt/shared/many && cd /mnt/shared/many && seq -f f%g 0 1099 | xargs touch 2>&1 | grep -m1 -o "Disk quota exceeded"; echo made=$(ls | wc -l)' | tr '\n' ' ')"
echo "volume-entries-host n=$(ls "/tmp/data/volumes/$VOL/content/many" | wc -l)"
vx rm -rf /mnt/shared/many
echo "volume-entries-freed: $(vx sh -c ': >/mnt/shared/after && echo ok')"
$T sandbox rm "$VS"

# --- memory comes back: virtio-balloon free page reporting ------------------
# A witness clone of the same template keeps its template pages shared.
# A sandbox that failed ends the script at once, with what says why.
failed() { [ "$($T sandbox get "$1" 2>/dev/null | sed -n 's/^state: *//p')" = failed ]; }
finish() {
  kill $SERVE; wait
  # What went wrong, if anything (a VMM that ended by itself is logged with
  # its log's and its guest console's last lines).
  grep -a ' WARN \| ERROR ' /tmp/serve.log | tail -n 20 | cut -c1-3000 | sed 's/^/serve-warn /'
}
abort() {
  echo "abort: $1"
  $T sandbox get "$W" | sed 's/^/witness-info /'
  dmesg | tail -n 40 | sed 's/^/dmesg /'
  free -m | sed 's/^/free /'
  finish
  exit 1
}
W=$($T sandbox create --template debian 2>/tmp/createw.err)
echo "witness rc=$? id=$W err=$(cat /tmp/createw.err)"
row() { $T sandbox get "$1" | sed -n "s/^$2: *//p" | sed 's/ KiB$//'; }
pss() { awk '/^Pss:/ {print $2}' "/proc/$1/smaps_rollup"; }
shared() { awk '/^Shared_(Clean|Dirty):/ {s += $2} END {print s + 0}' "/proc/$1/smaps_rollup"; }
now() { cut -d' ' -f1 /proc/uptime; }
P=$(row "$SBX" 'vmm pid') PW=$(row "$W" 'vmm pid')
sleep 5
P0=$(pss "$P") S0=$(shared "$PW")
# The burst: held for 20 s, then freed (the process exits).
$T sandbox exec --timeout-ms 300000 "$SBX" -- python3 -c "import time; b = b'\x01' * (@BURST_MIB@ << 20); time.sleep(20); print(len(b) >> 20)" >/tmp/burst 2>/tmp/burst.err &
BP=$!
PEAK=$P0
while kill -0 $BP 2>/dev/null; do v=$(pss "$P"); [ "$v" -gt "$PEAK" ] && PEAK=$v; sleep 1; done
echo "burst pss0_kib=$P0 peak_kib=$PEAK guest=$(cat /tmp/burst) err=$(head -c 300 /tmp/burst.err | tr '\n' ' ')"
t0=$(now) AFTER=$PEAK
while :; do
  AFTER=$(pss "$P"); el=$(awk -v a="$t0" -v b="$(now)" 'BEGIN {printf "%d", b - a}')
  [ $((PEAK - AFTER)) -ge $((@RETURNED_MIB@ * 1024)) ] && break
  [ "$el" -ge @RETURN_LIMIT_S@ ] && break
  sleep 1
done
echo "returned pss_kib=$AFTER after_s=$el"
echo "witness-pages shared0_kib=$S0 shared1_kib=$(shared "$PW")"
echo "api pss_kib=$(row "$SBX" 'host pss') guest_used_kib=$(row "$SBX" 'guest used') reported_kib=$(row "$SBX" 'reported free')"
# Hibernation diffs: of the guest that freed its burst, and of the witness
# while it holds one.
$T sandbox exec "$W" -- sh -c "setsid python3 -c \"import time; b = b'\\x01' * (@BURST_MIB@ << 20); open('/tmp/held', 'w').close(); time.sleep(3600)\" </dev/null >/dev/null 2>&1 &"
i=0; until $T sandbox exec "$W" -- test -f /tmp/held 2>/dev/null || [ $i -ge 600 ] || failed "$W"; do sleep 1; i=$((i+1)); done
failed "$W" && abort "the witness $W failed while holding its burst"
$T sandbox hibernate "$SBX" >/dev/null; $T sandbox hibernate "$W" >/dev/null || abort "the witness $W did not hibernate"
D1=$(row "$SBX" snapshot) D2=$(row "$W" snapshot)
echo "diff freed_kib=$(du -sk "$D1" | cut -f1) held_kib=$(du -sk "$D2" | cut -f1)"
# A balloon inflated across hibernation and wake.
$T sandbox exec "$W" -- true
bal() { $T vmm balloon --socket "$(row "$W" 'vmm socket')" "$@"; }
num() { grep -o "\"$1\":[0-9]*" | cut -d: -f2; }
bal --target-mib 128 >/dev/null || abort "the witness's balloon did not answer"
i=0; until [ "$(bal | num actual_mib)" = 128 ] || [ $i -ge 120 ]; do sleep 1; i=$((i+1)); done
echo "inflated actual_mib=$(bal | num actual_mib) api=$(row "$W" balloon | tr -d ' ,')"
$T sandbox hibernate "$W" >/dev/null
$T sandbox exec "$W" -- echo woke >/dev/null && ok=ok || ok=failed
B=$(bal)
echo "restored target_mib=$(echo "$B" | num target_mib) actual_mib=$(echo "$B" | num actual_mib) exec=$ok"
bal --target-mib 0 >/dev/null || abort "the witness's balloon did not answer after its wake"
i=0; until [ "$(bal | num actual_mib)" = 0 ] || [ $i -ge 120 ]; do sleep 1; i=$((i+1)); done
echo "deflated actual_mib=$(bal | num actual_mib)"
$T sandbox rm "$W"
$T sandbox rm "$SBX"
finish
"#;

#[test]
fn nested_linux_sandbox_through_the_api_exec_files_hibernate_wake() {
    let (host, _scratch) = linux_host("service", &[]);
    let script = SCRIPT
        .replace("@BURST_MIB@", &BURST_MIB.to_string())
        .replace("@RETURNED_MIB@", &RETURNED_MIB.to_string())
        .replace("@RETURN_LIMIT_S@", &RETURN_LIMIT_S.to_string())
        .replace("@TEMPLATE_CREATE_SH@", torpor_nested::TEMPLATE_CREATE_SH);
    let run = run_logged(&host, "nested_service", &script, Duration::from_secs(1200));
    let o = &run.stdout;
    eprintln!("{o}");
    assert_ne!(run.exit_code, 97, "{o}");
    if let Some(why) = o.lines().find(|l| l.starts_with("abort: ")) {
        panic!("{why}:\n{o}");
    }

    // The service jails its VMMs in L1 too (unjailed, it warns).
    assert!(!o.contains("without a jail"), "{o}");
    // The pod says it runs Linux templates here (hardware virtualization).
    assert!(
        o.contains("serve-log torpor serve: the local pod runs template kinds: probe, linux"),
        "{o}"
    );
    assert_eq!(
        field(o, "template", "rc"),
        Some("0"),
        "template create failed:\n{o}"
    );
    assert!(
        o.contains("template-info state") && o.contains("ready"),
        "{o}"
    );
    assert_eq!(
        field(o, "sandbox", "rc"),
        Some("0"),
        "sandbox create failed:\n{o}"
    );
    let sbx = field(o, "sandbox", "id").unwrap();
    assert!(sbx.starts_with("sbx_"), "{o}");

    assert!(
        o.contains("hello-through-the-api\nexec1 rc=0"),
        "echo failed:\n{o}"
    );
    let hostname = sbx.replace('_', "-");
    assert!(
        o.contains(&format!("py 42 1 {hostname}\nexec2 rc=0")),
        "python3 (2 vCPUs, hostname set by the resumed hook) failed:\n{o}"
    );
    assert!(
        o.contains("to-stderr\nexec3 rc=5"),
        "exit status not passed through:\n{o}"
    );
    // A volume mounted in the guest over NFS: both ways, owned by the
    // guest's `user`, and across a hibernation a process's working
    // directory and open file in it, and what the host wrote meanwhile.
    assert!(o.contains("volume-read: from-the-host\n"), "{o}");
    assert!(o.contains("volume-write rc=0"), "{o}");
    assert!(o.contains("volume-host: from-the-guest kept\n"), "{o}");
    assert!(o.contains("volume-owner: 1000:1000\n"), "{o}");
    assert!(
        o.contains("volume-after-wake: from-the-guest while-hibernated \n"),
        "{o}"
    );
    assert!(o.contains("volume-cwd: /mnt/shared/d kept \n"), "{o}");
    // Past --volume-max-mib the guest's write fails (EDQUOT), the volume
    // holds no more than its limit, and a removal frees the room.
    assert!(
        o.contains("volume-quota: Disk quota exceeded rc=1 \n"),
        "{o}"
    );
    let size: u64 = field(o, "volume-quota-file", "size")
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no size of the file written past the limit:\n{o}"));
    assert!(size <= 4 << 20, "{size} bytes past a 4 MiB volume:\n{o}");
    assert!(o.contains("volume-quota-freed: ok\n"), "{o}");
    // Past its entries (1,024 at 4 MiB) no name more is made: the guest's
    // create fails with EDQUOT, and the host holds what the guest made.
    let made: u64 = field(o, "volume-entries:", "made")
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count of the entries made:\n{o}"));
    assert!((1000..1024).contains(&made), "{made} entries made:\n{o}");
    assert!(
        o.contains(&format!(
            "volume-entries: Disk quota exceeded made={made} \n"
        )),
        "{o}"
    );
    assert!(
        o.contains(&format!("volume-entries-host n={made}\n")),
        "{o}"
    );
    assert!(o.contains("volume-entries-freed: ok\n"), "{o}");
    // The stream delivered s1 while the command still ran (3 s before s2).
    let at = |tag: &str| -> f64 {
        field(o, &format!("streamed {tag}"), "at")
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no streamed {tag}:\n{o}"))
    };
    assert!(at("s2") - at("s1") >= 2.0, "output was not streamed:\n{o}");
    assert!(
        o.contains("stream-err\nstream rc=4"),
        "stream exit status:\n{o}"
    );
    assert!(o.contains("put rc=0"), "{o}");
    assert!(
        o.contains("get: file-through-the-api\n"),
        "file round trip failed:\n{o}"
    );
    assert!(
        o.lines()
            .any(|l| l.starts_with("ls file") && l.ends_with("note.txt")),
        "listing failed:\n{o}"
    );
    assert!(
        o.contains("(HTTP 404 not_found)\nmissing rc=1"),
        "missing file is not 404:\n{o}"
    );
    assert!(
        o.contains("after-hibernate state") && o.contains("hibernated"),
        "{o}"
    );

    // The exec after hibernation woke it, said so, and the clock is the
    // host's again (without the hook it would lag by the 20 s asleep).
    assert!(o.contains("woke rc=0"), "{o}");
    assert!(
        o.contains("\"resumed\":true"),
        "the exec did not report the wake:\n{o}"
    );
    let resume_ms: f64 = o
        .split("\"resume_ms\":")
        .nth(1)
        .and_then(|r| r.split([',', '}']).next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no resume_ms:\n{o}"));
    assert!(resume_ms > 0.0, "{o}");
    let host_s: i64 = field(o, "clock", "host").unwrap().parse().unwrap();
    let guest_s: i64 = field(o, "clock", "guest")
        .and_then(|g| g.parse().ok())
        .unwrap_or_else(|| panic!("no guest clock:\n{o}"));
    assert!(
        (host_s - guest_s).abs() <= 5,
        "guest clock {guest_s} vs host {host_s}: not set after the wake:\n{o}"
    );
    assert!(
        o.contains("after-wake: file-through-the-api"),
        "disk lost across hibernation:\n{o}"
    );
    assert!(o.contains(&format!("hostname {hostname}")), "{o}");
    eprintln!("nested_service: wake through the API resume_ms={resume_ms:.1}");
    check_memory(o);
}

fn num(o: &str, tag: &str, key: &str) -> u64 {
    field(o, tag, key)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no number {tag} {key}:\n{o}"))
}

/// Memory comes back from a running Linux guest, as the issue asks: a
/// 256 MiB burst freed returns at least 200 MiB of its VMM's PSS within
/// the limit; a clone's template pages stay shared meanwhile; the API
/// shows the sandbox's memory; an inflated balloon survives hibernation
/// and wake.
fn check_memory(o: &str) {
    assert_eq!(field(o, "witness", "rc"), Some("0"), "{o}");
    let before = num(o, "burst", "pss0_kib");
    let peak = num(o, "burst", "peak_kib");
    assert_eq!(
        field(o, "burst", "guest"),
        Some(BURST_MIB.to_string().as_str()),
        "{o}"
    );
    assert!(
        peak >= before + (RETURNED_MIB << 10),
        "the guest's burst did not show on the host (PSS {before} -> {peak} KiB):\n{o}"
    );
    let after = num(o, "returned", "pss_kib");
    assert!(
        peak - after >= RETURNED_MIB << 10,
        "PSS fell only {} KiB within {RETURN_LIMIT_S} s:\n{o}",
        peak - after
    );
    // The API's figures: the host PSS it reads and the guest's statistics.
    assert!(num(o, "api", "pss_kib") > 0, "{o}");
    assert!(num(o, "api", "guest_used_kib") > 0, "{o}");
    assert!(num(o, "api", "reported_kib") >= RETURNED_MIB << 10, "{o}");
    let shared0 = num(o, "witness-pages", "shared0_kib");
    let shared1 = num(o, "witness-pages", "shared1_kib");
    assert!(shared0 > 0, "{o}");
    assert!(
        shared1 * 100 >= shared0 * 95,
        "the witness clone lost shared pages ({shared0} -> {shared1} KiB):\n{o}"
    );
    assert_eq!(field(o, "inflated", "actual_mib"), Some("128"), "{o}");
    assert!(
        field(o, "inflated", "api").is_some_and(|a| a.contains("actual128MiB")),
        "the API does not show the balloon:\n{o}"
    );
    assert_eq!(field(o, "restored", "target_mib"), Some("128"), "{o}");
    assert_eq!(field(o, "restored", "actual_mib"), Some("128"), "{o}");
    assert_eq!(field(o, "restored", "exec"), Some("ok"), "{o}");
    assert_eq!(field(o, "deflated", "actual_mib"), Some("0"), "{o}");
    let freed = num(o, "diff", "freed_kib");
    let held = num(o, "diff", "held_kib");
    assert!(
        held >= freed + (RETURNED_MIB << 10),
        "the diff of a guest that freed its burst ({freed} KiB) is not smaller than one \
         holding it ({held} KiB):\n{o}"
    );
    eprintln!(
        "nested_service: burst {BURST_MIB} MiB, PSS {before} -> {peak} -> {after} KiB in {} s; \
         hibernation diff holding it {held} KiB, after freeing it {freed} KiB",
        field(o, "returned", "after_s").unwrap_or("?")
    );
}
