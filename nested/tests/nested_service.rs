//! End to end through the REST API with a real Linux guest: inside the
//! nested host (hardware virtualization), `torpor serve` builds a Linux
//! template from the guest kernel and the Debian rootfs, creates a sandbox
//! from it, runs commands and moves files through the API (the `torpor
//! sandbox` CLI is the HTTP client), hibernates it, and checks that the next
//! exec woke it transparently, with its disk and a wall clock the
//! post-restore hook set.
//!
//! Needs the guest kernel, the agent and the rootfs like `nested_linux.rs`
//! (`.ci/run` builds them); `TORPOR_SKIP_NESTED=1 scripts/test` leaves it out
//! (the test itself never skips).

mod common;

use std::time::Duration;

use common::linux::{field, linux_host, run_logged};

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
$T serve --data-dir /tmp/data --token nested-token --keep-alive-ms 3600000 \
   --images-dir "$IMAGES" --request-timeout-ms 600000 >/tmp/serve.log 2>&1 &
SERVE=$!
i=0; until $T template list >/dev/null 2>&1 || [ $i -ge 150 ]; do sleep 0.2; i=$((i+1)); done
sed 's/^/serve-log /' /tmp/serve.log
t0=$(cut -d' ' -f1 /proc/uptime)
$T template create --name debian --kind linux --image debian \
   --mem-mib 512 --vcpus 2 >/tmp/tpl 2>&1
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
$T sandbox rm "$SBX"
kill $SERVE; wait
"#;

#[test]
fn nested_linux_sandbox_through_the_api_exec_files_hibernate_wake() {
    let (host, _scratch) = linux_host("service", &[common::linux::torpor_vmm()]);
    let run = run_logged(&host, "nested_service", SCRIPT, Duration::from_secs(1500));
    let o = &run.stdout;
    eprintln!("{o}");
    assert_ne!(run.exit_code, 97, "{o}");

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
        o.contains(&format!("py 42 2 {hostname}\nexec2 rc=0")),
        "python3 (2 vCPUs, hostname set by the resumed hook) failed:\n{o}"
    );
    assert!(
        o.contains("to-stderr\nexec3 rc=5"),
        "exit status not passed through:\n{o}"
    );
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
}
