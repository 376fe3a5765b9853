//! A registry pull end to end, on loopback only: Debian's
//! `docker-registry` (distribution 2.8) on 127.0.0.1 with TLS (a CA and
//! certificate made here with rcgen) and htpasswd basic auth; an image
//! made with umoci (two layers: the second deletes a file, a whiteout)
//! and pushed with skopeo; then `pull` with the credentials and the CA,
//! `unpack`, `make_template_rootfs`, and the ext4 image read back with
//! debugfs. A wrong password, no credentials and no CA each fail with
//! their own error. skopeo also writes the image as `docker save` and
//! OCI archives, which `from_archive` reads into the same image.
//!
//! The registry is killed when the test ends (its guard's drop), every
//! command has a time limit, and the pull one of its own. Without
//! docker-registry, umoci or skopeo the test fails saying so;
//! `scripts/test` leaves it out then (tests/needs), and `scripts/setup
//! test` installs them. Needs root (umoci unpacks as root, ownership).

mod common;

use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use torpor_oci::{
    from_archive, make_template_rootfs, pull, unpack, Credentials, Error, Limits, PullOptions,
    Reference, TemplateOptions,
};

const USER: &str = "tester";
const PASSWORD: &str = "s3cret-pass";
/// bcrypt (cost 4: the registry checks it on every request) of PASSWORD,
/// the only hash distribution's htpasswd takes.
const HTPASSWD: &str = "tester:$2b$04$0S0KeQ7q1MsTn3mZbIx.zeSGkGxluDD6.83IRggakU8JFazBvZRry\n";

/// Runs a command, at most `limit`; its stdout, or a panic with its output.
fn run(cmd: &mut Command, limit: Duration) -> String {
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

fn tool(name: &str) -> PathBuf {
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

/// The registry process, killed when dropped.
struct Registry {
    child: Child,
    log: PathBuf,
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

fn start_registry(dir: &Path) -> (Registry, u16) {
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
    let registry = Registry { child, log };
    let start = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the registry did not listen"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    (registry, port)
}

/// The image, made with umoci in `dir/img` (tag v1): layer 1 a shell and
/// files, layer 2 a file deleted and one added.
fn make_image(dir: &Path) {
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
}

fn skopeo(dir: &Path, args: &[&str]) {
    run(
        Command::new(tool("skopeo"))
            .arg("--insecure-policy")
            .args(args)
            .env("TMPDIR", dir),
        Duration::from_secs(120),
    );
}

fn debugfs(image: &Path, cmd: &str) -> String {
    let out = Command::new("debugfs")
        .args(["-R", cmd])
        .arg(image)
        .output()
        .unwrap();
    assert!(out.status.success(), "debugfs -R {cmd}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn an_image_pushed_to_a_loopback_registry_is_pulled_with_credentials_and_made_a_template() {
    let work = tempfile::tempdir().unwrap();
    let dir = work.path();
    let (registry, port) = start_registry(dir);
    make_image(dir);
    let target = format!("docker://127.0.0.1:{port}/torpor/app:v1");
    let layout = format!("oci:{}:v1", dir.join("img").display());
    skopeo(
        dir,
        &[
            "copy",
            "--dest-cert-dir",
            &dir.join("certs").display().to_string(),
            "--dest-creds",
            &format!("{USER}:{PASSWORD}"),
            &layout,
            &target,
        ],
    );

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let reference: Reference = format!("127.0.0.1:{port}/torpor/app:v1").parse().unwrap();
    let mut options = PullOptions::new(dir.join("blobs"));
    options.extra_ca_pem = Some(std::fs::read(dir.join("certs/ca.crt")).unwrap());
    options.timeout = Duration::from_secs(60);
    let creds = Credentials {
        username: USER.into(),
        password: PASSWORD.into(),
    };
    let wrong = Credentials {
        password: "wrong".into(),
        ..creds.clone()
    };
    let err = rt
        .block_on(pull(&reference, Some(&wrong), &options))
        .unwrap_err();
    assert!(matches!(err, Error::Auth { .. }), "{err}");
    eprintln!("refused as it should be: {err}");
    let err = rt.block_on(pull(&reference, None, &options)).unwrap_err();
    assert!(matches!(err, Error::Auth { .. }), "{err}");
    eprintln!("refused as it should be: {err}");
    let no_ca = PullOptions {
        extra_ca_pem: None,
        ..options.clone()
    };
    let err = rt
        .block_on(pull(&reference, Some(&creds), &no_ca))
        .unwrap_err();
    assert!(matches!(err, Error::Registry { .. }), "{err}");
    assert!(err.to_string().contains("UnknownIssuer"), "{err}");
    eprintln!("refused as it should be: {err}");

    let image = rt
        .block_on(pull(&reference, Some(&creds), &options))
        .unwrap();
    let config = image.config();
    assert_eq!(config.command(), ["/bin/sh", "-c", "echo hi"]);
    assert!(
        config.env.contains(&"GREETING=hello".to_string()),
        "{:?}",
        config.env
    );
    assert_eq!(config.working_dir.as_deref(), Some("/srv"));
    assert_eq!(config.user.as_deref(), Some("1000"));
    assert_eq!(config.exposed_ports, ["8080/tcp"]);
    assert_eq!(image.layers().len(), 2);
    // Pulled again, the layers are already there (and still checked).
    let again = rt
        .block_on(pull(&reference, Some(&creds), &options))
        .unwrap();
    assert_eq!(again.layers(), image.layers());
    drop(registry);

    let root = dir.join("root");
    let report = unpack(&image, &root, &Limits::default()).unwrap();
    assert!(report.entries > 10, "{report:?}");
    assert_eq!(common::read(&root.join("usr/share/app/data.txt")), "data\n");
    assert_eq!(
        std::fs::metadata(root.join("usr/share/app/data.txt"))
            .unwrap()
            .ino(),
        std::fs::metadata(root.join("usr/share/app/data-link.txt"))
            .unwrap()
            .ino()
    );
    assert_eq!(
        std::fs::read_link(root.join("usr/bin/app-sh")).unwrap(),
        Path::new("../../bin/sh")
    );
    assert_eq!(std::fs::metadata(root.join("srv")).unwrap().uid(), 1234);
    let mut value = [0u8; 8];
    let n = rustix::fs::getxattr(
        root.join("usr/share/app/data.txt"),
        "user.torpor",
        &mut value,
    )
    .unwrap();
    assert_eq!(&value[..n], b"yes");
    assert!(!root.join("etc/obsolete").exists());
    assert_eq!(common::read(&root.join("etc/motd")), "hello from layer 2\n");

    let agent = dir.join("torpor-agent");
    std::fs::write(&agent, "#!/bin/sh\nexec sleep infinity\n").unwrap();
    let ext4 = dir.join("template.ext4");
    let report = make_template_rootfs(&root, &TemplateOptions::new(&agent), &ext4).unwrap();
    assert_eq!(report.init, "/sbin/init");
    assert_eq!(report.user, ("user".to_string(), 1000, 1000));
    assert!(!report.sudo, "the image has no sudo binary");
    let passwd = debugfs(&ext4, "cat /etc/passwd");
    assert_eq!(
        passwd,
        "root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n"
    );
    assert!(debugfs(&ext4, "cat /sbin/init").starts_with("#!/bin/sh\n"));
    assert_eq!(
        debugfs(&ext4, "cat /usr/local/bin/torpor-agent"),
        "#!/bin/sh\nexec sleep infinity\n"
    );
    assert!(debugfs(&ext4, "ls -l /etc/sudoers.d").contains("user"));
    assert!(debugfs(&ext4, "ls /etc/torpor").contains("init.d"));
    let app = debugfs(&ext4, "ls /usr/share/app");
    assert!(
        app.contains("data.txt") && app.contains("data-link.txt"),
        "{app}"
    );
    assert!(!debugfs(&ext4, "ls /etc").contains("obsolete"));

    // The same image as archives a client could upload.
    for (kind, name) in [
        ("docker-archive", "save.tar"),
        ("oci-archive", "layout.tar"),
    ] {
        let path = dir.join(name);
        skopeo(
            dir,
            &[
                "copy",
                &layout,
                &format!("{kind}:{}:torpor/app:v1", path.display()),
            ],
        );
        let from = from_archive(&path, &dir.join(format!("{name}.blobs"))).unwrap();
        assert_eq!(from.config().diff_ids, config.diff_ids, "{kind}");
        assert_eq!(from.config().command(), config.command(), "{kind}");
        let root = dir.join(format!("{name}.root"));
        unpack(&from, &root, &Limits::default()).unwrap();
        assert_eq!(common::read(&root.join("etc/motd")), "hello from layer 2\n");
        assert!(!root.join("etc/obsolete").exists());
    }
}
