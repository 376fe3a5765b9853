//! The sandbox state machine.
//!
//! Every legal state change is one row of [`TRANSITIONS`]; everything else is
//! refused with an [`IllegalTransition`] that names the current state (the API
//! answers 409 with it). [`can`] says what an API operation needs from a
//! given state: nothing, a path of transitions, or a refusal.

use std::fmt;

use serde::Serialize;

str_enum! {
    /// Where a sandbox is in its life.
    pub enum SandboxState {
        /// Being placed and restored from its template for the first time.
        Creating => "creating",
        /// Its VMM runs the guest.
        Running => "running",
        /// Its VMM is alive, vCPUs stopped (explicit pause).
        Paused => "paused",
        /// A diff snapshot is being written; the VMM ends afterwards.
        Hibernating => "hibernating",
        /// Only its snapshot exists; no VMM process.
        Hibernated => "hibernated",
        /// Being restored from its snapshot.
        Resuming => "resuming",
        /// Gone for good (the row stays as a record).
        Deleted => "deleted",
        /// Broken, with a reason; it can be deleted or recovered from its
        /// last snapshot.
        Failed => "failed",
        /// Its pod was lost for good while it held state that is nowhere
        /// else (running, paused, or hibernated without a stored snapshot):
        /// that state went with the pod. Only a cluster's replicas put a
        /// sandbox here (`torpor_cluster`'s `moved.rs`), never a pod; it
        /// can only be deleted.
        Lost => "lost",
    }
}

use SandboxState::*;

/// Every legal transition, `(from, to)`. Anything else is illegal, including
/// staying in the same state.
pub const TRANSITIONS: &[(SandboxState, SandboxState)] = &[
    // creating: first restore from the template.
    (Creating, Running),
    (Creating, Failed),
    (Creating, Deleted),
    // running.
    (Running, Paused),
    (Running, Hibernating),
    // restore from a checkpoint replaces the VMM.
    (Running, Resuming),
    (Running, Failed),
    (Running, Deleted),
    // paused.
    (Paused, Running),
    (Paused, Hibernating),
    (Paused, Resuming),
    (Paused, Failed),
    (Paused, Deleted),
    // hibernating: done, or rolled back while the VMM still lives (the
    // snapshot failed or was interrupted), back to where it came from.
    (Hibernating, Hibernated),
    (Hibernating, Running),
    (Hibernating, Paused),
    (Hibernating, Failed),
    (Hibernating, Deleted),
    // hibernated: wake.
    (Hibernated, Resuming),
    (Hibernated, Failed),
    (Hibernated, Deleted),
    // resuming (a wake, or a restore from a checkpoint): done, or rolled
    // back with the snapshot intact.
    (Resuming, Running),
    (Resuming, Hibernated),
    (Resuming, Failed),
    (Resuming, Deleted),
    // failed: deleted, or recovered from its last snapshot (by policy).
    (Failed, Resuming),
    (Failed, Deleted),
    // lost with its pod (a cluster's replica decides): deleted only.
    (Creating, Lost),
    (Running, Lost),
    (Paused, Lost),
    (Hibernating, Lost),
    (Hibernated, Lost),
    (Resuming, Lost),
    (Failed, Lost),
    (Lost, Deleted),
    // deleted: terminal.
];

impl SandboxState {
    /// True while an operation is under way (creating, hibernating,
    /// resuming): after a crash such a sandbox has an interrupted operation.
    pub fn is_transitional(self) -> bool {
        matches!(self, Creating | Hibernating | Resuming)
    }

    /// True for deleted, which nothing leaves.
    pub fn is_terminal(self) -> bool {
        self == Deleted
    }
}

/// A state change the table does not allow. `from` is the sandbox's current
/// state, which the API reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, thiserror::Error)]
#[error("sandbox is {from}: cannot go to {to}")]
pub struct IllegalTransition {
    pub from: SandboxState,
    pub to: SandboxState,
}

/// Ok if `from → to` is in [`TRANSITIONS`].
pub fn transition(from: SandboxState, to: SandboxState) -> Result<(), IllegalTransition> {
    if TRANSITIONS.contains(&(from, to)) {
        Ok(())
    } else {
        Err(IllegalTransition { from, to })
    }
}

/// What the API asks of a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Operation {
    Pause,
    Resume,
    Hibernate,
    Delete,
    /// Exec, file access and connect: needs a running guest; a hibernated
    /// sandbox is woken first.
    Exec,
}

impl Operation {
    /// Every operation.
    pub const ALL: &'static [Operation] = &[
        Operation::Pause,
        Operation::Resume,
        Operation::Hibernate,
        Operation::Delete,
        Operation::Exec,
    ];

    /// The state this operation leaves the sandbox in.
    pub fn target(self) -> SandboxState {
        match self {
            Operation::Pause => Paused,
            Operation::Resume | Operation::Exec => Running,
            Operation::Hibernate => Hibernated,
            Operation::Delete => Deleted,
        }
    }
}

impl fmt::Display for Operation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Operation::Pause => "pause",
            Operation::Resume => "resume",
            Operation::Hibernate => "hibernate",
            Operation::Delete => "delete",
            Operation::Exec => "exec",
        })
    }
}

/// The states an operation walks through from the current one, in order
/// (each step a legal transition). Empty when the sandbox is already where
/// the operation would leave it (pause of a paused sandbox, exec on a running
/// one): operations are idempotent.
pub type Path = &'static [SandboxState];

/// What `op` needs from `state`: the path of states to walk, or a refusal
/// naming the current state and the first state the operation would need.
///
/// | op        | from                       | path                          |
/// |-----------|----------------------------|-------------------------------|
/// | pause     | running                    | paused                        |
/// | resume    | paused                     | running                       |
/// | resume    | hibernated                 | resuming, running (wake)      |
/// | hibernate | running, paused            | hibernating, hibernated       |
/// | delete    | any but deleted            | deleted                       |
/// | exec      | hibernated                 | resuming, running (wake)      |
///
/// Transitional states (creating, hibernating, resuming) refuse everything
/// but delete: the scheduler serialises operations on one sandbox, so it
/// waits for the one under way rather than asking here.
pub fn can(op: Operation, state: SandboxState) -> Result<Path, IllegalTransition> {
    const NONE: Path = &[];
    let path: Option<Path> = match (op, state) {
        (op, s) if s == op.target() => Some(NONE),
        (Operation::Pause, Running) => Some(&[Paused]),
        (Operation::Resume, Paused) => Some(&[Running]),
        (Operation::Resume | Operation::Exec, Hibernated) => Some(&[Resuming, Running]),
        (Operation::Hibernate, Running | Paused) => Some(&[Hibernating, Hibernated]),
        (Operation::Delete, _) => Some(&[Deleted]),
        _ => None,
    };
    path.ok_or(IllegalTransition {
        from: state,
        to: match (op, state) {
            (Operation::Hibernate, _) => Hibernating,
            (Operation::Exec | Operation::Resume, Hibernated) => Resuming,
            (op, _) => op.target(),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table written out once more, as the expected set of legal pairs.
    fn expected_legal(from: SandboxState, to: SandboxState) -> bool {
        match from {
            Creating => matches!(to, Running | Failed | Deleted | Lost),
            Running => matches!(
                to,
                Paused | Hibernating | Resuming | Failed | Deleted | Lost
            ),
            Paused => matches!(
                to,
                Running | Hibernating | Resuming | Failed | Deleted | Lost
            ),
            Hibernating => matches!(to, Hibernated | Running | Paused | Failed | Deleted | Lost),
            Hibernated => matches!(to, Resuming | Failed | Deleted | Lost),
            Resuming => matches!(to, Running | Hibernated | Failed | Deleted | Lost),
            Failed => matches!(to, Resuming | Deleted | Lost),
            Lost => matches!(to, Deleted),
            Deleted => false,
        }
    }

    #[test]
    fn every_pair_is_legal_exactly_when_the_table_says() {
        let mut legal = 0;
        for &from in SandboxState::ALL {
            for &to in SandboxState::ALL {
                let got = transition(from, to);
                if expected_legal(from, to) {
                    assert_eq!(got, Ok(()), "{from} -> {to} should be legal");
                    legal += 1;
                } else {
                    assert_eq!(
                        got,
                        Err(IllegalTransition { from, to }),
                        "{from} -> {to} should be refused"
                    );
                }
            }
        }
        assert_eq!(legal, TRANSITIONS.len(), "no duplicate rows in the table");
    }

    #[test]
    fn general_rules_hold() {
        for &s in SandboxState::ALL {
            assert!(transition(s, s).is_err(), "{s} -> {s}");
            assert_eq!(
                transition(s, Deleted).is_ok(),
                s != Deleted,
                "{s} -> deleted"
            );
            assert_eq!(
                transition(s, Failed).is_ok(),
                !matches!(s, Deleted | Failed | Lost),
                "{s} -> failed"
            );
            assert_eq!(
                transition(s, Lost).is_ok(),
                !matches!(s, Deleted | Lost),
                "{s} -> lost"
            );
            assert!(transition(Deleted, s).is_err(), "deleted -> {s}");
        }
    }

    #[test]
    fn every_state_is_reachable_from_creating() {
        let mut seen = vec![Creating];
        let mut i = 0;
        while i < seen.len() {
            for &(from, to) in TRANSITIONS {
                if from == seen[i] && !seen.contains(&to) {
                    seen.push(to);
                }
            }
            i += 1;
        }
        assert_eq!(seen.len(), SandboxState::ALL.len(), "{seen:?}");
    }

    #[test]
    fn operation_paths_walk_legal_transitions_and_end_at_the_target() {
        for &op in Operation::ALL {
            for &state in SandboxState::ALL {
                match can(op, state) {
                    Ok(path) => {
                        let mut at = state;
                        for &next in path {
                            transition(at, next)
                                .unwrap_or_else(|e| panic!("{op} from {state}: {e}"));
                            at = next;
                        }
                        assert_eq!(at, op.target(), "{op} from {state}");
                    }
                    Err(e) => {
                        assert_eq!(e.from, state, "{op}: error names the current state");
                        // Refused because the table forbids the first step, because
                        // another operation is under way, or (exec on paused)
                        // because an explicit pause is only undone by resume.
                        assert!(
                            transition(state, e.to).is_err()
                                || state.is_transitional()
                                || (op, state) == (Operation::Exec, Paused),
                            "{op} on {state}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn operation_table() {
        let ok = |op, s| can(op, s).unwrap();
        let refused = |op, s| can(op, s).unwrap_err();
        assert_eq!(ok(Operation::Pause, Running), &[Paused]);
        assert_eq!(ok(Operation::Pause, Paused), &[] as Path);
        assert_eq!(refused(Operation::Pause, Hibernated).from, Hibernated);
        assert_eq!(ok(Operation::Resume, Paused), &[Running]);
        assert_eq!(ok(Operation::Resume, Hibernated), &[Resuming, Running]);
        assert_eq!(ok(Operation::Resume, Running), &[] as Path);
        assert_eq!(
            ok(Operation::Hibernate, Running),
            &[Hibernating, Hibernated]
        );
        assert_eq!(ok(Operation::Hibernate, Paused), &[Hibernating, Hibernated]);
        assert_eq!(ok(Operation::Hibernate, Hibernated), &[] as Path);
        assert_eq!(ok(Operation::Exec, Running), &[] as Path);
        assert_eq!(ok(Operation::Exec, Hibernated), &[Resuming, Running]);
        assert_eq!(
            refused(Operation::Exec, Paused),
            IllegalTransition {
                from: Paused,
                to: Running
            }
        );
        assert_eq!(ok(Operation::Delete, Deleted), &[] as Path);
        for &s in SandboxState::ALL {
            assert!(can(Operation::Delete, s).is_ok());
            if s.is_transitional() {
                for &op in Operation::ALL {
                    assert_eq!(can(op, s).is_ok(), op == Operation::Delete, "{op} on {s}");
                }
            }
        }
        for op in [
            Operation::Pause,
            Operation::Resume,
            Operation::Hibernate,
            Operation::Exec,
        ] {
            assert!(can(op, Failed).is_err(), "{op} on failed");
            assert!(can(op, Deleted).is_err(), "{op} on deleted");
        }
    }

    #[test]
    fn illegal_transition_serialises_for_the_api() {
        let e = transition(Deleted, Running).unwrap_err();
        assert_eq!(
            serde_json::to_value(e).unwrap(),
            serde_json::json!({"from": "deleted", "to": "running"})
        );
        assert_eq!(e.to_string(), "sandbox is deleted: cannot go to running");
    }
}
