//! Dependencies point one way: the service crates reach VMMs only through
//! the contract crate, never by linking the VMM (and its KVM, vm-memory and
//! userfaultfd crates), and each workspace crate depends on the crates of
//! the layers below it only ([`LAYERS`]). Read from the manifests, so a new
//! dependency that breaks this fails here rather than in review.

const SERVICE_CRATES: [&str; 4] = ["scheduler", "client", "api", "cluster"];

/// Each workspace crate (its directory) and the workspace crates it may
/// depend on: the layers, bottom first. Cargo refuses cycles; this refuses
/// an edge the design does not have (docs/design.md, "Workspace").
const LAYERS: [(&str, &[&str]); 11] = [
    ("sync", &[]),
    ("vmm-api", &[]),
    ("guest-image/probe", &[]),
    ("guest-image/agent", &["torpor-sync"]),
    ("nested", &["torpor-sync"]),
    ("client", &[]),
    ("vmm", &["torpor-sync", "torpor-vmm-api"]),
    (
        "scheduler",
        &["torpor-sync", "torpor-vmm-api", "torpor-agent"],
    ),
    (
        "api",
        &[
            "torpor-sync",
            "torpor-vmm-api",
            "torpor-agent",
            "torpor-scheduler",
            "torpor-client",
        ],
    ),
    (
        "cluster",
        &[
            "torpor-sync",
            "torpor-scheduler",
            "torpor-client",
            "torpor-api",
        ],
    ),
    (
        ".",
        &[
            "torpor-sync",
            "torpor-vmm-api",
            "torpor-probe",
            "torpor-agent",
            "torpor-nested",
            "torpor-client",
            "torpor-vmm",
            "torpor-scheduler",
            "torpor-api",
            "torpor-cluster",
        ],
    ),
];
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

#[test]
fn each_crate_depends_on_the_layers_below_it_only() {
    let root = env!("CARGO_MANIFEST_DIR");
    let workspace = std::fs::read_to_string(format!("{root}/Cargo.toml")).unwrap();
    let members = workspace
        .lines()
        .find(|l| l.starts_with("members"))
        .expect("the workspace's members");
    for (krate, allowed) in LAYERS {
        assert!(
            krate == "." || members.contains(&format!("\"{krate}\"")),
            "{krate} is not a workspace member"
        );
        let text = std::fs::read_to_string(format!("{root}/{krate}/Cargo.toml")).unwrap();
        for line in dependencies(&text).lines() {
            let name = line.split(['.', ' ', '=']).next().unwrap_or_default();
            if name.starts_with("torpor-") {
                assert!(
                    allowed.contains(&name),
                    "{krate} depends on {name}, which is not in a layer below it"
                );
            }
        }
    }
    // Every member has its layer.
    let listed = members.matches('"').count() / 2;
    assert_eq!(
        listed,
        LAYERS.len() - 1,
        "a member without a layer: {members}"
    );
}
