//! E2B's build body, as its SDKs really send it (fixtures/gen_python.py
//! and fixtures/gen_js.mjs wrote the fixtures with the installed SDKs,
//! offline), converted into build specs; and the bodies it refuses.

use std::collections::BTreeMap;

use torpor_build::{
    BuildSpec, E2bError, Invalid, ReadyCheck, RegistryConfig, Secret, Source, SpecError, Start,
    Step, TemplateBuildStartV2,
};

fn spec(json: &str) -> Result<BuildSpec, E2bError> {
    TemplateBuildStartV2::from_json(json.as_bytes())?.into_spec(Some(2), Some(1024))
}

fn run(cmd: &str, user: Option<&str>, force: bool) -> Step {
    Step::Run {
        cmd: cmd.into(),
        user: user.map(String::from),
        env: BTreeMap::new(),
        force,
    }
}

fn vars(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn python_sdk_from_template() {
    let spec = spec(include_str!("fixtures/python_template_base.json")).unwrap();
    assert_eq!(
        spec,
        BuildSpec {
            from: Source::Template {
                name: "base".into()
            },
            steps: vec![
                run(
                    "apt-get update && DEBIAN_FRONTEND=noninteractive DEBCONF_NOWARNINGS=yes apt-get install -y curl",
                    Some("root"),
                    false
                ),
                Step::Copy {
                    src: "a.txt".into(),
                    dest: "/home/user/".into(),
                    files_hash: "2777d950bc167ae702ca3e65775c4e0551d1078c422c8d60fabb027c94688110"
                        .into(),
                    user: None,
                    mode: None,
                    force: false,
                },
                Step::Env {
                    vars: vars(&[("FOO", "bar"), ("EMPTY", ""), ("SPACED", "a b")]),
                    force: false
                },
                Step::Workdir {
                    path: "/home/user/app".into(),
                    force: false
                },
                Step::User {
                    name: "root".into(),
                    force: false
                },
                run("echo hi > /tmp/x", None, false),
            ],
            start: Some(Start {
                cmd: Some("python3 -m http.server 8000".into()),
                ready: Some(ReadyCheck::Port { port: 8000 }),
            }),
            skip_cache: false,
            cpu_count: Some(2),
            memory_mib: Some(1024),
        }
    );
}

#[test]
fn python_sdk_image_with_credentials_helpers_and_skip_cache() {
    let spec = spec(include_str!("fixtures/python_image_registry.json")).unwrap();
    assert_eq!(
        spec.from,
        Source::Image {
            reference: "registry.example.com/team/img:1.2".into(),
            username: Some("u".into()),
            password: Some(Secret::new("p")),
        }
    );
    // skip_cache() before the first step: every step is forced.
    assert!(spec.steps.iter().all(Step::force));
    assert!(!spec.skip_cache);
    let cmds: Vec<(&str, Option<&str>)> = spec
        .steps
        .iter()
        .filter_map(|s| match s {
            Step::Run { cmd, user, .. } => Some((cmd.as_str(), user.as_deref())),
            _ => None,
        })
        .collect();
    assert_eq!(
        cmds,
        [
            ("pip install requests flask", Some("root")),
            ("npm install -g typescript", Some("root")),
            (
                "git clone https://github.com/e2b-dev/e2b.git --branch main --single-branch --depth 1 /opt/e2b",
                None
            ),
            ("rm -r -f /tmp/junk", None),
            ("mv /a /b", None),
            ("mkdir -p -m 0700 /data /logs", None),
            ("ln -s /usr/bin/python3 /usr/local/bin/py", None),
            ("ls && pwd", Some("user")),
        ]
    );
    assert_eq!(
        spec.steps[3],
        Step::Copy {
            src: "app".into(),
            dest: "/app".into(),
            files_hash: "ec6e35ceedd00707485fe9a2781772ef8a0be087ea25e65a1be46fd1739dc052".into(),
            user: Some("user:user".into()),
            mode: Some(0o755),
            force: true,
        }
    );
    // wait_for_url's curl command becomes the typed check (python3 in the guest).
    assert_eq!(
        spec.start,
        Some(Start {
            cmd: None,
            ready: Some(ReadyCheck::Url {
                url: "http://localhost:3000/health".into(),
                status: Some(204)
            }),
        })
    );
    // The password is never printed.
    assert!(!format!("{spec:?}").contains("\"p\""));
}

#[test]
fn python_sdk_dockerfile_and_glob() {
    let spec = spec(include_str!("fixtures/python_dockerfile.json")).unwrap();
    assert_eq!(
        spec.from,
        Source::Image {
            reference: "ubuntu:22.04".into(),
            username: None,
            password: None
        }
    );
    let kinds: Vec<&str> = spec.steps.iter().map(Step::kind).collect();
    assert_eq!(
        kinds,
        ["user", "workdir", "env", "workdir", "copy", "run", "user"]
    );
    assert_eq!(
        spec.start,
        Some(Start {
            cmd: Some("python3 app.py".into()),
            ready: Some(ReadyCheck::Delay { ms: 20_000 }),
        })
    );

    let spec = spec_glob();
    assert_eq!(
        spec.from,
        Source::Image {
            reference: "e2bdev/base".into(),
            username: None,
            password: None
        }
    );
    let Step::Copy { src, dest, .. } = &spec.steps[0] else {
        panic!("{:?}", spec.steps[0]);
    };
    assert_eq!((src.as_str(), dest.as_str()), ("app/src/*.py", "/dst/"));
    // wait_for_timeout(2500): whole seconds, at least one.
    assert_eq!(
        spec.start.unwrap().ready,
        Some(ReadyCheck::Delay { ms: 2000 })
    );
}

fn spec_glob() -> BuildSpec {
    spec(include_str!("fixtures/python_base_image_glob.json")).unwrap()
}

#[test]
fn js_sdk_sends_the_same_body() {
    let spec = spec(include_str!("fixtures/js_template_base.json")).unwrap();
    assert_eq!(
        spec.steps[2],
        Step::Copy {
            src: "app".into(),
            dest: "/app".into(),
            files_hash: "24d9744aa32c634b046156955fdd3c30bcc6e25fda424302b4a917607bc3663d".into(),
            user: Some("user".into()),
            mode: Some(0o644),
            // forceUpload forces the step too.
            force: true,
        }
    );
    let forces: Vec<bool> = spec.steps.iter().map(Step::force).collect();
    assert_eq!(forces, [false, false, true, false, false, true, true]);
    assert_eq!(spec.steps[6], run("echo hi > /tmp/x", Some("user"), true));
    // The same files, the same hash from both SDKs.
    let python = self::spec(include_str!("fixtures/python_template_base.json")).unwrap();
    assert_eq!(spec.steps[1], python.steps[1]);
}

#[test]
fn aws_and_gcp_registries_are_refused() {
    let err = spec(include_str!("fixtures/python_aws_registry.json")).unwrap_err();
    assert!(
        matches!(err, E2bError::UnsupportedRegistry { kind: "aws" }),
        "{err}"
    );
    let body = r#"{"fromImage": "gcr.io/p/i", "fromImageRegistry": {"type": "gcp", "serviceAccountJson": "{}"}, "steps": []}"#;
    let parsed = TemplateBuildStartV2::from_json(body.as_bytes()).unwrap();
    assert!(matches!(
        parsed.from_image_registry,
        Some(RegistryConfig::Gcp { .. })
    ));
    let err = parsed.into_spec(None, None).unwrap_err();
    assert_eq!(
        err.to_string(),
        "fromImageRegistry of type gcp is not supported: use type registry (username and password)"
    );
}

#[test]
fn registry_credentials_are_for_images_only() {
    // The SDK keeps from_image's credentials after a later from_template.
    let body = r#"{"fromTemplate": "base", "fromImageRegistry": {"type": "registry", "username": "u", "password": "p"}, "force": true}"#;
    let spec = spec(body).unwrap();
    assert_eq!(
        spec.from,
        Source::Template {
            name: "base".into()
        }
    );
    assert!(spec.skip_cache);
    assert!(spec.steps.is_empty());
    assert_eq!(spec.start, None);
}

#[test]
fn malformed_bodies_are_typed_errors() {
    let cases: [(&str, &str); 10] = [
        ("{", "invalid build body"),
        (r#"{"steps": []}"#, "neither fromImage nor fromTemplate"),
        (
            r#"{"fromImage": "a", "fromTemplate": "b"}"#,
            "both fromImage and fromTemplate",
        ),
        (
            r#"{"fromImage": "a", "steps": [{"type": "ADD", "args": ["x", "y"]}]}"#,
            "step 0: unknown type \"ADD\"",
        ),
        (
            r#"{"fromImage": "a", "steps": [{"type": "RUN", "args": []}]}"#,
            "step 0 (RUN): 0 args, expected 1 or 2",
        ),
        (
            r#"{"fromImage": "a", "steps": [{"type": "ENV", "args": ["A"]}]}"#,
            "step 0 (ENV): 1 args, expected pairs",
        ),
        (
            r#"{"fromImage": "a", "steps": [{"type": "COPY", "args": ["a", "/b"]}]}"#,
            "step 0 (COPY): no filesHash",
        ),
        (
            r#"{"fromImage": "a", "steps": [{"type": "COPY", "args": ["a", "/b", "", "u+x"], "filesHash": "00"}]}"#,
            "step 0 (COPY): mode \"u+x\" is not an octal file mode",
        ),
        (
            r#"{"fromImage": "a", "steps": [{"type": "ENV", "args": ["1A", "x"]}]}"#,
            "step 0 (env): \"1A\" is not an environment variable name",
        ),
        (
            r#"{"fromImage": "a", "steps": [{"type": "RUN", "args": ["  "]}]}"#,
            "step 0 (run): cmd is empty",
        ),
    ];
    for (body, message) in cases {
        let err = spec(body).unwrap_err().to_string();
        assert!(err.starts_with(message), "{body}: {err}");
    }
    let err = spec(r#"{"fromImage": "a", "steps": [{"type": "COPY", "args": ["../x", "/b"], "filesHash": "00"}]}"#)
        .unwrap_err();
    assert!(
        matches!(
            err,
            E2bError::Spec(SpecError::Step {
                index: 0,
                kind: "copy",
                problem: Invalid::OutsideContext { .. }
            })
        ),
        "{err}"
    );
}

#[test]
fn lowercase_types_extra_fields_and_backslashes() {
    let body = r#"{"fromImage": "a", "steps": [
        {"type": "env", "args": ["P", "C:\\dir\\$HOME"], "resolveSymlinks": false, "gzip": true, "future": 1},
        {"type": "run", "args": ["true", ""], "force": null}
    ], "startCmd": "", "readyCmd": ""}"#;
    let spec = spec(body).unwrap();
    // E2B's backslash is literal: escaped in ours; `$HOME` still expands.
    assert_eq!(
        spec.steps[0],
        Step::Env {
            vars: vars(&[("P", "C:\\\\dir\\\\$HOME")]),
            force: false
        }
    );
    assert_eq!(spec.steps[1], run("true", None, false));
    assert_eq!(spec.start, None);
}
