//! Admission in the store: what counts as committed, and a check that is
//! atomic with the insert it admits.

use std::sync::{Arc, Barrier};

use super::super::*;
use super::{pod, sandbox_in, setup};
use crate::state::SandboxState::*;

#[test]
fn committed_memory_counts_sandboxes_that_hold_a_vmm() {
    let (_dir, store, t) = setup();
    assert_eq!(store.committed_mib().unwrap(), 0);
    // Every state a pod's store holds (`lost` is a cluster replica's).
    for &state in SandboxState::ALL {
        if state != SandboxState::Lost {
            sandbox_in(&store, &t, state);
        }
    }
    // 64 MiB each: creating, running, paused, hibernating, resuming.
    assert_eq!(store.committed_mib().unwrap(), 5 * 64);
}

#[test]
fn a_full_pod_is_refused_with_what_is_committed() {
    let (_dir, store, t) = setup();
    let mut p = pod(1.0);
    p.memory_bytes = 100 << 20;
    store.insert_pod(&p).unwrap();
    store.read(|tx| tx.admit(&p.id, 100)).unwrap();
    sandbox_in(&store, &t, Running);
    match store.read(|tx| tx.admit(&p.id, 64)) {
        Err(StoreError::Full {
            committed_mib: 64,
            asked_mib: 64,
            memory_mib: 100,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    store.read(|tx| tx.admit(&p.id, 36)).unwrap();
    assert!(matches!(
        store.read(|tx| tx.admit(&PodId::generate(), 1)),
        Err(StoreError::NotFound { kind: "pod", .. })
    ));
}

#[test]
fn admission_and_insert_in_one_transaction_never_overshoot() {
    const THREADS: usize = 32;
    const ROOM: u64 = 10;
    let (_dir, store, t) = setup();
    let mut p = pod(1.0);
    p.memory_bytes = (ROOM * 64) << 20;
    store.insert_pod(&p).unwrap();
    let store = Arc::new(store);
    let start = Arc::new(Barrier::new(THREADS));
    let admitted: u64 = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..THREADS)
            .map(|_| {
                let (store, start, t, pod) = (&store, start.clone(), &t, &p.id);
                scope.spawn(move || {
                    let mut s = Sandbox::new(t.id.clone(), 64, 1, 1000);
                    s.pod = Some(pod.clone());
                    start.wait();
                    store.write(|tx| {
                        tx.admit(pod, s.mem_mib)?;
                        tx.insert_sandbox(&s)
                    })
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| match h.join().unwrap() {
                Ok(()) => 1,
                Err(StoreError::Full { .. }) => 0,
                Err(e) => panic!("{e}"),
            })
            .sum()
    });
    assert_eq!(admitted, ROOM);
    assert_eq!(store.committed_mib().unwrap(), ROOM * 64);
}
