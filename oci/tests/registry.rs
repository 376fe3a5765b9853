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

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::Duration;

use common::registry::{debugfs, make_image, skopeo, start_registry, PASSWORD, USER};
use torpor_oci::{
    from_archive, make_template_rootfs, pull, unpack, Credentials, Error, Limits, Progress,
    PullEvent, PullOptions, Reference, TemplateOptions,
};

#[test]
fn an_image_pushed_to_a_loopback_registry_is_pulled_with_credentials_and_made_a_template() {
    let work = tempfile::tempdir().unwrap();
    let dir = work.path();
    let registry = start_registry(dir);
    let port = registry.port;
    let layout = make_image(dir);
    registry.push(dir, &layout, "torpor/app:v1");

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

    // Its progress, as a build's log shows it.
    let events = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = events.clone();
    let options = PullOptions {
        progress: Some(Progress::new(move |e| seen.lock().unwrap().push(e))),
        ..options
    };
    let image = rt
        .block_on(pull(&reference, Some(&creds), &options))
        .unwrap();
    let kinds = |events: &[PullEvent]| -> Vec<String> {
        events
            .iter()
            .map(|e| match e {
                PullEvent::Manifest { layers, .. } => format!("manifest {layers}"),
                PullEvent::LayerStarted { index, .. } => format!("started {index}"),
                PullEvent::LayerDone { index, .. } => format!("done {index}"),
                PullEvent::LayerPresent { index, .. } => format!("present {index}"),
                other => format!("{other:?}"),
            })
            .collect()
    };
    assert_eq!(
        kinds(&std::mem::take(&mut *events.lock().unwrap())),
        ["manifest 2", "started 0", "done 0", "started 1", "done 1"]
    );
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
    assert_eq!(
        kinds(&events.lock().unwrap()),
        ["manifest 2", "present 0", "present 1"]
    );
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
