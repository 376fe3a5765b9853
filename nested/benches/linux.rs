//! Linux guest benchmark in the nested host: boot to agent ready, and
//! restore of a template snapshot to the first successful exec, per memory
//! backend, with torpor's VMM on L1's real /dev/kvm.
//!
//! One nested host runs everything; a shell script in L1 takes every time
//! with L1's own clock (`/proc/uptime`, 10 ms steps: L1's busybox `date`
//! has no `%N`) around `torpor vmm` and the first `torpor vmm ping` / `exec`
//! that succeeds, so QEMU's start-up and L1's boot are not in the numbers.
//! Restores also show when the agent first answered (`ping`), and every run
//! the VMM's own start-to-first-`KVM_RUN` (`--report`, in µs). TCG emulates L1 and, through it, the guest:
//! guest-side work is many times slower than on hardware virtualization, so
//! read the numbers as relative (backend against backend), not as what a
//! real host would show.
//!
//! `cargo bench -p torpor-nested --bench linux [-- --runs N]` (default 3
//! runs; needs target/release/torpor, or `TORPOR_BIN`). Under `cargo test`
//! (no `--bench`) it only checks its arguments, script and parser: no QEMU.

#[path = "../tests/common/linux.rs"]
mod linux;

use std::collections::BTreeMap;
use std::time::Duration;

const BACKENDS: &[&str] = &["file", "uffd", "uffd-shared"];
const GUEST_MIB: u32 = 512;

#[derive(Debug, PartialEq)]
struct Options {
    runs: usize,
    /// `--bench` given: really run (otherwise a smoke pass).
    full: bool,
}

fn parse_args(args: &[String]) -> Result<Options, String> {
    let mut opts = Options {
        runs: 3,
        full: false,
    };
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--bench" => opts.full = true,
            "--runs" => {
                let v = it.next().ok_or("--runs needs a number")?;
                opts.runs = match v.parse() {
                    Ok(n) if n > 0 => n,
                    _ => return Err(format!("--runs {v:?}: give a positive number")),
                };
            }
            // cargo passes test filters and the like: not ours.
            _ => {}
        }
    }
    Ok(opts)
}

/// The script L1 runs. Lines it prints for the parser:
/// `bench <phase> <run> <start s> <end s>` (L1 uptime, 2 decimals) and
/// `bench-fail <phase> <run> …`.
fn l1_script(runs: usize) -> String {
    let backends = BACKENDS.join(" ");
    format!(
        r#"
test -c /dev/kvm || {{ echo 'bench-fail setup 0 L1 has no /dev/kvm'; exit 97; }}
T=/opt/torpor/torpor
CMDLINE="console=ttyS0 reboot=k panic=-1 quiet root=/dev/vda rw init=/sbin/init"
# CLOCK_BOOTTIME in 10 ms steps (busybox date has no %N).
now() {{ cut -d' ' -f1 /proc/uptime; }}
# The VMM's own start-to-first-KVM_RUN (its --report line at exit).
vmm_us() {{ grep -o '"first_kvm_run_us":[0-9]*' /tmp/vmm.err | cut -d: -f2; }}
for r in $(seq 1 {runs}); do
  rm -f /tmp/ovb /tmp/vb.sock /tmp/cb.sock
  t0=$(now)
  $T vmm --kernel /opt/torpor/vmlinux --disk /opt/torpor/rootfs.ext4 --disk-overlay /tmp/ovb \
     --vsock-uds /tmp/vb.sock --mem-mib {GUEST_MIB} --cmdline "$CMDLINE" --no-serial \
     --control-socket /tmp/cb.sock --report 2>/tmp/vmm.err &
  if $T vmm ping --vsock-uds /tmp/vb.sock --wait-ms 600000 >/dev/null; then
    t1=$(now); echo "bench boot $r $t0 $t1"
  else
    echo "bench-fail boot $r $(tail -c 300 /tmp/vmm.err | tr '\n' ' ')"; exit 98
  fi
  if [ "$r" = {runs} ]; then
    # The last booted guest becomes the template (after one exec, as a
    # template made for serving would be).
    $T vmm exec --vsock-uds /tmp/vb.sock -- true
    $T vmm pause --socket /tmp/cb.sock >/dev/null
    $T vmm snapshot --socket /tmp/cb.sock --out /tmp/tpl >/dev/null || {{ echo 'bench-fail snapshot 0'; exit 98; }}
  fi
  $T vmm shutdown --socket /tmp/cb.sock >/dev/null; wait
  echo "bench-us boot-vmm $r $(vmm_us)"
done
rm -f /tmp/ovb
for b in {backends}; do
  for r in $(seq 1 {runs}); do
    rm -f /tmp/ovr /tmp/vr.sock /tmp/cr.sock
    t0=$(now)
    $T vmm --restore /tmp/tpl --memory-backend $b --disk-overlay /tmp/ovr \
       --vsock-uds /tmp/vr.sock --no-serial --control-socket /tmp/cr.sock --report 2>/tmp/vmm.err &
    vmm=$!
    if $T vmm ping --vsock-uds /tmp/vr.sock --wait-ms 120000 >/dev/null; then
      t1=$(now)
      if $T vmm exec --vsock-uds /tmp/vr.sock -- true; then
        t2=$(now)
        echo "bench restore-$b-ping $r $t0 $t1"
        echo "bench restore-$b $r $t0 $t2"
        $T vmm shutdown --socket /tmp/cr.sock >/dev/null; wait
        echo "bench-us restore-$b-vmm $r $(vmm_us)"
        continue
      fi
    fi
    echo "bench-fail restore-$b $r $(tail -c 300 /tmp/vmm.err | tr '\n' ' ')"
    $T vmm shutdown --socket /tmp/cr.sock >/dev/null 2>&1; kill $vmm 2>/dev/null; wait
    break
  done
done
echo "bench-done"
"#
    )
}

/// Milliseconds per phase, in run order, and the failures, from L1's output.
#[derive(Debug, Default, PartialEq)]
struct Samples {
    ms: BTreeMap<String, Vec<f64>>,
    failures: Vec<String>,
    done: bool,
}

/// L1 uptime `S.CC` as milliseconds.
fn uptime_ms(v: &str) -> Option<u64> {
    let (secs, centis) = v.split_once('.')?;
    if centis.len() != 2 {
        return None;
    }
    Some(secs.parse::<u64>().ok()? * 1000 + centis.parse::<u64>().ok()? * 10)
}

fn parse_output(out: &str) -> Result<Samples, String> {
    let mut s = Samples::default();
    for line in out.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["bench", phase, _run, t0, t1] => {
                let ms = |v: &str| {
                    uptime_ms(v).ok_or_else(|| format!("not an uptime {v:?} in {line:?}"))
                };
                let (t0, t1) = (ms(t0)?, ms(t1)?);
                if t1 < t0 {
                    return Err(format!("time ran backwards in {line:?}"));
                }
                s.ms.entry(phase.to_string())
                    .or_default()
                    .push((t1 - t0) as f64);
            }
            ["bench-us", phase, _run, us] => {
                let us: u64 = us
                    .parse()
                    .map_err(|_| format!("not microseconds {us:?} in {line:?}"))?;
                s.ms.entry(phase.to_string())
                    .or_default()
                    .push(us as f64 / 1000.0);
            }
            ["bench-fail", ..] => s.failures.push(line.to_string()),
            ["bench-done"] => s.done = true,
            _ => {}
        }
    }
    Ok(s)
}

fn stats(v: &[f64]) -> (f64, f64, f64) {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let median = if v.len() % 2 == 1 {
        v[v.len() / 2]
    } else {
        (v[v.len() / 2 - 1] + v[v.len() / 2]) / 2.0
    };
    (median, v[0], v[v.len() - 1])
}

/// Table rows: sample key, label.
fn rows() -> Vec<(String, String)> {
    let mut rows = vec![
        ("boot-vmm".into(), "boot: VMM start to first KVM_RUN".into()),
        ("boot".into(), "boot -> agent ready".into()),
    ];
    for b in BACKENDS {
        rows.push((
            format!("restore-{b}-vmm"),
            format!("restore ({b}): VMM to first KVM_RUN"),
        ));
        rows.push((
            format!("restore-{b}-ping"),
            format!("restore ({b}) -> agent answers"),
        ));
        rows.push((
            format!("restore-{b}"),
            format!("restore ({b}) -> first exec"),
        ));
    }
    rows
}

fn table(s: &Samples) -> String {
    const W: usize = 44;
    let mut out = format!(
        "{:<W$} {:>4} {:>10} {:>10} {:>10}\n",
        "phase (timed in L1)", "runs", "median ms", "min ms", "max ms"
    );
    for (key, label) in rows() {
        match s.ms.get(&key) {
            Some(v) if !v.is_empty() => {
                let (median, min, max) = stats(v);
                // Sub-10 ms values come from the VMM's µs report.
                let p = if max < 100.0 { 1 } else { 0 };
                out.push_str(&format!(
                    "{label:<W$} {:>4} {median:>10.p$} {min:>10.p$} {max:>10.p$}\n",
                    v.len()
                ));
            }
            _ => out.push_str(&format!("{label:<W$} {:>4} {:>10}\n", 0, "failed")),
        }
    }
    out
}

fn smoke(opts: &Options) {
    let script = l1_script(opts.runs);
    for b in BACKENDS {
        assert!(script.contains(b), "the script leaves out {b}");
    }
    let sample = "bench boot 1 10.00 12.50\n\
                  bench restore-file 1 50.25 50.50\n\
                  bench-us restore-file-vmm 1 4321\n\
                  bench-fail restore-uffd 1 no uffd\nbench-done\n";
    let parsed = parse_output(sample).expect("parse the sample");
    assert_eq!(parsed.ms["boot"], vec![2500.0]);
    assert_eq!(parsed.ms["restore-file"], vec![250.0]);
    assert_eq!(parsed.ms["restore-file-vmm"], vec![4.321]);
    assert_eq!(parsed.failures.len(), 1);
    assert!(parse_output("bench boot 1 1700000000%N 1700000001%N").is_err());
    assert!(parse_output("bench boot 1 3.00 2.00").is_err());
    assert!(table(&parsed).contains("restore (uffd) -> first exec"));
    println!(
        "linux bench smoke: arguments, L1 script and parser checked; no QEMU started \
         (cargo bench -p torpor-nested --bench linux runs it)"
    );
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opts = match parse_args(&args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("linux bench: {e}");
            std::process::exit(2);
        }
    };
    if !opts.full {
        smoke(&opts);
        return;
    }
    let (host, _scratch) = linux::linux_host("bench", &[]);
    let timeout = Duration::from_secs(600 + 300 * opts.runs as u64);
    let out = linux::run_logged(&host, "linux bench", &l1_script(opts.runs), timeout);
    let samples = match parse_output(&out.stdout) {
        Ok(s) => s,
        Err(e) => panic!("{e}\nL1 output:\n{}", out.stdout),
    };
    println!(
        "torpor Linux guest benchmark in the nested host (QEMU/TCG -cpu max, kvm_amd in L1)\n\
         guest: our kernel + Debian rootfs on virtio-blk, {GUEST_MIB} MiB, 1 vCPU; \
         {} runs per row; L1 boot {:.1}s (not counted)\n\
         caveat: TCG emulates L1 and the guest: guest-side time is inflated many times \
         over hardware virtualization; compare rows, not hosts.\n",
        opts.runs,
        out.boot.as_secs_f64()
    );
    print!("{}", table(&samples));
    for f in &samples.failures {
        println!("{f}");
    }
    assert!(
        samples.done && samples.ms.contains_key("boot"),
        "the L1 script did not finish (exit {}):\n{}",
        out.exit_code,
        out.stdout
    );
}
