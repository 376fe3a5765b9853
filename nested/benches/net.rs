//! Network benchmark of a Linux guest in the nested host: torpor's
//! virtio-net against QEMU's own (virtio-net on a tap, vhost off) in the
//! same L1, so TCG's slowness cancels out of the ratios.
//!
//! The same guest kernel and Debian rootfs boot once under each VMM
//! (`torpor vmm --net tap=tap0`; `qemu-system-x86_64 -M microvm
//! -enable-kvm` with `virtio-net-device`, `vhost=off`), 1 vCPU, 512 MiB,
//! on a tap in L1 (172.16.0.1/30, the guest 172.16.0.2). A service of the
//! rootfs starts `iperf3 -s` and a small HTTP server in the guest. From L1:
//! host→guest and guest→host TCP throughput (iperf3, `-R` for the
//! latter), the latency of a small HTTP request (curl, keep-alive off:
//! connect, request, answer), and for torpor the time from a restore of a
//! snapshot of that guest (a wake) to its first answered request.
//!
//! QEMU loads an uncompressed `vmlinux` only with a PVH ELF note: the
//! guest kernel needs `CONFIG_PVH=y` for the QEMU column (without it QEMU
//! says "Error loading uncompressed kernel without PVH ELF Note" and the
//! table has torpor's numbers only).
//!
//! `cargo bench -p torpor-nested --bench net [-- --runs N]` (default 3
//! runs of each measurement; needs the torpor binary, this host's
//! `qemu-system-x86_64`, `iperf3`, `ip` and `curl`, and the rootfs with
//! iperf3). Under `cargo test` (no `--bench`) it only checks its script
//! and parser: no QEMU.

#[path = "../tests/common/linux.rs"]
mod linux;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

const ENGINES: &[&str] = &["torpor", "qemu"];
/// Small HTTP requests per engine and run.
const REQUESTS: usize = 20;
/// Seconds of each iperf3 run.
const IPERF_S: u32 = 8;

/// The rootfs service starting the guest's servers.
const SERVICE: &str = "#!/bin/sh
# nested net bench: iperf3 server and a small HTTP server.
iperf3 -s -D >/dev/null 2>&1
mkdir -p /srv/bench && echo small-response >/srv/bench/small.txt
cd /srv/bench && setsid python3 -m http.server 8080 </dev/null >/dev/null 2>&1 &
";

/// The script L1 runs. Lines for the parser:
/// `bench <metric> <engine> <value>` and `bench-fail <what> …`.
fn l1_script(runs: usize) -> String {
    r#"
test -c /dev/kvm || { echo 'bench-fail setup L1 has no /dev/kvm'; exit 97; }
T=/opt/torpor/torpor
# iproute2's ip (carried): busybox sh runs its own applet for a bare `ip`.
IP=/usr/local/sbin/ip
export TMPDIR=/tmp
# QEMU keeps a snapshot=on drive's overlay in /var/tmp (not in L1's initramfs).
mkdir -p /var/tmp
CMDLINE="console=ttyS0 reboot=k panic=-1 quiet root=/dev/vda rw init=/sbin/init"
now() { cut -d' ' -f1 /proc/uptime; }
ms() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%d", (b - a) * 1000}'; }
$IP link set lo up
tap() { $IP tuntap add tap0 mode tap && $IP addr add 172.16.0.1/30 dev tap0 && $IP link set tap0 up; }
# Waits for the guest's HTTP server (up to 600 s, or until VMM pid $1 is gone).
ready() {
  i=0
  until curl -s --max-time 2 -o /dev/null http://172.16.0.2:8080/small.txt || [ $i -ge 300 ]; do
    kill -0 "$1" 2>/dev/null || return 1
    sleep 2; i=$((i+1))
  done
  [ $i -lt 300 ]
}
measure() { # engine
  for r in $(seq 1 @RUNS@); do
    v=$(iperf3 -c 172.16.0.2 -t @IPERF_S@ -f m 2>&1 | awk '/receiver/ {print $(NF-2)}')
    [ -n "$v" ] && echo "bench h2g_mbps $1 $v" || echo "bench-fail h2g $1 run $r"
    v=$(iperf3 -c 172.16.0.2 -t @IPERF_S@ -f m -R 2>&1 | awk '/receiver/ {print $(NF-2)}')
    [ -n "$v" ] && echo "bench g2h_mbps $1 $v" || echo "bench-fail g2h $1 run $r"
    for i in $(seq 1 @REQUESTS@); do
      v=$(curl -s -o /dev/null --max-time 30 -H 'Connection: close' -w '%{time_total}' http://172.16.0.2:8080/small.txt) &&
        echo "bench http_ms $1 $(awk -v t="$v" 'BEGIN {printf "%.2f", t * 1000}')"
    done
  done
}

# --- torpor ---------------------------------------------------------------
tap
$T vmm --kernel /opt/torpor/vmlinux --disk /opt/torpor/rootfs.ext4 --disk-overlay /tmp/ov \
   --vsock-uds /tmp/v.sock --mem-mib 512 --net tap=tap0 --cmdline "$CMDLINE" \
   --serial /tmp/torpor.log --control-socket /tmp/c.sock &
if ready $!; then
  measure torpor
  # Wake to first answered request: snapshot this guest, restore it.
  $T vmm pause --socket /tmp/c.sock >/dev/null
  $T vmm snapshot --socket /tmp/c.sock --out /tmp/snap >/dev/null || echo "bench-fail snapshot"
  $T vmm shutdown --socket /tmp/c.sock >/dev/null; wait
  for r in $(seq 1 @RUNS@); do
    rm -f /tmp/ov$r /tmp/v$r.sock /tmp/c$r.sock
    t0=$(now)
    $T vmm --restore /tmp/snap --disk-overlay /tmp/ov$r --vsock-uds /tmp/v$r.sock \
       --net tap=tap0 --no-serial --control-socket /tmp/c$r.sock &
    i=0; until curl -s --max-time 1 -o /dev/null http://172.16.0.2:8080/small.txt || [ $i -ge 600 ]; do i=$((i+1)); done
    t1=$(now)
    [ $i -lt 600 ] && echo "bench wake_ms torpor $(ms $t0 $t1)" || echo "bench-fail wake run $r"
    $T vmm shutdown --socket /tmp/c$r.sock >/dev/null; wait
  done
else
  echo "bench-fail torpor the guest never answered"; tail -n 20 /tmp/torpor.log
  $T vmm shutdown --socket /tmp/c.sock >/dev/null; wait
fi
$IP link del tap0

# --- QEMU's own virtio-net (vhost off), same guest --------------------------
tap
/opt/qemu/qemu-system-x86_64 -L /opt/qemu -M microvm,acpi=off -enable-kvm -cpu host -m 512 -smp 1 \
   -nodefaults -no-user-config -nographic -serial file:/tmp/qemu.log \
   -kernel /opt/torpor/vmlinux -append "$CMDLINE" \
   -drive id=root,file=/opt/torpor/rootfs.ext4,format=raw,if=none,snapshot=on \
   -device virtio-blk-device,drive=root \
   -netdev tap,id=n0,ifname=tap0,script=no,downscript=no,vhost=off \
   -device virtio-net-device,netdev=n0 >/tmp/qemu.out 2>&1 &
Q=$!
if ready $Q; then
  measure qemu
else
  echo "bench-fail qemu the guest never answered"; tail -n 20 /tmp/qemu.log /tmp/qemu.out
fi
kill $Q; wait
echo bench-done
"#
    .replace("@RUNS@", &runs.to_string())
    .replace("@IPERF_S@", &IPERF_S.to_string())
    .replace("@REQUESTS@", &REQUESTS.to_string())
}

#[derive(Debug, Default)]
struct Samples {
    /// (metric, engine) -> values.
    values: BTreeMap<(String, String), Vec<f64>>,
    failures: Vec<String>,
    done: bool,
}

fn parse_output(text: &str) -> Result<Samples, String> {
    let mut s = Samples::default();
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words[..] {
            ["bench", metric, engine, value] => {
                let v: f64 = value
                    .parse()
                    .map_err(|_| format!("not a number {value:?} in {line:?}"))?;
                if !v.is_finite() || v < 0.0 {
                    return Err(format!("bad value in {line:?}"));
                }
                s.values
                    .entry((metric.to_string(), engine.to_string()))
                    .or_default()
                    .push(v);
            }
            ["bench-fail", ..] => s.failures.push(line.to_string()),
            ["bench-done"] => s.done = true,
            _ => {}
        }
    }
    Ok(s)
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    if v.len() % 2 == 1 {
        v[v.len() / 2]
    } else {
        (v[v.len() / 2 - 1] + v[v.len() / 2]) / 2.0
    }
}

/// Table rows: metric, label, higher is better.
const ROWS: &[(&str, &str, bool)] = &[
    ("h2g_mbps", "host -> guest TCP (iperf3), Mbit/s", true),
    ("g2h_mbps", "guest -> host TCP (iperf3 -R), Mbit/s", true),
    ("http_ms", "small HTTP request (new connection), ms", false),
    (
        "wake_ms",
        "restore (wake) -> first answered request, ms",
        false,
    ),
];

fn table(s: &Samples) -> String {
    const W: usize = 46;
    let mut out = format!(
        "{:<W$} {:>6} {:>10} {:>10} {:>14}\n",
        "median (timed in L1)", "n", "torpor", "qemu", "torpor / qemu"
    );
    for (metric, label, higher) in ROWS {
        let get = |engine: &str| s.values.get(&(metric.to_string(), engine.to_string()));
        let (t, q) = (get("torpor"), get("qemu"));
        let n = t.map_or(0, Vec::len).max(q.map_or(0, Vec::len));
        let cell =
            |v: Option<&Vec<f64>>| v.map_or("-".to_string(), |v| format!("{:.1}", median(v)));
        let ratio = match (t, q) {
            (Some(t), Some(q)) if median(q) > 0.0 => {
                let r = median(t) / median(q);
                format!(
                    "{r:.2}{}",
                    if *higher {
                        " (>1 faster)"
                    } else {
                        " (<1 faster)"
                    }
                )
            }
            _ => "-".to_string(),
        };
        out.push_str(&format!(
            "{label:<W$} {n:>6} {:>10} {:>10} {ratio:>14}\n",
            cell(t),
            cell(q)
        ));
    }
    out
}

fn tool(name: &str) -> PathBuf {
    linux::host_tool(name, "iperf3 iproute2 curl qemu-system-x86")
}

fn smoke(runs: usize) {
    let script = l1_script(runs);
    assert!(!script.contains('@'), "a placeholder is left in the script");
    for e in ENGINES {
        assert!(script.contains(&format!("measure {e}")), "no {e} runs");
    }
    let sample = "bench h2g_mbps torpor 100.5\nbench h2g_mbps qemu 201\n\
                  bench http_ms torpor 4.00\nbench-fail wake run 1\nbench-done\n";
    let parsed = parse_output(sample).expect("parse the sample");
    assert_eq!(
        parsed.values[&("h2g_mbps".to_string(), "qemu".to_string())],
        vec![201.0]
    );
    assert_eq!(parsed.failures.len(), 1);
    assert!(parse_output("bench http_ms torpor NaN").is_err());
    assert!(parse_output("bench http_ms torpor x").is_err());
    let t = table(&parsed);
    assert!(t.contains("0.50 (>1 faster)"), "{t}");
    println!(
        "net bench smoke: L1 script and parser checked; no QEMU started \
         (cargo bench -p torpor-nested --bench net runs it)"
    );
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let full = args.iter().any(|a| a == "--bench");
    let runs = match args.iter().position(|a| a == "--runs") {
        Some(i) => match args.get(i + 1).and_then(|v| v.parse().ok()) {
            Some(n) if n > 0 => n,
            _ => {
                eprintln!("net bench: --runs needs a positive number");
                std::process::exit(2);
            }
        },
        None => 3,
    };
    if !full {
        smoke(runs);
        return;
    }
    let overlay = tempfile::Builder::new()
        .prefix("torpor-nested-netbench-overlay-")
        .tempdir()
        .unwrap();
    let svc = overlay.path().join("etc/torpor/init.d/50-netbench");
    std::fs::create_dir_all(svc.parent().unwrap()).unwrap();
    std::fs::write(&svc, SERVICE).unwrap();
    std::fs::set_permissions(&svc, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    // The microvm machine's firmware (qboot) and the option ROM that enters
    // a vmlinux at its PVH note.
    let qemu_share = Path::new("/usr/share/qemu");
    let (host, _scratch) = linux::linux_host_with(
        "netbench",
        &[
            (tool("ip"), "/usr/local/sbin/ip"),
            (tool("iperf3"), "/usr/local/bin/iperf3"),
            (tool("curl"), "/usr/local/bin/curl"),
            (tool("qemu-system-x86_64"), "/opt/qemu/qemu-system-x86_64"),
            (qemu_share.join("qboot.rom"), "/opt/qemu/qboot.rom"),
            (qemu_share.join("pvh.bin"), "/opt/qemu/pvh.bin"),
        ],
        3072,
        Some(overlay.path()),
    );
    let timeout = Duration::from_secs(1200 + 300 * runs as u64);
    let out = linux::run_logged(&host, "net bench", &l1_script(runs), timeout);
    let samples = match parse_output(&out.stdout) {
        Ok(s) => s,
        Err(e) => panic!("{e}\nL1 output:\n{}", out.stdout),
    };
    println!(
        "Linux guest network benchmark in the nested host (QEMU/TCG -cpu max, kvm_amd in L1)\n\
         guest: our kernel + Debian rootfs, 512 MiB, 1 vCPU, tap in L1; {runs} runs \
         ({IPERF_S} s iperf3 each way, {REQUESTS} HTTP requests); L1 boot {:.1}s (not counted)\n\
         torpor: torpor vmm --net tap=tap0; qemu: qemu-system-x86_64 -M microvm -enable-kvm, \
         virtio-net-device, vhost=off\n\
         caveat: TCG emulates L1 and both guests: absolute numbers are far below hardware; \
         read the ratios.\n",
        out.boot.as_secs_f64()
    );
    print!("{}", table(&samples));
    for f in &samples.failures {
        println!("{f}");
    }
    if !samples.failures.is_empty() {
        // What L1 printed besides the measurements (a VMM's error, the
        // guest console's tail).
        println!("L1 output besides the measurements:");
        for line in out.stdout.lines().filter(|l| !l.starts_with("bench ")) {
            println!("  {line}");
        }
    }
    assert!(
        samples.done && !samples.values.is_empty(),
        "the L1 script did not finish (exit {}):\n{}",
        out.exit_code,
        out.stdout
    );
}
