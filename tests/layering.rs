//! Dependencies point one way: the service crates reach VMMs only through
//! the contract crate, never by linking the VMM (and its KVM, vm-memory and
//! userfaultfd crates), and each workspace crate depends on the crates of
//! the layers below it only ([`LAYERS`]). Read from the manifests, so a new
//! dependency that breaks this fails here rather than in review.

const SERVICE_CRATES: [&str; 7] = [
    "scheduler",
    "sandbox-api",
    "client",
    "gate",
    "e2b",
    "api",
    "cluster",
];

/// Each workspace crate (its directory) and the workspace crates it may
/// depend on: the layers, bottom first. Cargo refuses cycles; this refuses
/// an edge the design does not have (docs/design.md, "Workspace").
const LAYERS: [(&str, &[&str]); 17] = [
    ("sync", &[]),
    // Template builds: the spec, E2B's body, Dockerfiles, cache keys,
    // COPY archives (pure logic; the executor builds on it).
    ("build", &[]),
    // Object storage: chunks, manifests, the chunk cache (nothing of the
    // service's; the scheduler builds on it).
    ("storage", &["torpor-sync"]),
    // OCI images into template root filesystems (nothing of the
    // service's; the template builder will build on it).
    ("oci", &[]),
    ("vmm-api", &[]),
    ("guest-image/probe", &[]),
    ("guest-image/agent", &["torpor-sync"]),
    ("nested", &["torpor-sync"]),
    ("client", &[]),
    ("vmm", &["torpor-sync", "torpor-vmm-api"]),
    (
        "scheduler",
        // torpor-storage: hibernations and templates uploaded to, and
        // fetched from, the object store (`service/objects.rs`).
        &[
            "torpor-sync",
            "torpor-vmm-api",
            "torpor-agent",
            "torpor-storage",
        ],
    ),
    // The contract: the operations, over the pod's types.
    ("sandbox-api", &["torpor-scheduler"]),
    // The gate every surface reaches sandboxes through: the backend as the
    // API holds it, tokens, tenants, quotas, limits, errors, builds.
    (
        "gate",
        &[
            "torpor-sync",
            "torpor-vmm-api",
            "torpor-scheduler",
            "torpor-sandbox-api",
            "torpor-client",
            "torpor-build",
            "torpor-oci",
        ],
    ),
    // The surfaces, over the gate: E2B's API, envd and the guest-port
    // router; then `/v1`, which assembles the server (and the nested pod).
    (
        "e2b",
        &[
            "torpor-sync",
            "torpor-agent",
            "torpor-scheduler",
            "torpor-build",
            "torpor-gate",
        ],
    ),
    (
        "api",
        &[
            "torpor-sync",
            "torpor-agent",
            "torpor-scheduler",
            "torpor-sandbox-api",
            "torpor-client",
            "torpor-build",
            "torpor-gate",
            "torpor-e2b",
        ],
    ),
    (
        "cluster",
        &[
            "torpor-sync",
            "torpor-scheduler",
            "torpor-sandbox-api",
            "torpor-client",
            "torpor-gate",
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
            "torpor-gate",
            "torpor-e2b",
            "torpor-api",
            "torpor-cluster",
            "torpor-build",
            "torpor-storage",
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
/// (a module's paths to another, as `crate::`, `super::` or `self::` paths
/// and in `use` groups, outside its tests). The others still have some; a
/// crate joins this list when its cycles are gone.
const ACYCLIC: [&str; 13] = [
    "guest-image/agent",
    "vmm-api",
    "vmm",
    "nested",
    "scheduler",
    "sandbox-api",
    "gate",
    "e2b",
    "api",
    "cluster",
    "storage",
    "oci",
    "build",
];

/// `text` with its comments, string literals and character literals
/// blanked out (each replaced by a space), so that only code is read.
fn code_only(text: &str) -> String {
    let c: Vec<char> = text.chars().collect();
    let ident = |i: usize| i < c.len() && (c[i].is_alphanumeric() || c[i] == '_');
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < c.len() {
        let next = c.get(i + 1).copied();
        if c[i] == '/' && next == Some('/') {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if c[i] == '/' && next == Some('*') {
            // Block comments nest.
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            out.push(' ');
        } else if c[i] == 'r'
            && (i == 0 || !ident(i - 1) || (c[i - 1] == 'b' && (i == 1 || !ident(i - 2))))
            && matches!(next, Some('"' | '#'))
        {
            // A raw string: `r"..."`, `r#"..."#` (or `r#ident`, code).
            let hashes = c[i + 1..].iter().take_while(|&&h| h == '#').count();
            if c.get(i + 1 + hashes) != Some(&'"') {
                out.push(c[i]);
                i += 1;
                continue;
            }
            let close: Vec<char> = std::iter::once('"')
                .chain(std::iter::repeat_n('#', hashes))
                .collect();
            i += 2 + hashes;
            while i < c.len() && !c[i..].starts_with(&close) {
                i += 1;
            }
            i += close.len();
            out.push(' ');
        } else if c[i] == '"' {
            i += 1;
            while i < c.len() && c[i] != '"' {
                i += if c[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            out.push(' ');
        } else if c[i] == '\'' && (next == Some('\\') || c.get(i + 2) == Some(&'\'')) {
            // A character literal (not a lifetime).
            i += 1;
            while i < c.len() && c[i] != '\'' {
                i += if c[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            out.push(' ');
        } else {
            out.push(c[i]);
            i += 1;
        }
    }
    out
}

/// The tokens of `code`: identifiers (with `$crate`), `::` and single
/// punctuation characters.
fn tokens(code: &str) -> Vec<String> {
    let c: Vec<char> = code.chars().collect();
    let word = |ch: char| ch.is_alphanumeric() || ch == '_';
    let mut out = Vec::new();
    let mut i = 0;
    while i < c.len() {
        if c[i].is_whitespace() {
            i += 1;
        } else if word(c[i]) || (c[i] == '$' && c.get(i + 1).is_some_and(|&n| word(n))) {
            let start = i;
            i += 1;
            while i < c.len() && word(c[i]) {
                i += 1;
            }
            out.push(c[start..i].iter().collect());
        } else if c[i] == ':' && c.get(i + 1) == Some(&':') {
            out.push("::".into());
            i += 2;
        } else {
            out.push(c[i].to_string());
            i += 1;
        }
    }
    out
}

/// The path or `use` tree whose first segment is `t[at]`, read in the
/// module `here`, in a `use` group after the path `path` if any: each
/// module it names, as its path from the crate root, into `named`.
/// Returns the index past it.
fn use_tree(
    t: &[String],
    mut at: usize,
    mut path: Option<Vec<String>>,
    here: &[String],
    named: &mut Vec<Vec<String>>,
) -> usize {
    while let Some(segment) = t.get(at) {
        match (segment.as_str(), path.as_mut()) {
            ("crate" | "$crate", None) => path = Some(Vec::new()),
            ("self", None) => path = Some(here.to_vec()),
            ("super", None) => path = Some(here[..here.len().saturating_sub(1)].to_vec()),
            ("super", Some(p)) => {
                p.pop();
            }
            ("self", Some(_)) => {}
            ("{", Some(p)) => {
                // A group: each of its trees from the path so far.
                let p = p.clone();
                at += 1;
                while t.get(at).is_some_and(|s| s != "}") {
                    if t[at] == "," {
                        at += 1;
                        continue;
                    }
                    at = use_tree(t, at, Some(p.clone()), here, named).max(at + 1);
                }
                return at + 1;
            }
            ("*", _) => {}
            (name, Some(p)) if name.starts_with(|ch: char| ch.is_alphanumeric() || ch == '_') => {
                p.push(name.to_string());
            }
            // `t[at]` begins no path from a module.
            _ => break,
        }
        at += 1;
        if t.get(at).map(String::as_str) != Some("::") {
            break;
        }
        at += 1;
    }
    if let Some(p) = path {
        named.push(p);
    }
    at
}

/// The modules the code of a file names, as paths from the crate root:
/// its `crate::`, `super::` and `self::` paths, each `use` group's trees
/// resolved, read from `here` (the file's module, and inside an inline
/// `mod name { ... }` from that module).
fn named_modules(code: &str, here: &[String]) -> Vec<Vec<String>> {
    let t = tokens(code);
    let mut named = Vec::new();
    let mut here = here.to_vec();
    // Each open brace, and whether it opened an inline module.
    let mut braces: Vec<bool> = Vec::new();
    let mut at = 0;
    while at < t.len() {
        let s = t[at].as_str();
        let after_path = at > 0 && t[at - 1] == "::";
        if s == "mod" && t.get(at + 2).is_some_and(|b| b == "{") {
            here.push(t[at + 1].clone());
            braces.push(true);
            at += 3;
        } else if s == "{" {
            braces.push(false);
            at += 1;
        } else if s == "}" {
            if braces.pop() == Some(true) {
                here.pop();
            }
            at += 1;
        } else if matches!(s, "crate" | "$crate" | "super" | "self")
            && !after_path
            && t.get(at + 1).is_some_and(|c| c == "::")
        {
            at = use_tree(&t, at, None, &here, &mut named);
        } else if s == "use" && t.get(at + 1).is_some_and(|b| b == "{") {
            // `use {crate::a, super::b};`
            at += 2;
            while t.get(at).is_some_and(|s| s != "}") {
                if t[at] == "," {
                    at += 1;
                } else {
                    at = use_tree(&t, at, None, &here, &mut named).max(at + 1);
                }
            }
            at += 1;
        } else {
            at += 1;
        }
    }
    named
}

/// Each top-level module of `src` (a file or a folder) and the top-level
/// modules it names (`named_modules`), from its code before any
/// `#[cfg(test)]`, leaving out comments and test files.
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
            // The file's module: `a.rs` and `a/mod.rs` are `a`, `a/b.rs` is `a::b`.
            let mut here: Vec<String> = path
                .strip_prefix(src)
                .unwrap()
                .with_extension("")
                .iter()
                .map(|s| s.to_string_lossy().to_string())
                .collect();
            if here.last().is_some_and(|l| l == "mod") {
                here.pop();
            }
            let code = code_only(&std::fs::read_to_string(&path).unwrap());
            let code = code.split("#[cfg(test)]").next().unwrap_or_default();
            for named in named_modules(code, &here) {
                let Some(n) = named.into_iter().next() else {
                    continue;
                };
                if &n != module && modules.contains(&n) && !names.contains(&n) {
                    names.push(n);
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

/// The `torpor` binary (the root package): `cli` (its arguments) below
/// `cmd`, and `cmd`'s command modules one way (the shared ones, `client`,
/// `output` and `server`, below the commands that use them).
#[test]
fn the_binarys_modules_import_each_other_without_cycles() {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    for dir in [src.clone(), src.join("cmd")] {
        let mut imports = module_imports(&dir);
        imports.remove("mod");
        assert!(
            imports.len() >= 3,
            "{}: too few modules read",
            dir.display()
        );
        if let Some(cycle) = a_cycle(&imports) {
            panic!(
                "{}'s modules import in a cycle: {}",
                dir.display(),
                cycle.join(" -> ")
            );
        }
    }
    let top = module_imports(&src);
    assert!(
        !top["cli"].contains(&"cmd".to_string()),
        "cli imports cmd: {top:?}"
    );
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

/// The paths a module names are read as the compiler resolves them:
/// `super::`, `self::` and `crate::`, groups nested and over several
/// lines, inline modules; not in comments or strings.
#[test]
fn relative_paths_and_use_groups_are_resolved() {
    let code = code_only(
        r##"
        use super::{db::{pg, Db}, wire::{self, Event}};
        use crate::{
            a,
            b::{c, d::e},
        };
        use self::inner::Thing;
        pub(crate) fn f() -> super::super::outer::T { $crate::m::g() }
        mod inner {
            use super::sibling::X;
        }
        use super::after_inner;
        // use crate::commented;
        const S: &str = "crate::quoted";
        const R: &str = r#"super::raw"#;
        const C: char = '{';
        "##,
    );
    let here = ["m".to_string(), "n".to_string()];
    let named: Vec<String> = named_modules(&code, &here)
        .into_iter()
        .map(|p| p.join("::"))
        .collect();
    assert_eq!(
        named,
        [
            "m::db::pg",
            "m::db::Db",
            "m::wire",
            "m::wire::Event",
            "a",
            "b::c",
            "b::d::e",
            "m::n::inner::Thing",
            "outer::T",
            "m::g",
            "m::n::sibling::X",
            "m::after_inner",
        ]
    );
}
