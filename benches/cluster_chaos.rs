//! The cluster's chaos bench: clients create, hibernate, wake and delete
//! with idempotency keys through random replicas of a loopback cluster
//! (`scripts/cluster`: PostgreSQL, nats-server, two pods, two replicas)
//! while a driver injects `--faults N` faults (default 100): kill -9 of a
//! random replica, pod or nats-server, or a restart of PostgreSQL, each
//! followed by a restart of what it hit, and once a pod lost for good
//! (killed with its VMMs, never restarted; `--no-pod-loss` leaves it out).
//! At the end: every operation acknowledged to a client is reflected in
//! the final state, every sandbox acknowledged hibernated wakes (those of
//! the lost pod on the other one, from the object store), no sandbox
//! exists twice, no VMM runs unaccounted for, no JetStream message is left
//! unacked. Prints operations attempted, acknowledged, retried, faults per
//! kind, lost (must be 0); exits 1 when a check fails.
//!
//! `cargo bench --bench cluster_chaos [-- --faults N --clients N --seed S
//! --pause-ms LO,HI --no-pod-loss]`. `tests/cluster_chaos.rs` is the bounded version (10
//! faults) `scripts/test` runs; under `cargo test` (no `--bench`) this
//! prints how to run it. Needs PostgreSQL and nats-server (`scripts/setup test`
//! installs them). Every process it starts is stopped at its end, also on
//! a panic.

#[path = "../tests/common/mod.rs"]
mod tests_common;

use tests_common::chaos::{self, Chaos};

fn usage(msg: &str) -> ! {
    eprintln!("cluster_chaos: {msg}");
    eprintln!(
        "usage: cargo bench --bench cluster_chaos [-- --faults N --clients N --seed S \
         --pause-ms LO,HI --no-pod-loss]"
    );
    std::process::exit(2);
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if !args.iter().any(|a| a == "--bench") {
        println!(
            "cluster_chaos: run with `cargo bench --bench cluster_chaos` (≥ 100 faults; \
             tests/cluster_chaos.rs is the bounded run)"
        );
        return;
    }
    let mut o = Chaos {
        faults: 100,
        clients: 2,
        seed: chaos::seed(),
        pause_ms: (300, 1500),
        lose_pod: true,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = |name: &str| -> String {
            it.next()
                .cloned()
                .unwrap_or_else(|| usage(&format!("{name} needs a value")))
        };
        let number = |name: &str, v: String| -> u64 {
            v.parse()
                .unwrap_or_else(|_| usage(&format!("{name}: {v} is not a number")))
        };
        match a.as_str() {
            "--faults" => o.faults = number("--faults", value("--faults")) as usize,
            "--clients" => o.clients = number("--clients", value("--clients")).max(1) as usize,
            "--seed" => o.seed = number("--seed", value("--seed")),
            "--no-pod-loss" => o.lose_pod = false,
            "--pause-ms" => {
                let v = value("--pause-ms");
                let (lo, hi) = v
                    .split_once(',')
                    .unwrap_or_else(|| usage("--pause-ms LO,HI"));
                o.pause_ms = (
                    number("--pause-ms", lo.into()),
                    number("--pause-ms", hi.into()),
                );
            }
            _ => {} // --bench and whatever cargo passes
        }
    }
    println!(
        "cluster_chaos: {} faults, {} clients, seed {}",
        o.faults, o.clients, o.seed
    );
    let report = {
        let c = chaos::cluster("chaos-bench");
        chaos::run(&c, &o)
    };
    println!("{}", report.table());
    let clean = report.lost.is_empty()
        && report.doubled.is_empty()
        && report.stray_vmms.is_empty()
        && report.unacked.is_empty();
    if !clean {
        std::process::exit(1);
    }
}
