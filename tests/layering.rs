//! Dependencies point one way: the service crates reach VMMs only through
//! the contract crate, never by linking the VMM (and its KVM, vm-memory and
//! userfaultfd crates). Read from the manifests, so a new dependency that
//! breaks this fails here rather than in review.

const SERVICE_CRATES: [&str; 2] = ["scheduler", "api"];
const FORBIDDEN: [&str; 5] = [
    "torpor-vmm.",
    "torpor-vmm =",
    "kvm-ioctls",
    "vm-memory",
    "userfaultfd",
];

fn dependencies(manifest: &str) -> String {
    // Only [dependencies]: tests may drive real VMMs.
    manifest
        .split("\n[")
        .find(|section| section.starts_with("dependencies]"))
        .unwrap_or_default()
        .to_string()
}

#[test]
fn the_service_links_the_contract_not_the_vmm() {
    let root = env!("CARGO_MANIFEST_DIR");
    for krate in SERVICE_CRATES {
        let text = std::fs::read_to_string(format!("{root}/{krate}/Cargo.toml")).unwrap();
        let deps = dependencies(&text);
        assert!(!deps.is_empty(), "{krate} has no [dependencies]");
        for bad in FORBIDDEN {
            assert!(
                !deps.lines().any(|l| l.trim_start().starts_with(bad)),
                "{krate} depends on {bad}: the service reaches VMMs through torpor-vmm-api"
            );
        }
    }
    let sched = std::fs::read_to_string(format!("{root}/scheduler/Cargo.toml")).unwrap();
    assert!(dependencies(&sched).contains("torpor-vmm-api"));
}
