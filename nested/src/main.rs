//! `torpor-nested`: run shell commands inside the nested hardware-virtualization
//! host (QEMU/TCG, AMD SVM+NPT, kvm_amd). Prepare it first with
//! `scripts/nested-host prepare`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use torpor_nested::{NestedHost, RunOutput};

#[derive(Debug, Parser)]
#[command(name = "torpor-nested", about = "run commands in the nested KVM host")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Boot L1 and report /dev/kvm and the kvm_amd parameters (nested, npt).
    Check {
        /// Time limit in seconds.
        #[arg(long, default_value_t = 300)]
        timeout: u64,
    },
    /// Boot L1, carry files in, run a shell script; exits with its status.
    Run {
        /// HOST:GUEST — carry a host file to an absolute path in L1.
        #[arg(long = "file", value_name = "HOST:GUEST")]
        files: Vec<String>,
        /// Time limit in seconds for boot and script together.
        #[arg(long, default_value_t = 600)]
        timeout: u64,
        /// Do not copy the L1 console to stderr while it runs.
        #[arg(long)]
        quiet: bool,
        /// L1 memory in MiB.
        #[arg(long, default_value_t = 3072)]
        mem_mib: u32,
        /// The script (busybox sh); several words are joined with spaces.
        #[arg(required = true, last = true)]
        script: Vec<String>,
    },
}

const CHECK: &str = r#"
uname -r
grep -m1 'model name' /proc/cpuinfo
printf 'svm flag: '; grep -c -w svm /proc/cpuinfo
printf 'npt flag: '; grep -c -w npt /proc/cpuinfo
ls -l /dev/kvm
for p in nested npt avic; do
  printf 'kvm_amd %s=' $p; cat /sys/module/kvm_amd/parameters/$p 2>/dev/null || echo '(none)'
done
dmesg | grep -i -E 'kvm|svm' | tail -n 5
test -c /dev/kvm
"#;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let (builder, script, timeout) = match cli.command {
        Cmd::Check { timeout } => (NestedHost::builder(), CHECK.to_string(), timeout),
        Cmd::Run {
            files,
            timeout,
            quiet,
            mem_mib,
            script,
        } => {
            let mut b = NestedHost::builder().echo(!quiet).memory_mib(mem_mib);
            for f in files {
                let Some((host, guest)) = f.split_once(':') else {
                    eprintln!("torpor-nested: --file wants HOST:GUEST, got {f:?}");
                    return ExitCode::from(2);
                };
                b = b.file(PathBuf::from(host), guest);
            }
            (b, script.join(" "), timeout)
        }
    };
    match builder.run(&script, Duration::from_secs(timeout)) {
        Ok(out) => report(&out),
        Err(e) => {
            eprintln!("torpor-nested: {e}");
            ExitCode::from(1)
        }
    }
}

fn report(out: &RunOutput) -> ExitCode {
    print!("{}", out.stdout);
    let init = out
        .kernel_to_init
        .map(|d| format!("{:.1}s", d.as_secs_f64()))
        .unwrap_or_else(|| "?".into());
    eprintln!(
        "torpor-nested: exit {} | L1 kernel→init {init}, boot→script {:.1}s, script {:.1}s, total {:.1}s",
        out.exit_code,
        out.boot.as_secs_f64(),
        out.script.as_secs_f64(),
        out.total.as_secs_f64()
    );
    ExitCode::from(u8::try_from(out.exit_code).unwrap_or(1))
}
