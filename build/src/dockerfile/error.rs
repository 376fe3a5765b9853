//! A Dockerfile's errors: [`DockerfileError`], the line and the
//! [`Problem`].

/// A Dockerfile that cannot be built, and where.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error("Dockerfile{}: {problem}", line.map(|l| format!(" line {l}")).unwrap_or_default())]
pub struct DockerfileError {
    /// The line the instruction starts on (None: the whole file).
    pub line: Option<usize>,
    /// What is wrong.
    pub problem: Problem,
}

impl DockerfileError {
    pub(crate) fn at(line: usize, problem: Problem) -> DockerfileError {
        DockerfileError {
            line: Some(line),
            problem,
        }
    }
}

/// What is wrong with a Dockerfile.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum Problem {
    /// Not an instruction this parser knows.
    #[error("unknown instruction {0}")]
    UnknownInstruction(String),
    /// A known instruction with no equivalent here.
    #[error("{0} is not supported")]
    Unsupported(String),
    /// `<<EOF`.
    #[error("heredocs (<<EOF) are not supported: put the text in a file and COPY it")]
    Heredoc,
    /// A second FROM.
    #[error("multi-stage builds are not supported: one FROM only")]
    MultiStage,
    /// `FROM scratch`.
    #[error("FROM scratch is not supported: a template needs an image with a shell")]
    Scratch,
    /// No FROM at all.
    #[error("no FROM instruction")]
    NoFrom,
    /// An instruction other than ARG before FROM.
    #[error("{0} before FROM")]
    BeforeFrom(String),
    /// Wrong arguments.
    #[error("{instruction}: {expected}")]
    Args {
        /// The instruction.
        instruction: &'static str,
        /// What it takes.
        expected: &'static str,
    },
    /// A flag the instruction does not take here.
    #[error("{instruction} {flag} is not supported")]
    Flag {
        /// The instruction.
        instruction: &'static str,
        /// The flag as written.
        flag: String,
    },
    /// `ADD` of a URL or git repository.
    #[error("ADD of a remote source {0:?} is not supported: RUN a download instead")]
    RemoteAdd(String),
    /// `ADD` of a local archive, which Docker unpacks.
    #[error(
        "ADD of the archive {0:?} (which Docker unpacks) is not supported: COPY it and RUN tar"
    )]
    AddArchive(String),
    /// `COPY --from`.
    #[error("COPY --from is not supported (multi-stage builds are not)")]
    CopyFrom,
    /// A COPY source that leaves the context.
    #[error(
        "COPY source {0:?} is outside the build context (relative paths without `..` above it)"
    )]
    OutsideContext(String),
    /// `--chmod` that is not octal.
    #[error("--chmod={0}: an octal mode such as 0755")]
    Chmod(String),
    /// An EXPOSE that is not `port[/proto]`.
    #[error("EXPOSE {0:?}: a port (80, 80/tcp, 8000-8010)")]
    Port(String),
    /// An ENV or ARG name that is not a variable name.
    #[error("{0:?} is not a variable name")]
    EnvName(String),
    /// Quotes or substitutions that do not parse.
    #[error("{0}")]
    Syntax(String),
}
