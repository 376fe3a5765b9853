//! Layer cache keys: a chain over the source, each step and the start;
//! what changes them and what does not; which layers the cache may serve.

use std::collections::BTreeMap;

use torpor_build::key::{canonical_step, KEY_VERSION};
use torpor_build::{
    layer_keys, source_key, BuildSpec, Layer, LayerKey, ReadyCheck, Secret, Source, Start, Step,
};

const HASH_A: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
const HASH_B: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";

/// `layer_keys(&spec(), "source")[0]`: changes only with KEY_VERSION.
const GOLDEN: &str = "b74348b8c966fcd8a96964e68ea8c365111ac167f15ced7ce03cfc9615aea0c7";

fn spec() -> BuildSpec {
    BuildSpec {
        from: Source::Template {
            name: "base".into(),
        },
        steps: vec![
            Step::Run {
                cmd: "apt-get update".into(),
                user: Some("root".into()),
                env: BTreeMap::new(),
                force: false,
            },
            Step::Copy {
                src: "app".into(),
                dest: "/app".into(),
                files_hash: HASH_A.into(),
                user: None,
                mode: None,
                force: false,
            },
            Step::Env {
                vars: [("A".to_string(), "1".to_string())].into(),
                force: false,
            },
            Step::Run {
                cmd: "make".into(),
                user: None,
                env: BTreeMap::new(),
                force: false,
            },
        ],
        start: Some(Start {
            cmd: Some("./serve".into()),
            ready: Some(ReadyCheck::Port { port: 8080 }),
        }),
        skip_cache: false,
        cpu_count: None,
        memory_mib: None,
    }
}

fn keys(spec: &BuildSpec) -> Vec<String> {
    layer_keys(spec, "source")
        .into_iter()
        .map(|k| k.key)
        .collect()
}

#[test]
fn one_key_per_step_then_the_start() {
    let keys = layer_keys(&spec(), "source");
    let layers: Vec<Layer> = keys.iter().map(|k| k.layer).collect();
    assert_eq!(
        layers,
        [
            Layer::Step(0),
            Layer::Step(1),
            Layer::Step(2),
            Layer::Step(3),
            Layer::Start
        ]
    );
    assert!(keys.iter().all(|k| k.cacheable));
    assert!(keys
        .iter()
        .all(|k| k.key.len() == 64 && k.key.bytes().all(|b| b.is_ascii_hexdigit())));
    // Stable: a change of the layout must change KEY_VERSION.
    assert_eq!(KEY_VERSION, "torpor-build/layer/v1");
    assert_eq!(layer_keys(&spec(), "source"), keys);
    let distinct: std::collections::BTreeSet<&String> = keys.iter().map(|k| &k.key).collect();
    assert_eq!(distinct.len(), 5);
    // The layout, pinned: sha256 over length-prefixed parts.
    assert_eq!(keys[0].key, GOLDEN);
}

#[test]
fn a_change_reaches_its_layer_and_every_later_one() {
    let before = keys(&spec());
    // The source.
    let other = layer_keys(&spec(), "source2");
    assert!(other.iter().zip(&before).all(|(a, b)| &a.key != b));
    // A COPY's files: from that step on.
    let mut s = spec();
    if let Step::Copy { files_hash, .. } = &mut s.steps[1] {
        *files_hash = HASH_B.into();
    }
    let after = keys(&s);
    assert_eq!(after[0], before[0]);
    assert!((1..5).all(|i| after[i] != before[i]));
    // An ENV changes the later RUN's meaning: a layer of its own.
    let mut s = spec();
    s.steps[2] = Step::Env {
        vars: [("A".to_string(), "2".to_string())].into(),
        force: false,
    };
    let after = keys(&s);
    assert_eq!(after[..2], before[..2]);
    assert!((2..5).all(|i| after[i] != before[i]));
    // The start and the sandbox's shape: the last layer only.
    let mut s = spec();
    s.start = Some(Start {
        cmd: Some("./serve".into()),
        ready: Some(ReadyCheck::Port { port: 8081 }),
    });
    let after = keys(&s);
    assert_eq!(after[..4], before[..4]);
    assert_ne!(after[4], before[4]);
    let mut s = spec();
    s.memory_mib = Some(2048);
    assert_ne!(keys(&s)[4], before[4]);
}

#[test]
fn force_and_skip_cache_are_data_not_keys() {
    let before = layer_keys(&spec(), "source");
    let mut s = spec();
    if let Step::Copy { force, .. } = &mut s.steps[1] {
        *force = true;
    }
    let forced = layer_keys(&s, "source");
    let cacheable: Vec<bool> = forced.iter().map(|k| k.cacheable).collect();
    assert_eq!(cacheable, [true, false, false, false, false]);
    // A forced layer is rebuilt under the same key, replacing the cached one.
    let same: Vec<&String> = forced.iter().map(|k| &k.key).collect();
    assert_eq!(same, before.iter().map(|k| &k.key).collect::<Vec<_>>());

    let mut s = spec();
    s.skip_cache = true;
    assert!(layer_keys(&s, "source").iter().all(|k| !k.cacheable));

    let mut s = spec();
    s.steps.clear();
    s.start = None;
    let only = layer_keys(&s, "source");
    assert_eq!(only.len(), 1);
    assert_eq!(
        only[0],
        LayerKey {
            layer: Layer::Start,
            key: only[0].key.clone(),
            cacheable: true
        }
    );
}

#[test]
fn canonical_steps_leave_force_out() {
    let step = Step::Run {
        cmd: "x".into(),
        user: None,
        env: [
            ("B".to_string(), "2".to_string()),
            ("A".to_string(), "1".to_string()),
        ]
        .into(),
        force: true,
    };
    assert_eq!(
        canonical_step(&step),
        r#"{"cmd":"x","env":{"A":"1","B":"2"},"type":"run"}"#
    );
}

#[test]
fn source_keys_hold_no_credentials() {
    let image = |user: &str, password: &str| Source::Image {
        reference: "registry.example.com/img:1".into(),
        username: Some(user.into()),
        password: Some(Secret::new(password)),
    };
    let digest = "sha256:1111";
    let a = source_key(&image("u", "hunter2"), digest);
    // Other credentials, the same image: the same key.
    assert_eq!(a, source_key(&image("v", "other"), digest));
    assert_eq!(
        a,
        source_key(
            &Source::Image {
                reference: "registry.example.com/img:1".into(),
                username: None,
                password: None
            },
            digest
        )
    );
    // Another digest: another key.
    assert_ne!(a, source_key(&image("u", "hunter2"), "sha256:2222"));
    assert_ne!(
        a,
        source_key(
            &Source::Template {
                name: "registry.example.com/img:1".into()
            },
            digest
        )
    );
    assert!(!a.contains("hunter2"));
}
