//! The `/v1` build spec: its JSON (tagged, unknown fields refused), its
//! validation errors, and the environment the executor folds steps
//! through (users, directories, variables, the commands it runs).

use std::collections::BTreeMap;

use torpor_build::env::{archive_path, expand, literal, resolve};
use torpor_build::{
    BuildSpec, CopyPlan, Environment, GuestCommand, Invalid, ReadyCheck, Secret, Source, SpecError,
    Start, Step, MAX_STEPS,
};

const HASH: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

fn vars(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn base(steps: Vec<Step>) -> BuildSpec {
    BuildSpec {
        from: Source::Template {
            name: "base".into(),
        },
        steps,
        start: None,
        skip_cache: false,
        cpu_count: None,
        memory_mib: None,
    }
}

fn run(cmd: &str) -> Step {
    Step::Run {
        cmd: cmd.into(),
        user: None,
        env: BTreeMap::new(),
        force: false,
    }
}

#[test]
fn json_round_trips_with_defaults_left_out() {
    let json = r#"{
        "from": {"type": "image", "reference": "python:3.12", "username": "u", "password": "p"},
        "steps": [
            {"type": "run", "cmd": "pip install flask", "user": "root"},
            {"type": "copy", "src": "app", "dest": "/app", "files_hash": "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef", "mode": 493, "force": true},
            {"type": "env", "vars": {"PORT": "8000"}},
            {"type": "workdir", "path": "/app"},
            {"type": "user", "name": "user"}
        ],
        "start": {"cmd": "python3 -m flask run", "ready": {"type": "url", "url": "http://localhost:8000/"}},
        "cpu_count": 2
    }"#;
    let spec: BuildSpec = serde_json::from_str(json).unwrap();
    spec.validate().unwrap();
    assert_eq!(
        spec.from,
        Source::Image {
            reference: "python:3.12".into(),
            username: Some("u".into()),
            password: Some(Secret::new("p")),
        }
    );
    assert!(spec.steps[1].force());
    assert_eq!(spec.steps[2].kind(), "env");
    assert!(!spec.skip_cache);
    assert_eq!(spec.memory_mib, None);
    let back = serde_json::to_value(&spec).unwrap();
    assert_eq!(
        back["steps"][0],
        serde_json::json!({"type": "run", "cmd": "pip install flask", "user": "root"})
    );
    assert_eq!(
        back["steps"][3],
        serde_json::json!({"type": "workdir", "path": "/app"})
    );
    assert_eq!(back["from"]["password"], "p");
    assert!(back.get("skip_cache").is_none());
    assert_eq!(serde_json::from_value::<BuildSpec>(back).unwrap(), spec);
    // Printed, the password is not.
    assert!(!format!("{:?}", spec.from).contains("\"p\""));
    let stored = serde_json::to_string(&spec.without_credentials()).unwrap();
    assert!(
        !stored.contains("password") && !stored.contains("username"),
        "{stored}"
    );
    assert_eq!(spec.without_credentials().steps, spec.steps);
}

#[test]
fn bad_json_is_refused() {
    for (json, needle) in [
        (
            r#"{"from": {"type": "template", "name": "base"}, "stepz": []}"#,
            "unknown field `stepz`",
        ),
        (
            r#"{"from": {"type": "template", "name": "base", "tag": "x"}}"#,
            "unknown field `tag`",
        ),
        (
            r#"{"from": {"type": "docker", "name": "base"}}"#,
            "unknown variant `docker`",
        ),
        (
            r#"{"from": {"type": "template", "name": "base"}, "steps": [{"type": "run"}]}"#,
            "missing field `cmd`",
        ),
        (
            r#"{"from": {"type": "template", "name": "base"}, "steps": [{"type": "run", "cmd": "x", "shell": "sh"}]}"#,
            "unknown field `shell`",
        ),
        (
            r#"{"from": {"type": "template", "name": "base"}, "start": {"ready": {"type": "port", "port": 70000}}}"#,
            "70000",
        ),
        (r#"{"from": "#, "EOF"),
    ] {
        let err = serde_json::from_str::<BuildSpec>(json)
            .unwrap_err()
            .to_string();
        assert!(err.contains(needle), "{json}: {err}");
    }
}

#[test]
fn validation_names_the_step_and_the_problem() {
    let copy = |src: &str, hash: &str| Step::Copy {
        src: src.into(),
        dest: "/x".into(),
        files_hash: hash.into(),
        user: None,
        mode: None,
        force: false,
    };
    let cases: Vec<(BuildSpec, SpecError)> = vec![
        (
            base(vec![run("true"), run(" \n")]),
            SpecError::Step {
                index: 1,
                kind: "run",
                problem: Invalid::Empty { field: "cmd" },
            },
        ),
        (
            base(vec![run("a\0b")]),
            SpecError::Step {
                index: 0,
                kind: "run",
                problem: Invalid::Nul { field: "cmd" },
            },
        ),
        (
            base(vec![copy("../x", HASH)]),
            SpecError::Step {
                index: 0,
                kind: "copy",
                problem: Invalid::OutsideContext {
                    field: "src",
                    value: "../x".into(),
                },
            },
        ),
        (
            base(vec![copy("/etc", HASH)]),
            SpecError::Step {
                index: 0,
                kind: "copy",
                problem: Invalid::OutsideContext {
                    field: "src",
                    value: "/etc".into(),
                },
            },
        ),
        (
            base(vec![copy("a", "ABC")]),
            SpecError::Step {
                index: 0,
                kind: "copy",
                problem: Invalid::Hash {
                    field: "files_hash",
                    value: "ABC".into(),
                },
            },
        ),
        (
            base(vec![Step::Env {
                vars: vars(&[("A-B", "1")]),
                force: false,
            }]),
            SpecError::Step {
                index: 0,
                kind: "env",
                problem: Invalid::EnvName { name: "A-B".into() },
            },
        ),
        (
            base(vec![Step::Env {
                vars: BTreeMap::new(),
                force: false,
            }]),
            SpecError::Step {
                index: 0,
                kind: "env",
                problem: Invalid::NoVars,
            },
        ),
        (
            base(vec![Step::User {
                name: "bad user".into(),
                force: false,
            }]),
            SpecError::Step {
                index: 0,
                kind: "user",
                problem: Invalid::User {
                    value: "bad user".into(),
                },
            },
        ),
        (
            base((0..=MAX_STEPS).map(|_| run("true")).collect()),
            SpecError::TooManySteps {
                count: MAX_STEPS + 1,
                max: MAX_STEPS,
            },
        ),
        (
            BuildSpec {
                from: Source::Upload { hash: "12".into() },
                ..base(vec![])
            },
            SpecError::Source(Invalid::Hash {
                field: "hash",
                value: "12".into(),
            }),
        ),
        (
            BuildSpec {
                from: Source::Image {
                    reference: "a".into(),
                    username: Some("u".into()),
                    password: None,
                },
                ..base(vec![])
            },
            SpecError::Source(Invalid::Credentials),
        ),
        (
            BuildSpec {
                from: Source::Template {
                    name: "my base".into(),
                },
                ..base(vec![])
            },
            SpecError::Source(Invalid::Whitespace {
                field: "name",
                value: "my base".into(),
            }),
        ),
        (
            BuildSpec {
                start: Some(Start {
                    cmd: None,
                    ready: None,
                }),
                ..base(vec![])
            },
            SpecError::Start(Invalid::NothingToStart),
        ),
        (
            BuildSpec {
                start: Some(Start {
                    cmd: Some("x".into()),
                    ready: Some(ReadyCheck::Port { port: 0 }),
                }),
                ..base(vec![])
            },
            SpecError::Start(Invalid::PortZero),
        ),
        (
            BuildSpec {
                start: Some(Start {
                    cmd: None,
                    ready: Some(ReadyCheck::File {
                        path: "tmp/ready".into(),
                    }),
                }),
                ..base(vec![])
            },
            SpecError::Start(Invalid::NotAbsolute {
                field: "path",
                value: "tmp/ready".into(),
            }),
        ),
        (
            BuildSpec {
                start: Some(Start {
                    cmd: None,
                    ready: Some(ReadyCheck::Url {
                        url: "ftp://x".into(),
                        status: None,
                    }),
                }),
                ..base(vec![])
            },
            SpecError::Start(Invalid::Url {
                url: "ftp://x".into(),
            }),
        ),
        (
            BuildSpec {
                start: Some(Start {
                    cmd: None,
                    ready: Some(ReadyCheck::Url {
                        url: "http://x/".into(),
                        status: Some(99),
                    }),
                }),
                ..base(vec![])
            },
            SpecError::Start(Invalid::Status { status: 99 }),
        ),
        (
            BuildSpec {
                memory_mib: Some(64),
                ..base(vec![])
            },
            SpecError::TooLittleMemory(64),
        ),
        (
            BuildSpec {
                cpu_count: Some(0),
                ..base(vec![])
            },
            SpecError::NoCpus,
        ),
    ];
    for (spec, want) in cases {
        assert_eq!(spec.validate(), Err(want));
    }
    let err = base(vec![run("true"), run("")]).validate().unwrap_err();
    assert_eq!(err.to_string(), "step 1 (run): cmd is empty");
    // What may be relative or empty is.
    let ok = base(vec![
        Step::Workdir {
            path: "rel/dir".into(),
            force: false,
        },
        Step::User {
            name: "1000:1000".into(),
            force: false,
        },
        Step::Env {
            vars: vars(&[("EMPTY", "")]),
            force: false,
        },
        copy("./a/../b/*.py", HASH),
    ]);
    assert_eq!(ok.validate(), Ok(()));
}

#[test]
fn environment_folds_env_workdir_and_user() {
    let mut env = Environment::default();
    assert_eq!((env.user.as_str(), env.workdir.as_deref()), ("user", None));
    env.env = vars(&[("PATH", "/usr/bin:/bin")]);
    env.apply(&Step::Env {
        vars: vars(&[
            ("PATH", "/opt/venv/bin:$PATH"),
            ("HOME2", "${HOME:-/nohome}"),
            ("LIT", "\\$PATH"),
        ]),
        force: false,
    });
    assert_eq!(
        env.env,
        vars(&[
            ("PATH", "/opt/venv/bin:/usr/bin:/bin"),
            ("HOME2", "/nohome"),
            ("LIT", "$PATH"),
        ])
    );
    // Values see the variables before the step, not each other.
    env.apply(&Step::Env {
        vars: vars(&[("A", "1"), ("B", "a${A}b")]),
        force: false,
    });
    assert_eq!(env.env["B"], "ab");
    env.apply(&Step::Workdir {
        path: "app/./src/..".into(),
        force: false,
    });
    assert_eq!(env.workdir.as_deref(), Some("/app"));
    env.apply(&Step::Workdir {
        path: "../srv".into(),
        force: false,
    });
    assert_eq!(env.workdir.as_deref(), Some("/srv"));
    env.apply(&Step::User {
        name: "root".into(),
        force: false,
    });
    env.apply(&run("true"));
    assert_eq!(env.user, "root");

    let cmd = env
        .run(&Step::Run {
            cmd: "echo $V".into(),
            user: Some("user".into()),
            env: vars(&[("V", "${B}x")]),
            force: false,
        })
        .unwrap();
    let mut want_env = env.env.clone();
    want_env.insert("V".into(), "abx".into());
    want_env.insert(
        "PATH".into(),
        "/opt/venv/bin:/usr/bin:/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
            .into(),
    );
    assert_eq!(
        cmd,
        GuestCommand {
            argv: vec![
                "/bin/bash".into(),
                "-l".into(),
                "-c".into(),
                "echo $V".into()
            ],
            user: "user".into(),
            cwd: Some("/srv".into()),
            env: want_env,
        }
    );
    // The step's user is for that step only.
    assert_eq!(env.user, "root");
    assert_eq!(
        env.run(&Step::User {
            name: "x".into(),
            force: false
        }),
        None
    );
}

#[test]
fn copy_plans_follow_e2b() {
    let env = Environment::default();
    let copy = |src: &str, user: Option<&str>| Step::Copy {
        src: src.into(),
        dest: "app/".into(),
        files_hash: HASH.into(),
        user: user.map(String::from),
        mode: Some(0o755),
        force: false,
    };
    assert_eq!(
        env.copy(&copy("app/src/*.py", None)).unwrap(),
        CopyPlan {
            archive_path: "app/src".into(),
            dest: "app/".into(),
            cwd: None,
            owner: "user:user".into(),
            mode: Some(0o755),
        }
    );
    assert_eq!(
        env.copy(&copy("a.txt", Some("www:staff"))).unwrap().owner,
        "www:staff"
    );
    assert_eq!(
        env.copy(&copy("a.txt", Some("www"))).unwrap().owner,
        "www:www"
    );
    assert_eq!(env.copy(&run("x")), None);
    for (src, want) in [
        ("a.txt", "a.txt"),
        ("app/", "app"),
        ("./app/src", "app/src"),
        ("*.py", "."),
        (".", "."),
        ("a/b/**/c", "a/b"),
        ("a/../b/[xy].txt", "b"),
    ] {
        assert_eq!(archive_path(src), want, "{src}");
    }
}

#[test]
fn start_commands_and_ready_checks() {
    let mut env = Environment::default();
    env.apply(&Step::Workdir {
        path: "/app".into(),
        force: false,
    });
    let start = Start {
        cmd: Some("npm start".into()),
        ready: None,
    };
    let started = env.start(&start).unwrap();
    assert_eq!(started.argv[3], "npm start");
    assert_eq!(started.cwd.as_deref(), Some("/app"));
    // No check: E2B's 20 s.
    assert_eq!(env.ready(&start).argv[3], "sleep 20");
    let start = Start {
        cmd: None,
        ready: Some(ReadyCheck::File {
            path: "/tmp/up".into(),
        }),
    };
    assert_eq!(env.start(&start), None);
    assert_eq!(env.ready(&start).argv[3], "[ -f /tmp/up ]");
}

#[test]
fn expansion_rules() {
    let v = vars(&[("A", "1"), ("E", "")]);
    for (input, want) in [
        ("$A", "1"),
        ("${A}x", "1x"),
        ("$Ax", ""),
        ("${E:-d}", "d"),
        ("${E-d}", ""),
        ("${U-d}", "d"),
        ("${A:+alt}", "alt"),
        ("${E:+alt}", ""),
        ("${E+alt}", "alt"),
        ("${U:-${A}2}", "12"),
        ("\\$A", "$A"),
        ("a\\\\b", "a\\b"),
        ("$(cmd) $1 $", "$(cmd) $1 $"),
        ("${A", "${A"),
        ("${A:?x}", "${A:?x}"),
    ] {
        assert_eq!(expand(input, &v), want, "{input}");
    }
    let odd = "a$b\\c${d}";
    assert_eq!(expand(&literal(odd), &v), odd);
    assert_eq!(resolve("/a/b", "../../../c"), "/c");
    assert_eq!(resolve("/a", "/x/./y/"), "/x/y");
}
