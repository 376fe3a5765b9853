//! Dockerfiles into build specs: each instruction, substitution, line
//! handling, and the Dockerfiles refused (with their line numbers).

use std::collections::BTreeMap;

use torpor_build::{
    parse_dockerfile, BuildSpec, CopyInput, DockerfileError, Problem, ReadyCheck, Source,
    SpecError, Start, Step,
};

const HASH: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

fn parse(text: &str) -> Result<torpor_build::ParsedDockerfile, DockerfileError> {
    parse_dockerfile(text, &BTreeMap::new())
}

fn steps(text: &str) -> Vec<Step> {
    parse(text).unwrap().spec.steps
}

fn vars(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn run(cmd: &str, env: &[(&str, &str)]) -> Step {
    Step::Run {
        cmd: cmd.into(),
        user: None,
        env: vars(env),
        force: false,
    }
}

fn user(name: &str) -> Step {
    Step::User {
        name: name.into(),
        force: false,
    }
}

fn workdir(path: &str) -> Step {
    Step::Workdir {
        path: path.into(),
        force: false,
    }
}

fn error(text: &str) -> (Option<usize>, Problem) {
    let err = parse(text).unwrap_err();
    (err.line, err.problem)
}

#[test]
fn a_whole_dockerfile() {
    let text = r#"# syntax=docker/dockerfile:1
# A comment before everything.
ARG PY=3.12
FROM python:${PY}-slim AS app

ARG VERSION=1.0
ENV APP_HOME=/srv/app \
    PATH=/srv/app/bin:$PATH
WORKDIR $APP_HOME
# Comments between instructions.
COPY --chown=app:app --chmod=0755 requirements.txt src/ ./
RUN pip install -r requirements.txt && \
    echo "version $VERSION"
RUN ["python3", "-c", "print('hi there')"]
USER app
EXPOSE 8000/tcp
LABEL org.opencontainers.image.title="demo"
CMD ["gunicorn", "-b", "0.0.0.0:8000", "app:app"]
"#;
    let parsed = parse(text).unwrap();
    assert_eq!(
        parsed.spec,
        BuildSpec {
            from: Source::Image {
                reference: "python:3.12-slim".into(),
                username: None,
                password: None
            },
            steps: vec![
                user("root"),
                workdir("/"),
                Step::Env {
                    vars: vars(&[("APP_HOME", "/srv/app"), ("PATH", "/srv/app/bin:$PATH")]),
                    force: false
                },
                workdir("/srv/app"),
                Step::Copy {
                    src: "requirements.txt".into(),
                    dest: "./".into(),
                    files_hash: String::new(),
                    user: Some("app:app".into()),
                    mode: Some(0o755),
                    force: false
                },
                Step::Copy {
                    src: "src/".into(),
                    dest: "./".into(),
                    files_hash: String::new(),
                    user: Some("app:app".into()),
                    mode: Some(0o755),
                    force: false
                },
                run(
                    "pip install -r requirements.txt &&     echo \"version $VERSION\"",
                    &[("VERSION", "1.0")]
                ),
                run(
                    "python3 -c 'print('\"'\"'hi there'\"'\"')'",
                    &[("VERSION", "1.0")]
                ),
                user("app"),
            ],
            start: Some(Start {
                cmd: Some("gunicorn -b 0.0.0.0:8000 app:app".into()),
                ready: Some(ReadyCheck::Port { port: 8000 }),
            }),
            skip_cache: false,
            cpu_count: None,
            memory_mib: None,
        }
    );
    assert_eq!(
        parsed.copies,
        [
            CopyInput {
                step: 4,
                src: "requirements.txt".into(),
                line: 11
            },
            CopyInput {
                step: 5,
                src: "src/".into(),
                line: 11
            },
        ]
    );
    // The CLI packs each source; then the spec is complete.
    let spec = parsed
        .into_spec(|src| {
            assert!(src == "requirements.txt" || src == "src/");
            Ok::<_, SpecError>(HASH.to_string())
        })
        .unwrap();
    assert!(spec
        .steps
        .iter()
        .all(|s| !matches!(s, Step::Copy { files_hash, .. } if files_hash != HASH)));
}

#[test]
fn build_args_override_defaults() {
    let text = "ARG BASE=debian:12\nFROM $BASE\nARG BASE\nARG MODE=dev\nARG UNSET\nWORKDIR /x/${MODE}/${UNSET:-none}/${MODE:+on}\nRUN echo $MODE\n";
    let args = vars(&[("MODE", "prod"), ("BASE", "ubuntu:24.04")]);
    let spec = parse_dockerfile(text, &args).unwrap().spec;
    assert_eq!(
        spec.from,
        Source::Image {
            reference: "ubuntu:24.04".into(),
            username: None,
            password: None
        }
    );
    assert_eq!(spec.steps[2], workdir("/x/prod/none/on"));
    // ARGs reach RUN as its own variables (the global BASE re-declared).
    assert_eq!(
        spec.steps[3],
        run("echo $MODE", &[("BASE", "ubuntu:24.04"), ("MODE", "prod")])
    );
    // Not persisted; the template ends as E2B's user (its WORKDIR kept).
    assert_eq!(spec.steps[4..], [user("user")]);
    // Without build args, the defaults.
    let spec = parse(text).unwrap().spec;
    assert_eq!(spec.steps[2], workdir("/x/dev/none/on"));
}

#[test]
fn env_forms_and_escapes() {
    let got = steps(
        "FROM a\nARG V='x y'\nENV LEGACY some value here\nENV A=\"$V\" B='$HOME' C=${V}\\$D E=${PATH:-/bin}\n",
    );
    assert_eq!(
        got[2],
        Step::Env {
            vars: vars(&[("LEGACY", "some value here")]),
            force: false
        }
    );
    // ARGs substituted now (escaped), the rest left for the guest-side
    // environment; single quotes make a literal dollar.
    assert_eq!(
        got[3],
        Step::Env {
            vars: vars(&[
                ("A", "x y"),
                ("B", "\\$HOME"),
                ("C", "x y\\$D"),
                ("E", "${PATH:-/bin}")
            ]),
            force: false
        }
    );
    // Substitution in later instructions uses the ENV (over the ARG).
    let got = steps("FROM a\nARG D=/arg\nENV D=/env\nWORKDIR $D\nUSER ${NOBODY:-nobody}\n");
    assert_eq!(got[3..5], [workdir("/env"), user("nobody")]);
}

#[test]
fn continuations_comments_and_the_escape_directive() {
    let got = steps("# escape=`\nFROM mcr.microsoft.com/x\nRUN echo a `\n# inside\n\n    b\nCOPY C:\\src\\file.txt /dst/\n");
    assert_eq!(got[2], run("echo a     b", &[]));
    let Step::Copy { src, .. } = &got[3] else {
        panic!("{:?}", got[3]);
    };
    assert_eq!(src, "C:\\src\\file.txt");
    // A continuation at the end of the file ends the instruction.
    let got = steps("FROM a\nRUN echo last \\");
    assert_eq!(got[2], run("echo last", &[]));
}

#[test]
fn start_command_rules() {
    let start = |text: &str| parse(text).unwrap().spec.start;
    let cmd = |c: &str, ready: Option<ReadyCheck>| {
        Some(Start {
            cmd: Some(c.into()),
            ready,
        })
    };
    assert_eq!(
        start("FROM a\nCMD node server.js\n"),
        cmd("node server.js", None)
    );
    assert_eq!(
        start("FROM a\nENTRYPOINT [\"/entry.sh\"]\nCMD [\"--port\", \"80\"]\n"),
        cmd("/entry.sh --port 80", None)
    );
    assert_eq!(
        start("FROM a\nENTRYPOINT [\"/entry.sh\"]\nCMD run it\n"),
        cmd("/entry.sh /bin/sh -c 'run it'", None)
    );
    assert_eq!(
        start("FROM a\nENTRYPOINT exec server\nCMD [\"ignored\"]\n"),
        cmd("exec server", None)
    );
    assert_eq!(start("FROM a\nEXPOSE 80\n"), None);
    assert_eq!(
        start("FROM a\nEXPOSE 80 53/udp\nCMD s\n"),
        cmd("s", Some(ReadyCheck::Port { port: 80 }))
    );
    assert_eq!(start("FROM a\nEXPOSE 80 443\nCMD s\n"), cmd("s", None));
    assert_eq!(start("FROM a\nEXPOSE 8000-8001\nCMD s\n"), cmd("s", None));
    assert_eq!(
        start("FROM a\nEXPOSE 80\nHEALTHCHECK --interval=5s CMD curl -f http://localhost/ || exit 1\nCMD s\n"),
        cmd(
            "s",
            Some(ReadyCheck::Command {
                cmd: "curl -f http://localhost/ || exit 1".into()
            })
        )
    );
    assert_eq!(
        start("FROM a\nEXPOSE 80\nHEALTHCHECK NONE\nCMD s\n"),
        cmd("s", None)
    );
}

#[test]
fn shell_and_ignored_instructions() {
    let got = steps(
        "FROM a\nSHELL [\"/bin/bash\", \"-o\", \"pipefail\", \"-c\"]\nRUN --mount=type=cache,target=/root/.cache --network=host curl x | sh\nVOLUME /data\nSTOPSIGNAL SIGTERM\nMAINTAINER me\n",
    );
    assert_eq!(got[2], run("set -o pipefail\ncurl x | sh", &[]));
    assert_eq!(got.len(), 5);
}

#[test]
fn refused_dockerfiles_name_their_line() {
    let cases: Vec<(&str, Option<usize>, Problem)> = vec![
        (
            "FROM a\n\nRUN x\nFOO bar\n",
            Some(4),
            Problem::UnknownInstruction("FOO".into()),
        ),
        (
            "FROM a\nRUN <<EOF\necho hi\nEOF\n",
            Some(2),
            Problem::Heredoc,
        ),
        ("FROM a\nCOPY <<-\"EOT\" /x\n", Some(2), Problem::Heredoc),
        (
            "FROM golang AS build\nRUN go build\nFROM debian\nCOPY --from=build /app /app\n",
            Some(3),
            Problem::MultiStage,
        ),
        ("FROM scratch\n", Some(1), Problem::Scratch),
        (
            "RUN x\nFROM a\n",
            Some(1),
            Problem::BeforeFrom("RUN".into()),
        ),
        ("# only a comment\n", None, Problem::NoFrom),
        (
            "FROM a\nADD http://example.com/x.tgz /x\n",
            Some(2),
            Problem::RemoteAdd("http://example.com/x.tgz".into()),
        ),
        (
            "FROM a\nADD git@github.com:o/r.git /r\n",
            Some(2),
            Problem::RemoteAdd("git@github.com:o/r.git".into()),
        ),
        (
            "FROM a\nADD vendor.tar.gz /v/\n",
            Some(2),
            Problem::AddArchive("vendor.tar.gz".into()),
        ),
        ("FROM a\nCOPY --from=b /x /y\n", Some(2), Problem::CopyFrom),
        (
            "FROM a\nCOPY ../x /y\n",
            Some(2),
            Problem::OutsideContext("../x".into()),
        ),
        (
            "FROM a\nCOPY /etc/passwd /y\n",
            Some(2),
            Problem::OutsideContext("/etc/passwd".into()),
        ),
        (
            "FROM a\nCOPY --chmod=u+x a /y\n",
            Some(2),
            Problem::Chmod("u+x".into()),
        ),
        (
            "FROM a\nCOPY --exclude=*.md . /y\n",
            Some(2),
            Problem::Flag {
                instruction: "COPY",
                flag: "--exclude=*.md".into(),
            },
        ),
        (
            "FROM a\nRUN --mount=type=secret,id=x cat /run/secrets/x\n",
            Some(2),
            Problem::Flag {
                instruction: "RUN",
                flag: "--mount=type=secret,id=x".into(),
            },
        ),
        (
            "FROM a\nCOPY onlyone\n",
            Some(2),
            Problem::Args {
                instruction: "COPY",
                expected: "one or more sources and a destination",
            },
        ),
        (
            "FROM a\nENV 1BAD=x\n",
            Some(2),
            Problem::EnvName("1BAD".into()),
        ),
        (
            "FROM a\nEXPOSE http\n",
            Some(2),
            Problem::Port("http".into()),
        ),
        (
            "FROM a\nONBUILD RUN x\n",
            Some(2),
            Problem::Unsupported("ONBUILD".into()),
        ),
        (
            "FROM a\nSHELL [\"powershell\", \"-Command\"]\n",
            Some(2),
            Problem::Unsupported("SHELL [\"powershell\", \"-Command\"]".into()),
        ),
        (
            "FROM a\nWORKDIR ${X:?required}\n",
            Some(2),
            Problem::Syntax(
                "unsupported substitution modifier \":?\" in ${X...} (:-, -, :+, +)".into(),
            ),
        ),
        (
            "FROM a\nUSER \"unterminated\n",
            Some(2),
            Problem::Syntax("unterminated double quote".into()),
        ),
        (
            "FROM a\nRUN\n",
            Some(2),
            Problem::Args {
                instruction: "RUN",
                expected: "a command",
            },
        ),
    ];
    for (text, line, problem) in cases {
        assert_eq!(error(text), (line, problem), "{text}");
    }
    assert_eq!(
        parse("FROM a\n\n  frob x\n").unwrap_err().to_string(),
        "Dockerfile line 3: unknown instruction frob"
    );
    assert_eq!(
        parse("").unwrap_err().to_string(),
        "Dockerfile: no FROM instruction"
    );
}

#[test]
fn shell_arithmetic_is_not_a_heredoc() {
    let got = steps("FROM a\nRUN echo $((1<<4)) && cat <<< \"x\" && echo '<<EOF'\n");
    assert_eq!(
        got[2],
        run("echo $((1<<4)) && cat <<< \"x\" && echo '<<EOF'", &[])
    );
}

#[test]
fn unpacked_contexts_must_be_valid() {
    let parsed = parse("FROM a\nCOPY a /b\n").unwrap();
    let err = parsed
        .into_spec(|_| Ok::<_, SpecError>("not-a-hash".to_string()))
        .unwrap_err();
    assert!(
        matches!(
            err,
            SpecError::Step {
                index: 2,
                kind: "copy",
                ..
            }
        ),
        "{err}"
    );
}
