//! The cluster's chaos run, bounded (`benches/cluster_chaos.rs` runs it
//! with ≥ 100 faults): two clients create, hibernate, wake and delete with
//! idempotency keys through random replicas while 10 faults hit random
//! parts (kill -9 of a replica, a pod or nats-server; a restart of
//! PostgreSQL), each restarted after, and one a pod lost for good (killed
//! with its VMMs, never restarted). Nothing acknowledged is lost (every
//! sandbox acknowledged hibernated wakes, those of the lost pod on the
//! other), no sandbox exists twice, no VMM runs unaccounted for, no
//! JetStream message is left unacked. Needs postgres and nats-server (tests/needs leaves it
//! out without them). `TORPOR_CHAOS_SEED` repeats a run (1796134249445362350
//! left 1 work item and 2 events unacked after three nats-server restarts
//! before acks were confirmed and the ack wait shortened).

mod common;
use common::chaos::{self, Chaos};

#[test]
fn cluster_chaos_loses_no_acknowledged_operation() {
    let c = chaos::cluster("chaos");
    let seed = std::env::var("TORPOR_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(chaos::seed);
    println!("chaos seed {seed} (TORPOR_CHAOS_SEED repeats it)");
    let report = chaos::run(
        &c,
        &Chaos {
            faults: 10,
            clients: 2,
            seed,
            pause_ms: (300, 1500),
            lose_pod: true,
        },
    );
    println!("{}", report.table());
    assert_eq!(report.faults.values().sum::<usize>(), 10);
    assert_eq!(report.faults.get(chaos::POD_LOST), Some(&1), "{report:?}");
    assert!(report.acknowledged > 0, "{report:?}");
    assert!(report.lost.is_empty(), "{}", report.table());
    assert!(report.doubled.is_empty(), "{}", report.table());
    assert!(report.stray_vmms.is_empty(), "{}", report.table());
    assert!(report.unacked.is_empty(), "{}", report.table());
}
