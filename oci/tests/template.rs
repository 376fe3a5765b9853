//! The template's additions on unpacked images, and the ext4 image they
//! make, read back with e2fsprogs' debugfs (nothing is mounted): init,
//! agent, user with sudo, resolver, hostname; an image with its own init
//! keeps it; an image without /bin/sh is refused; a resolv.conf that is
//! an absolute symlink is replaced, not written through. Also images from
//! archives made here: `docker save` (plain and gzip) and an OCI layout.
//! Needs root and e2fsprogs.

mod common;

use std::path::Path;
use std::process::Command;

use common::{gzip, Scratch, Tar};
use torpor_oci::{
    from_archive, make_template_rootfs, unpack, unpack_layers, Digest, Error, Limits,
    TemplateOptions, TORPOR_INIT,
};

/// `debugfs -R CMD image`'s output.
pub fn debugfs(image: &Path, cmd: &str) -> String {
    let out = Command::new("debugfs")
        .args(["-R", cmd])
        .arg(image)
        .output()
        .expect("debugfs (apt-get install e2fsprogs)");
    assert!(out.status.success(), "debugfs -R {cmd}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A small Debian-like image: a shell, the account files, python3, a
/// resolv.conf pointing at systemd-resolved's stub (absolute).
fn image_layer(with_init: bool) -> Vec<u8> {
    let mut t = Tar::new();
    t.dir("bin/", 0o755)
        .file("bin/dash", b"#!fake dash\n", 0o755)
        .symlink("bin/sh", "dash")
        .file("bin/bash", b"#!fake bash\n", 0o755)
        .dir("etc/", 0o755)
        .file(
            "etc/passwd",
            b"root:x:0:0:root:/root:/bin/bash\nnode:x:1000:1000::/home/node:/bin/sh\n",
            0o644,
        )
        .file("etc/group", b"root:x:0:\nnode:x:1000:\n", 0o644)
        .file_owned(
            "etc/shadow",
            b"root:*:19000:0:99999:7:::\nnode:!:19000:0:99999:7:::\n",
            0o640,
            0,
            42,
        )
        .symlink("etc/resolv.conf", "/run/systemd/resolve/stub-resolv.conf")
        .dir("etc/skel/", 0o755)
        .file("etc/skel/.bashrc", b"# bashrc\n", 0o644)
        .dir("usr/", 0o755)
        .dir("usr/bin/", 0o755)
        .file("usr/bin/python3", b"#!fake\n", 0o755)
        .file("usr/bin/sudo", b"#!fake\n", 0o4755)
        .dir("usr/lib/", 0o755)
        .dir("usr/lib/python3.11/", 0o755)
        .file(
            "usr/lib/python3.11/EXTERNALLY-MANAGED",
            b"[externally-managed]\n",
            0o644,
        )
        .symlink("sbin", "usr/sbin")
        .dir("usr/sbin/", 0o755);
    if with_init {
        t.symlink("usr/sbin/init", "/lib/systemd/systemd");
    }
    t.bytes()
}

#[test]
fn a_template_rootfs_has_init_agent_user_and_resolver() {
    let mut s = Scratch::new();
    let layer = s.layer(&gzip(&image_layer(false)));
    unpack_layers(&[layer], &s.root(), &Limits::default()).unwrap();
    let agent = s.dir.path().join("layer-agent");
    std::fs::write(&agent, b"#!/bin/sh\necho agent\n").unwrap();
    let out = s.dir.path().join("layer-image.ext4");
    let report = make_template_rootfs(&s.root(), &TemplateOptions::new(&agent), &out).unwrap();
    assert_eq!(report.init, "/sbin/init");
    // uid 1000 is node's: the next free one.
    assert_eq!(report.user, ("user".to_string(), 1001, 1001));
    assert!(report.user_added && report.sudo && report.reboot);
    assert!(report.size_bytes >= 64 << 20);
    assert!(
        std::fs::metadata(&out)
            .unwrap()
            .len()
            .abs_diff(report.size_bytes)
            < 4096
    );
    let passwd = debugfs(&out, "cat /etc/passwd");
    assert!(
        passwd.contains("node:x:1000:1000::/home/node:/bin/sh\n"),
        "{passwd}"
    );
    assert!(
        passwd.contains("user:x:1001:1001::/home/user:/bin/bash\n"),
        "{passwd}"
    );
    assert!(debugfs(&out, "cat /etc/group").contains("user:x:1001:\n"));
    assert!(debugfs(&out, "cat /etc/shadow").contains("\nuser:!:"));
    assert_eq!(
        debugfs(&out, "cat /etc/sudoers.d/user"),
        "user ALL=(ALL:ALL) NOPASSWD: ALL\n"
    );
    assert!(debugfs(&out, "stat /etc/sudoers.d/user").contains("Mode:  0440"));
    assert!(debugfs(&out, "stat /home/user").contains("User:  1001"));
    assert_eq!(debugfs(&out, "cat /home/user/.bashrc"), "# bashrc\n");
    // /sbin is a symlink to usr/sbin: init went there.
    let init = debugfs(&out, "cat /usr/sbin/init");
    assert!(init.starts_with("#!/bin/sh\n# torpor guest init"), "{init}");
    assert_eq!(debugfs(&out, &format!("cat {TORPOR_INIT}")), init);
    assert_eq!(
        debugfs(&out, "cat /usr/local/bin/torpor-agent"),
        "#!/bin/sh\necho agent\n"
    );
    assert!(debugfs(&out, "stat /usr/local/bin/torpor-agent").contains("Mode:  0755"));
    assert_eq!(
        debugfs(&out, "cat /etc/resolv.conf"),
        "nameserver 172.16.0.1\noptions timeout:2 attempts:2\n"
    );
    assert_eq!(debugfs(&out, "cat /etc/hostname"), "torpor\n");
    assert!(debugfs(&out, "ls /etc/torpor").contains("init.d"));
    assert!(debugfs(&out, "cat /usr/local/sbin/reboot").contains("reboot(2)"));
    assert!(!debugfs(&out, "ls /usr/lib/python3.11").contains("EXTERNALLY-MANAGED"));
    // The image's stub resolver path was not created through the link.
    assert!(!s.root().join("run").exists());
    s.assert_outside_untouched();
}

#[test]
fn an_image_keeps_its_own_init_and_must_have_a_shell() {
    let mut s = Scratch::new();
    let layer = s.layer(&image_layer(true));
    unpack_layers(&[layer], &s.root(), &Limits::default()).unwrap();
    let agent = s.dir.path().join("layer-agent");
    std::fs::write(&agent, b"agent").unwrap();
    let opts = TemplateOptions {
        size_bytes: Some(32 << 20),
        ..TemplateOptions::new(&agent)
    };
    let out = s.dir.path().join("layer-image.ext4");
    let report = make_template_rootfs(&s.root(), &opts, &out).unwrap();
    assert_eq!(report.init, TORPOR_INIT);
    assert_eq!(
        std::fs::read_link(s.root().join("usr/sbin/init")).unwrap(),
        Path::new("/lib/systemd/systemd")
    );
    assert_eq!(std::fs::metadata(&out).unwrap().len(), 32 << 20);

    let mut s = Scratch::new();
    let mut t = Tar::new();
    t.file("app", b"static binary", 0o755);
    let layer = s.layer(&t.bytes());
    unpack_layers(&[layer], &s.root(), &Limits::default()).unwrap();
    let out = s.dir.path().join("layer-image.ext4");
    let err = make_template_rootfs(&s.root(), &TemplateOptions::new(&agent), &out).unwrap_err();
    assert!(matches!(err, Error::NoShell), "{err}");
    assert!(err.to_string().contains("/bin/sh"), "{err}");
    assert!(!out.exists());
}

fn config_json(diff_ids: &[Digest]) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": ["PATH=/usr/bin", "MODE=test"], "Cmd": ["/bin/sh", "-c", "serve"],
                   "WorkingDir": "/srv", "User": "1000", "ExposedPorts": {"8080/tcp": {}}},
        "rootfs": {"type": "layers", "diff_ids": diff_ids.iter().map(|d| d.to_string()).collect::<Vec<_>>()},
    }))
    .unwrap()
}

fn archive(members: &[(&str, &[u8])]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (name, data) in members {
        let mut h = tar::Header::new_ustar();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_cksum();
        b.append_data(&mut h, name, *data).unwrap();
    }
    b.into_inner().unwrap()
}

fn two_layers() -> (Vec<u8>, Vec<u8>) {
    let mut l1 = Tar::new();
    l1.file("a", b"a1", 0o644).file("b", b"b", 0o644);
    let mut l2 = Tar::new();
    l2.file("a", b"a2", 0o644).file(".wh.b", b"", 0o644);
    (l1.bytes(), l2.bytes())
}

#[test]
fn docker_save_and_oci_layout_archives_give_the_same_image() {
    let s = Scratch::new();
    let (l1, l2) = two_layers();
    let ids = [Digest::of(&l1), Digest::of(&l2)];
    let config = config_json(&ids);
    let config_name = format!("{}.json", Digest::of(&config).hex());
    let manifest = serde_json::to_vec(&serde_json::json!([{
        "Config": config_name, "RepoTags": ["test:v1"], "Layers": ["l1/layer.tar", "l2/layer.tar"]
    }]))
    .unwrap();
    let save = archive(&[
        ("l1/layer.tar", &l1),
        ("l2/layer.tar", &l2),
        (&config_name, &config),
        ("manifest.json", &manifest),
    ]);
    // The OCI layout: gzip layers, the manifest and config as blobs.
    let (g1, g2) = (gzip(&l1), gzip(&l2));
    let desc = |media: &str, bytes: &[u8]| serde_json::json!({"mediaType": media, "digest": Digest::of(bytes).to_string(), "size": bytes.len()});
    let gz = "application/vnd.oci.image.layer.v1.tar+gzip";
    let oci_manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": desc("application/vnd.oci.image.config.v1+json", &config),
        "layers": [desc(gz, &g1), desc(gz, &g2)],
    }))
    .unwrap();
    let mut entry = desc("application/vnd.oci.image.manifest.v1+json", &oci_manifest);
    entry["platform"] = serde_json::json!({"os": "linux", "architecture": "amd64"});
    let index =
        serde_json::to_vec(&serde_json::json!({"schemaVersion": 2, "manifests": [entry]})).unwrap();
    let blob = |b: &[u8]| format!("blobs/sha256/{}", Digest::of(b).hex());
    let layout = archive(&[
        ("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#),
        ("index.json", &index),
        (&blob(&oci_manifest), &oci_manifest),
        (&blob(&config), &config),
        (&blob(&g1), &g1),
        (&blob(&g2), &g2),
    ]);
    for (i, bytes) in [save.clone(), gzip(&save), layout.clone()]
        .iter()
        .enumerate()
    {
        let path = s.dir.path().join(format!("layer-archive{i}.tar"));
        std::fs::write(&path, bytes).unwrap();
        let image = from_archive(&path, &s.dir.path().join(format!("layer-blobs{i}"))).unwrap();
        assert_eq!(image.config().cmd, ["/bin/sh", "-c", "serve"]);
        assert_eq!(image.config().exposed_ports, ["8080/tcp"]);
        assert_eq!(image.config_digest(), &Digest::of(&config));
        assert_eq!(image.layers().len(), 2);
        let root = s.dir.path().join(format!("layer-root{i}"));
        unpack(&image, &root, &Limits::default()).unwrap();
        assert_eq!(common::read(&root.join("a")), "a2");
        assert!(!root.join("b").exists());
    }
    // A layer blob that is not what its digest says is refused.
    let mut bad = layout;
    let at = bad
        .windows(g2.len())
        .position(|w| w == g2.as_slice())
        .unwrap();
    bad[at + g2.len() / 2] ^= 0xff;
    let path = s.dir.path().join("layer-bad.tar");
    std::fs::write(&path, &bad).unwrap();
    let err = from_archive(&path, &s.dir.path().join("layer-blobs-bad")).unwrap_err();
    assert!(matches!(err, Error::Digest { .. }), "{err}");
}
