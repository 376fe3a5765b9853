//! The `resumed` hook, run by the host after every snapshot restore: every
//! clone of one snapshot gets its own wall clock, entropy, hostname and
//! identity. Each sub-step reports on its own; one failing does not stop the
//! others.

use crate::proto::{ErrorReply, ResumedReply, ResumedRequest, Step};
use crate::system::{IdentityPage, SystemOps};

/// Largest seed accepted.
pub const MAX_SEED: usize = 512;
/// Longest sandbox id accepted.
pub const MAX_SANDBOX_ID: usize = 256;

fn io_step(context: &str, res: std::io::Result<()>, ok: String) -> Step {
    match res {
        Ok(()) => Step::ok(ok),
        Err(e) => Step::failed(ErrorReply::io(context, &e)),
    }
}

/// Checks a hostname: 1..=64 bytes of letters, digits, `-` and `.`, not
/// starting with `-` or `.`.
pub fn valid_hostname(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && !name.starts_with(['-', '.'])
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
}

/// Runs the hook with `ops`.
pub fn run(req: &ResumedRequest, ops: &dyn SystemOps) -> ResumedReply {
    let need_page = req.wall_clock_ns.is_none() || req.seed.is_none();
    let (identity_page, page): (Step, Option<IdentityPage>) = if need_page {
        match ops.read_identity_page() {
            Ok(p) => (Step::ok(format!("generation {}", p.generation)), Some(p)),
            Err(e) => (
                Step::failed(ErrorReply::new(e.errno(), e.to_string())),
                None,
            ),
        }
    } else {
        (Step::skipped("clock and seed given by the host"), None)
    };
    let not_given = |what: &str| {
        Step::skipped(if need_page {
            format!("no {what}: not given, and no usable identity page")
        } else {
            format!("no {what} given")
        })
    };

    let clock_ns = req
        .wall_clock_ns
        .or(page.map(|p| p.wall_clock_ns).filter(|&ns| ns > 0));
    let clock = match clock_ns {
        None => not_given("wall clock"),
        Some(ns) => io_step(
            "clock_settime(CLOCK_REALTIME)",
            ops.set_wall_clock(ns),
            format!("set to {ns} ns since the epoch"),
        ),
    };

    let seed: Option<Vec<u8>> = req.seed.clone().or(page.map(|p| p.seed.to_vec()));
    let (rng_write, rng_credit) = match &seed {
        None => (not_given("seed"), not_given("seed")),
        Some(s) if s.is_empty() || s.len() > MAX_SEED => {
            let e = ErrorReply::new(
                libc::EINVAL,
                format!("seed of {} bytes (want 1..={MAX_SEED})", s.len()),
            );
            (Step::failed(e.clone()), Step::failed(e))
        }
        Some(s) => {
            let write = io_step(
                "write /dev/urandom",
                ops.write_urandom(s),
                format!("{} bytes mixed in", s.len()),
            );
            let credit = if ops.is_root() {
                io_step(
                    "ioctl(/dev/urandom, RNDADDENTROPY)",
                    ops.credit_entropy(s),
                    format!("{} bits credited", s.len() * 8),
                )
            } else {
                Step::skipped("not root: seed mixed in but not credited")
            };
            (write, credit)
        }
    };

    let hostname = match &req.hostname {
        None => Step::skipped("no hostname given"),
        Some(h) if !valid_hostname(h) => Step::failed(ErrorReply::new(
            libc::EINVAL,
            format!("bad hostname {h:?}: want 1..=64 of [A-Za-z0-9.-]"),
        )),
        Some(h) => io_step("sethostname", ops.set_hostname(h), format!("set to {h}")),
    };

    let identity = match &req.sandbox_id {
        None => Step::skipped("no sandbox id given"),
        Some(id)
            if id.is_empty() || id.len() > MAX_SANDBOX_ID || id.chars().any(|c| c.is_control()) =>
        {
            Step::failed(ErrorReply::new(
                libc::EINVAL,
                format!("bad sandbox id {id:?}: want 1..={MAX_SANDBOX_ID} printable characters"),
            ))
        }
        Some(id) => match ops.write_identity(id) {
            Ok(path) => Step::ok(format!("wrote {}", path.display())),
            Err(e) => Step::failed(ErrorReply::io("write identity", &e)),
        },
    };

    // Last: announcing the address is what lets traffic reach this clone;
    // TCP connections from before the snapshot are gone either way (their
    // peers timed out or reset them), which the agent itself never has:
    // it talks over vsock, and vsock resets its connections on restore.
    let network = Some(match ops.announce_network() {
        Ok(done) if done.is_empty() => Step::skipped("no interface with an IPv4 address is up"),
        Ok(done) => Step::ok(format!("gratuitous ARP for {}", done.join(", "))),
        Err(e) => Step::failed(ErrorReply::io("gratuitous ARP", &e)),
    });

    ResumedReply {
        generation: page.map(|p| p.generation),
        identity_page,
        clock,
        rng_write,
        rng_credit,
        hostname,
        identity,
        network,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::StepStatus;
    use crate::system::{FakeCall, FakeOps};

    #[test]
    fn host_values_skip_the_page() {
        let ops = FakeOps::new().root(true);
        let r = run(
            &ResumedRequest {
                wall_clock_ns: Some(5),
                seed: Some(vec![1, 2]),
                hostname: Some("sbx-1".into()),
                sandbox_id: Some("sbx-1".into()),
            },
            &ops,
        );
        assert_eq!(r.identity_page.status, StepStatus::Skipped);
        for s in [
            &r.clock,
            &r.rng_write,
            &r.rng_credit,
            &r.hostname,
            &r.identity,
        ] {
            assert_eq!(s.status, StepStatus::Ok, "{s:?}");
        }
        assert_eq!(
            ops.calls(),
            vec![
                FakeCall::SetWallClock(5),
                FakeCall::WriteUrandom(vec![1, 2]),
                FakeCall::CreditEntropy(vec![1, 2]),
                FakeCall::SetHostname("sbx-1".into()),
                FakeCall::WriteIdentity("sbx-1".into()),
                FakeCall::AnnounceNetwork,
            ]
        );
        let network = r.network.unwrap();
        assert_eq!(network.status, StepStatus::Ok);
        assert!(network.detail.unwrap().contains("eth0 172.16.0.2"));
    }

    #[test]
    fn page_fills_in_and_failures_are_per_step() {
        let ops = FakeOps::new()
            .page(IdentityPage {
                generation: 4,
                seed: [8; 32],
                wall_clock_ns: 99,
            })
            .failing("SetWallClock", libc::EPERM);
        let r = run(
            &ResumedRequest {
                hostname: Some("-bad".into()),
                ..Default::default()
            },
            &ops,
        );
        assert_eq!(r.generation, Some(4));
        assert_eq!(r.clock.error.as_ref().unwrap().code, "EPERM");
        assert_eq!(r.rng_write.status, StepStatus::Ok);
        assert_eq!(r.rng_credit.status, StepStatus::Skipped, "not root");
        assert_eq!(r.hostname.error.as_ref().unwrap().code, "EINVAL");
        assert_eq!(r.identity.status, StepStatus::Skipped);
        assert_eq!(
            ops.calls(),
            vec![
                FakeCall::ReadIdentityPage,
                FakeCall::SetWallClock(99),
                FakeCall::WriteUrandom(vec![8; 32]),
                FakeCall::AnnounceNetwork,
            ]
        );
    }

    #[test]
    fn no_page_no_values() {
        let ops = FakeOps::default();
        let r = run(&ResumedRequest::default(), &ops);
        assert_eq!(r.identity_page.error.as_ref().unwrap().code, "ENOENT");
        assert_eq!(r.clock.status, StepStatus::Skipped);
        assert_eq!(r.rng_write.status, StepStatus::Skipped);
        assert_eq!(r.generation, None);
        let failing = FakeOps::new().failing("AnnounceNetwork", libc::EPERM);
        let r = run(&ResumedRequest::default(), &failing);
        assert_eq!(r.network.unwrap().error.unwrap().code, "EPERM");
    }

    #[test]
    fn hostnames() {
        assert!(valid_hostname("a"));
        assert!(valid_hostname("sbx-01.torpor"));
        assert!(!valid_hostname(""));
        assert!(!valid_hostname(".x"));
        assert!(!valid_hostname("a b"));
        assert!(!valid_hostname(&"a".repeat(65)));
    }
}
