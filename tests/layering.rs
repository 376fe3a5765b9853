//! Dependencies point one way: the service crates reach VMMs only through
//! the contract crate, never by linking the VMM (and its KVM, vm-memory and
//! userfaultfd crates), and each workspace crate depends on the crates of
//! the layers below it only ([`LAYERS`]). Read from the manifests, so a new
//! dependency that breaks this fails here rather than in review.

const SERVICE_CRATES: [&str; 5] = ["scheduler", "sandbox-api", "client", "api", "cluster"];

/// Each workspace crate (its directory) and the workspace crates it may
/// depend on: the layers, bottom first. Cargo refuses cycles; this refuses
/// an edge the design does not have (docs/design.md, "Workspace").
const LAYERS: [(&str, &[&str]); 12] = [
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
    // The contract: the operations, over the pod's types.
    ("sandbox-api", &["torpor-scheduler"]),
    (
        "api",
        &[
            "torpor-sync",
            "torpor-vmm-api",
            "torpor-agent",
            "torpor-scheduler",
            "torpor-sandbox-api",
            "torpor-client",
        ],
    ),
    (
        "cluster",
        &[
            "torpor-sync",
            "torpor-scheduler",
            "torpor-sandbox-api",
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
            "torpor-sandbox-api",
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

/// The crates whose top-level modules import each other without cycles
/// (a module's `crate::other` paths outside its tests). The others still
/// have some; a crate joins this list when its cycles are gone.
const ACYCLIC: [&str; 3] = ["vmm-api", "vmm", "cluster"];

/// Each top-level module of `src` (a file or a folder) and the modules it
/// names as `crate::module`, from its code before any `#[cfg(test)]`,
/// leaving out comments and test files.
fn module_imports(src: &std::path::Path) -> std::collections::BTreeMap<String, Vec<String>> {
    use std::collections::BTreeMap;
    fn files(path: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        if path.is_dir() {
            for entry in std::fs::read_dir(path).unwrap() {
                let p = entry.unwrap().path();
                let name = p.file_name().unwrap().to_string_lossy().to_string();
                if !name.contains("test") {
                    files(&p, out);
                }
            }
        } else if path.is_file() && path.extension().is_some_and(|e| e == "rs") {
            out.push(path.to_path_buf());
        }
    }
    let modules: Vec<String> = std::fs::read_dir(src)
        .unwrap()
        .map(|e| e.unwrap().path())
        .map(|p| p.file_stem().unwrap().to_string_lossy().to_string())
        .filter(|m| m != "lib" && m != "main")
        .collect();
    let mut imports = BTreeMap::new();
    for module in &modules {
        let mut paths = Vec::new();
        files(&src.join(module), &mut paths);
        files(&src.join(format!("{module}.rs")), &mut paths);
        let mut names = Vec::new();
        for path in paths {
            let text = std::fs::read_to_string(&path).unwrap();
            let code = text.split("#[cfg(test)]").next().unwrap_or_default();
            for line in code.lines().filter(|l| !l.trim_start().starts_with("//")) {
                for (i, _) in line.match_indices("crate::") {
                    let rest = &line[i + "crate::".len()..];
                    // `crate::{a, b::c}` names several.
                    let named: Vec<&str> = match rest.strip_prefix('{') {
                        Some(group) => group
                            .split('}')
                            .next()
                            .unwrap_or_default()
                            .split(',')
                            .collect(),
                        None => vec![rest],
                    };
                    for n in named {
                        let n: String = n
                            .trim()
                            .chars()
                            .take_while(|c| c.is_alphanumeric() || *c == '_')
                            .collect();
                        if &n != module && modules.contains(&n) && !names.contains(&n) {
                            names.push(n);
                        }
                    }
                }
            }
        }
        imports.insert(module.clone(), names);
    }
    imports
}

/// A cycle through `imports`, if there is one.
fn a_cycle(imports: &std::collections::BTreeMap<String, Vec<String>>) -> Option<Vec<String>> {
    fn visit(
        m: &str,
        imports: &std::collections::BTreeMap<String, Vec<String>>,
        path: &mut Vec<String>,
        done: &mut std::collections::BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == m) {
            let mut cycle = path[at..].to_vec();
            cycle.push(m.to_string());
            return Some(cycle);
        }
        if done.contains(m) {
            return None;
        }
        path.push(m.to_string());
        for next in &imports[m] {
            if let Some(c) = visit(next, imports, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(m.to_string());
        None
    }
    let mut done = std::collections::BTreeSet::new();
    imports
        .keys()
        .find_map(|m| visit(m, imports, &mut Vec::new(), &mut done))
}

#[test]
fn the_acyclic_crates_modules_import_each_other_without_cycles() {
    let root = env!("CARGO_MANIFEST_DIR");
    for krate in ACYCLIC {
        let imports = module_imports(&std::path::Path::new(root).join(krate).join("src"));
        assert!(imports.len() > 3, "{krate}: too few modules read");
        if let Some(cycle) = a_cycle(&imports) {
            panic!(
                "{krate}'s modules import in a cycle: {}",
                cycle.join(" -> ")
            );
        }
    }
}

/// The check sees a cycle when there is one.
#[test]
fn a_cycle_is_found() {
    let imports = [
        ("a", vec!["b"]),
        ("b", vec!["c"]),
        ("c", vec!["a"]),
        ("d", vec![]),
    ]
    .into_iter()
    .map(|(m, n)| (m.to_string(), n.into_iter().map(String::from).collect()))
    .collect();
    assert_eq!(a_cycle(&imports).unwrap(), ["a", "b", "c", "a"]);
}
