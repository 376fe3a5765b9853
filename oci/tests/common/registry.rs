//! The registry test's loopback registry, shared with the API's OCI
//! build test (`#[path]`): Debian's `docker-registry` (distribution 2.8)
//! on 127.0.0.1 with TLS (a CA and certificate made here with rcgen) and
//! htpasswd basic auth, an image made with umoci (two layers: the second
//! deletes a file, a whiteout), skopeo to push and to write archives,
//! debugfs to read ext4 images back. Every command has a time limit; the
//! registry is killed when its guard drops. Needs root (umoci unpacks as
//! root, ownership), and rcgen and rustix.

#![allow(dead_code)]

use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const USER: &str = "tester";
pub const PASSWORD: &str = "s3cret-pass";
/// bcrypt (cost 4: the registry checks it on every request) of PASSWORD,
/// the only hash distribution's htpasswd takes.
const HTPASSWD: &str = "tester:$2b$04$0S0KeQ7q1MsTn3mZbIx.zeSGkGxluDD6.83IRggakU8JFazBvZRry\n";

/// Runs a command, at most `limit`; its stdout, or a panic with its output.
pub fn run(cmd: &mut Command, limit: Duration) -> String {
    let shown = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{shown}: {e}"));
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let (mut out, mut err) = (String::new(), String::new());
            child
                .stdout
                .take()
                .unwrap()
                .read_to_string(&mut out)
                .unwrap();
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            assert!(status.success(), "{shown}: {status}\n{out}\n{err}");
            return out;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{shown}: still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub fn tool(name: &str) -> PathBuf {
    ["/usr/bin", "/usr/local/bin", "/usr/sbin"]
        .iter()
        .map(|d| Path::new(d).join(name))
        .find(|p| p.exists())
        .unwrap_or_else(|| {
            panic!(
                "no {name}: apt-get install docker-registry umoci skopeo (scripts/setup test \
                 installs them; scripts/test leaves this test out without them)"
            )
        })
}

/// The registry process, killed when dropped: on 127.0.0.1:`port`, its
/// CA in `certs/ca.crt` of its directory (skopeo's `--dest-cert-dir`).
pub struct Registry {
    child: Child,
    log: PathBuf,
    pub port: u16,
    pub certs: PathBuf,
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!(
                "registry log:\n{}",
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
        }
    }
}

/// A CA, and a certificate for 127.0.0.1 it signed: (CA PEM, cert PEM, key PEM).
fn certificates() -> (String, String, String) {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    };
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "torpor-oci test CA");
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca, ca_key);
    let key = KeyPair::generate().unwrap();
    let mut leaf =
        CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()]).unwrap();
    leaf.distinguished_name
        .push(DnType::CommonName, "127.0.0.1");
    let cert = leaf.signed_by(&key, &issuer).unwrap();
    (ca_cert.pem(), cert.pem(), key.serialize_pem())
}

/// A registry in `dir` (its data, certificates, htpasswd and log there),
/// [`USER`] with [`PASSWORD`] its one account.
pub fn start_registry(dir: &Path) -> Registry {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let (ca, cert, key) = certificates();
    std::fs::create_dir_all(dir.join("certs")).unwrap();
    std::fs::write(dir.join("certs/ca.crt"), &ca).unwrap();
    std::fs::write(dir.join("server.crt"), cert).unwrap();
    std::fs::write(dir.join("server.key"), key).unwrap();
    std::fs::write(dir.join("htpasswd"), HTPASSWD).unwrap();
    let d = dir.display();
    let config = format!(
        "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {d}/data\n\
         http:\n  addr: 127.0.0.1:{port}\n  secret: torpor-oci-test\n  tls:\n    certificate: {d}/server.crt\n    key: {d}/server.key\n\
         auth:\n  htpasswd:\n    realm: torpor-oci-test\n    path: {d}/htpasswd\n"
    );
    std::fs::write(dir.join("config.yml"), config).unwrap();
    let log = dir.join("registry.log");
    let child = Command::new(tool("docker-registry"))
        .arg("serve")
        .arg(dir.join("config.yml"))
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(std::fs::File::create(dir.join("registry.err")).unwrap())
        .spawn()
        .unwrap();
    let registry = Registry {
        child,
        log,
        port,
        certs: dir.join("certs"),
    };
    let start = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the registry did not listen"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    registry
}

impl Registry {
    /// `127.0.0.1:PORT/repo`.
    pub fn reference(&self, repo: &str) -> String {
        format!("127.0.0.1:{}/{repo}", self.port)
    }

    /// The CA its certificate is signed by (PEM).
    pub fn ca_pem(&self) -> Vec<u8> {
        std::fs::read(self.certs.join("ca.crt")).unwrap()
    }

    /// Pushes the layout image `layout` (`oci:DIR:TAG`) as `repo` (with a
    /// tag), with the account's credentials; skopeo's temporary files in
    /// `dir`.
    pub fn push(&self, dir: &Path, layout: &str, repo: &str) {
        skopeo(
            dir,
            &[
                "copy",
                "--dest-cert-dir",
                &self.certs.display().to_string(),
                "--dest-creds",
                &format!("{USER}:{PASSWORD}"),
                layout,
                &format!("docker://{}", self.reference(repo)),
            ],
        );
    }
}

/// The image, made with umoci in `dir/img` (tag v1): layer 1 a shell and
/// files, layer 2 a file deleted and one added; its layout reference
/// (`oci:DIR/img:v1`).
pub fn make_image(dir: &Path) -> String {
    let umoci = tool("umoci");
    let limit = Duration::from_secs(120);
    let layout = dir.join("img");
    let image = format!("{}:v1", layout.display());
    let bundle = dir.join("bundle");
    run(
        Command::new(&umoci)
            .arg("init")
            .arg("--layout")
            .arg(&layout),
        limit,
    );
    run(Command::new(&umoci).args(["new", "--image", &image]), limit);
    run(
        Command::new(&umoci)
            .args(["unpack", "--image", &image])
            .arg(&bundle),
        limit,
    );
    let r = bundle.join("rootfs");
    for d in ["bin", "etc", "usr/bin", "usr/share/app", "srv"] {
        std::fs::create_dir_all(r.join(d)).unwrap();
    }
    std::fs::copy("/bin/dash", r.join("bin/sh")).unwrap();
    std::fs::write(r.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n").unwrap();
    std::fs::write(r.join("etc/group"), "root:x:0:\n").unwrap();
    std::fs::write(r.join("etc/obsolete"), "old\n").unwrap();
    std::fs::write(r.join("usr/share/app/data.txt"), "data\n").unwrap();
    std::fs::hard_link(
        r.join("usr/share/app/data.txt"),
        r.join("usr/share/app/data-link.txt"),
    )
    .unwrap();
    std::os::unix::fs::symlink("../../bin/sh", r.join("usr/bin/app-sh")).unwrap();
    rustix::fs::setxattr(
        r.join("usr/share/app/data.txt"),
        "user.torpor",
        b"yes",
        rustix::fs::XattrFlags::empty(),
    )
    .unwrap();
    std::os::unix::fs::chown(r.join("srv"), Some(1234), Some(1234)).unwrap();
    let repack = || {
        run(
            Command::new(&umoci)
                .args(["repack", "--refresh-bundle", "--image", &image])
                .arg(&bundle),
            limit,
        )
    };
    repack();
    std::fs::remove_file(r.join("etc/obsolete")).unwrap();
    std::fs::write(r.join("etc/motd"), "hello from layer 2\n").unwrap();
    repack();
    run(
        Command::new(&umoci).args([
            "config",
            "--image",
            &image,
            "--config.cmd=/bin/sh",
            "--config.cmd=-c",
            "--config.cmd=echo hi",
            "--config.env=GREETING=hello",
            "--config.workingdir=/srv",
            "--config.exposedports=8080/tcp",
            "--config.user=1000",
        ]),
        limit,
    );
    format!("oci:{}:v1", layout.display())
}

/// skopeo (any policy) with `args`, its temporary files in `dir`.
pub fn skopeo(dir: &Path, args: &[&str]) {
    run(
        Command::new(tool("skopeo"))
            .arg("--insecure-policy")
            .args(args)
            .env("TMPDIR", dir),
        Duration::from_secs(120),
    );
}

/// `debugfs -R CMD image`'s output (e2fsprogs).
pub fn debugfs(image: &Path, cmd: &str) -> String {
    let out = Command::new("debugfs")
        .args(["-R", cmd])
        .arg(image)
        .output()
        .unwrap();
    assert!(out.status.success(), "debugfs -R {cmd}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}
