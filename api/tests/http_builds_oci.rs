//! Template builds FROM an OCI image through `/v1`, over the fake backend
//! (images installed as files, Linux templates made without booting):
//! Debian's `docker-registry` on loopback with TLS and htpasswd (torpor-
//! oci's registry test's, `oci/tests/common/registry.rs`), an image made
//! with umoci and pushed with skopeo. A build FROM it pulls it with the
//! credentials, unpacks it, makes its ext4 (read back with debugfs: the
//! agent, init, user), installs it as the tenant's image and creates a
//! template from it, which the build's steps run on (a registry on
//! loopback the operator did not name is refused); a wrong password
//! fails the build at step `base` naming authentication; a rebuild asks
//! no registry; `docker save` and OCI archives (skopeo's) uploaded build
//! too; an archive with a `../` entry fails naming the entry, nothing
//! written outside the build's directory. Needs root, docker-registry,
//! umoci, skopeo and e2fsprogs (tests/needs).

mod common;
#[path = "../../oci/tests/common/registry.rs"]
mod registry;
#[path = "../../oci/tests/common/tarball.rs"]
mod tarball;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{tenants_file, Reply, Server};
use registry::{debugfs, make_image, skopeo, start_registry, PASSWORD, USER};
use serde_json::{json, Value};
use torpor_api::ApiConfig;
use torpor_scheduler::model::{TemplateKind, TemplateState};

const ACME: &str = "acme-token-0123456789";
const OTHER: &str = "other-token-0123456789";
const AGENT: &str = "#!/bin/sh\n# the test's agent\nexec sleep infinity\n";
const KERNEL: &str = "not a kernel: the fake backend boots nothing\n";

async fn call(
    server: &Server,
    token: &str,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
) -> Reply {
    let headers = [
        ("Authorization", format!("Bearer {token}")),
        ("Content-Type", "application/json".to_string()),
    ];
    server.request(method, path, &headers, body).await
}

/// Starts a build of `body`; its record once it has finished.
async fn build(server: &Server, token: &str, body: Value) -> Value {
    let r = call(
        server,
        token,
        "POST",
        "/v1/builds",
        Some(body.to_string().as_bytes()),
    )
    .await;
    assert_eq!(r.status, 202, "{}", r.text());
    let id = r.json()["id"].as_str().unwrap().to_string();
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let r = call(server, token, "GET", &format!("/v1/builds/{id}"), None).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        if ["ready", "error", "cancelled"].contains(&v["status"].as_str().unwrap()) {
            return v;
        }
        assert!(Instant::now() < deadline, "build {id} still {v}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn logs(v: &Value) -> String {
    v["logs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["message"].as_str().unwrap().to_string())
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every file under `dir`.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries {
        let path = e.unwrap().path();
        if path.is_dir() && !path.is_symlink() {
            out.extend(files_under(&path));
        } else {
            out.push(path);
        }
    }
    out
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Uploads `bytes` as `token`'s build files; their hash.
async fn upload(server: &Server, token: &str, bytes: &[u8]) -> String {
    let hash = sha256_hex(bytes);
    let headers = [
        ("Authorization", format!("Bearer {token}")),
        ("Content-Type", "application/x-tar".to_string()),
    ];
    let r = server
        .request(
            "PUT",
            &format!("/v1/build-files/{hash}"),
            &headers,
            Some(bytes),
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    hash
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn builds_from_oci_images_pull_unpack_install_and_cache_per_tenant() {
    let work = tempfile::tempdir().unwrap();
    let dir = work.path().to_path_buf();
    let (registry, layout) = tokio::task::block_in_place(|| {
        let registry = start_registry(&dir.join("registry"));
        let layout = make_image(&dir);
        registry.push(&dir, &layout, "torpor/app:v1");
        (registry, layout)
    });
    let reference = registry.reference("torpor/app:v1");
    std::fs::write(dir.join("vmlinux"), KERNEL).unwrap();
    std::fs::write(dir.join("torpor-agent"), AGENT).unwrap();
    let builds_dir = dir.join("builds");
    let server = Server::start_with(ApiConfig {
        tenants_file: Some(tenants_file(&dir, &[("acme", ACME), ("other", OTHER)])),
        builds_dir: Some(builds_dir.clone()),
        guest_kernel: Some(dir.join("vmlinux")),
        guest_agent: Some(dir.join("torpor-agent")),
        registry_ca: Some(registry.certs.join("ca.crt")),
        private_registries: vec![format!("127.0.0.1:{}", registry.port)],
        image_headroom_mib: 8,
        ..Server::config()
    })
    .await;
    let spec = |password: &str, skip_cache: bool| {
        json!({
            "name": "app",
            "from": {"type": "image", "reference": reference, "username": USER, "password": password},
            "steps": [{"type": "env", "vars": {"STAGE": "built"}}],
            "skip_cache": skip_cache,
        })
    };

    // A wrong password: the build fails at `base`, naming authentication.
    let refused = build(&server, ACME, spec("not-the-password", false)).await;
    assert_eq!(refused["status"], "error", "{refused}");
    let f = &refused["failure"];
    assert_eq!(f["instruction"], "base", "{refused}");
    assert!(f["step"].is_null(), "{refused}");
    let message = f["message"].as_str().unwrap();
    assert!(message.contains("authentication"), "{message}");
    assert!(message.contains(&reference), "{message}");
    assert!(server.fake.state.lock().unwrap().installs.is_empty());

    // The same registry by a name the operator did not allow: it
    // resolves to loopback, which no tenant may make the server reach.
    let by_name = reference.replace("127.0.0.1:", "localhost:");
    let mut private = spec(PASSWORD, false);
    private["from"]["reference"] = json!(by_name);
    let refused = build(&server, ACME, private).await;
    assert_eq!(refused["status"], "error", "{refused}");
    let message = refused["failure"]["message"].as_str().unwrap();
    assert!(message.contains("not a global address"), "{message}");
    assert!(message.contains("localhost:"), "{message}");
    assert!(server.fake.state.lock().unwrap().installs.is_empty());

    // The right one: pulled, unpacked, made, installed, booted.
    let first = build(&server, ACME, spec(PASSWORD, false)).await;
    let log = logs(&first);
    assert_eq!(first["status"], "ready", "{first}\n{log}");
    for says in [
        &format!("[base] FROM {reference}"),
        "pulling layer 1/2",
        "pulled layer 2/2",
        "unpacked",
        "making the ext4 image",
        "installed image oci-",
        "booting it once",
        "building template app from tpl_",
    ] {
        assert!(log.contains(says), "{says:?} not in\n{log}");
    }
    let (image, image_template) = {
        let st = server.fake.state.lock().unwrap();
        assert_eq!(st.installs.len(), 2, "{:?}", st.installs);
        let image = st.installs[0].0.clone();
        assert!(image.starts_with("oci-") && image.len() == 20, "{image}");
        let files: Vec<&str> = st.installs.iter().map(|(_, f)| *f).collect();
        assert_eq!(files, ["vmlinux", "rootfs.ext4"]);
        let req = &st.linux_creates[0];
        assert_eq!(req.image.as_deref(), Some(image.as_str()));
        assert!(req.name.starts_with("build-layer-oci-"), "{}", req.name);
        assert_eq!((req.mem_mib, req.vcpus), (512, 1), "the default shape");
        assert_eq!(
            req.cmdline, None,
            "the image has no init: torpor's is /sbin/init"
        );
        let t = st.templates.values().find(|t| t.name == req.name).unwrap();
        assert_eq!(t.tenant.as_deref(), Some("acme"));
        assert_eq!(t.state, TemplateState::Ready);
        assert_eq!(t.kind, TemplateKind::Linux);
        // The build's sandbox ran from it: the template made is its snapshot.
        let app = st
            .templates
            .values()
            .find(|t| t.name == "app" && t.tenant.as_deref() == Some("acme"))
            .unwrap();
        assert_eq!(app.id.as_str(), first["template_id"].as_str().unwrap());
        let sandbox = &st.sandboxes[app.source.as_ref().unwrap()];
        assert_eq!(sandbox.template, t.id);
        (image, t.id.clone())
    };
    // The image, read back: the image's files, whiteout, link, xattr and
    // ownership, and torpor's additions.
    let ext4 = server.fake.images.path().join(&image).join("rootfs.ext4");
    assert_eq!(
        std::fs::read_to_string(server.fake.images.path().join(&image).join("vmlinux")).unwrap(),
        KERNEL
    );
    assert_eq!(debugfs(&ext4, "cat /usr/local/bin/torpor-agent"), AGENT);
    assert!(debugfs(&ext4, "cat /sbin/init").starts_with("#!/bin/sh\n"));
    assert!(debugfs(&ext4, "ls /usr/local/sbin").contains("torpor-init"));
    assert!(debugfs(&ext4, "cat /etc/passwd").contains("user:x:1000:1000::/home/user:/bin/sh"));
    assert!(debugfs(&ext4, "cat /etc/sudoers.d/user").contains("NOPASSWD"));
    assert_eq!(debugfs(&ext4, "cat /etc/motd"), "hello from layer 2\n");
    assert!(
        !debugfs(&ext4, "ls /etc").contains("obsolete"),
        "the whiteout"
    );
    assert!(debugfs(&ext4, "ea_list /usr/share/app/data.txt").contains("user.torpor"));
    assert!(debugfs(&ext4, "stat /srv").contains("User:  1234"));
    let links = debugfs(&ext4, "stat /usr/share/app/data.txt");
    assert!(links.contains("Links: 2"), "the hard link: {links}");
    // Where the steps start: the image's Env and WorkingDir, as `user`;
    // the ENV step's variable over them.
    let env = &first["last_env"];
    assert_eq!(env["user"], "user", "{env}");
    assert_eq!(env["workdir"], "/srv", "{env}");
    assert_eq!(env["env"]["GREETING"], "hello", "{env}");
    assert_eq!(env["env"]["STAGE"], "built", "{env}");
    // The image's template is hidden; another tenant sees neither.
    let r = call(&server, ACME, "GET", "/v1/templates", None).await;
    assert!(!r.text().contains("build-layer"), "{}", r.text());
    let r = call(&server, OTHER, "GET", "/v1/templates/app", None).await;
    assert_eq!(r.status, 404, "{}", r.text());
    let r = call(
        &server,
        OTHER,
        "GET",
        &format!("/v1/templates/{image_template}"),
        None,
    )
    .await;
    assert_eq!(r.status, 404, "{}", r.text());

    // Again: no registry asked, no image made; the template reused.
    let again = build(&server, ACME, spec(PASSWORD, false)).await;
    let log = logs(&again);
    assert_eq!(again["status"], "ready", "{again}\n{log}");
    assert!(log.contains("[base] CACHED"), "{log}");
    assert!(
        !log.contains("manifest") && !log.contains("pulling"),
        "{log}"
    );
    // skip_cache: pulled again, but the same digest is the same template.
    let forced = build(&server, ACME, spec(PASSWORD, true)).await;
    let log = logs(&forced);
    assert_eq!(forced["status"], "ready", "{forced}\n{log}");
    assert!(log.contains("pulled layer 2/2"), "{log}");
    assert!(log.contains("CACHED image sha256:"), "{log}");
    {
        let st = server.fake.state.lock().unwrap();
        assert_eq!(st.installs.len(), 2, "{:?}", st.installs);
        assert_eq!(st.linux_creates.len(), 1);
    }

    // Uploaded archives (skopeo's): `docker save` for the other tenant (its
    // own image), an OCI archive for acme (the same config: its image).
    let archive = |kind: &str, name: &str| {
        let path = dir.join(name);
        tokio::task::block_in_place(|| {
            skopeo(
                &dir,
                &[
                    "copy",
                    &layout,
                    &format!("{kind}:{}:torpor/app:v1", path.display()),
                ],
            )
        });
        std::fs::read(path).unwrap()
    };
    let saved = archive("docker-archive", "save.tar");
    let hash = upload(&server, OTHER, &saved).await;
    let other = build(
        &server,
        OTHER,
        json!({"name": "app", "from": {"type": "upload", "hash": hash}}),
    )
    .await;
    let log = logs(&other);
    assert_eq!(other["status"], "ready", "{other}\n{log}");
    assert!(
        log.contains("reading the uploaded archive") && log.contains("unpacked"),
        "{log}"
    );
    let other_image = {
        let st = server.fake.state.lock().unwrap();
        assert_eq!(st.installs.len(), 4, "{:?}", st.installs);
        st.installs[2].0.clone()
    };
    assert_ne!(other_image, image, "tenants never share image names");
    let other_ext4 = server
        .fake
        .images
        .path()
        .join(&other_image)
        .join("rootfs.ext4");
    assert_eq!(
        debugfs(&other_ext4, "cat /etc/motd"),
        "hello from layer 2\n"
    );
    let oci = archive("oci-archive", "layout.tar");
    let hash = upload(&server, ACME, &oci).await;
    let from_upload = build(
        &server,
        ACME,
        json!({"name": "uploaded", "from": {"type": "upload", "hash": hash}}),
    )
    .await;
    let log = logs(&from_upload);
    assert_eq!(from_upload["status"], "ready", "{from_upload}\n{log}");
    assert!(log.contains("CACHED image sha256:"), "{log}");
    assert_eq!(server.fake.state.lock().unwrap().installs.len(), 4);

    // An archive whose layer has a `../` entry: refused, naming it.
    let mut layer = tarball::Tar::new();
    layer
        .dir("etc/", 0o755)
        .file("../escaped.txt", b"out of the root\n", 0o644);
    let evil = tarball::layout_archive(&[layer.bytes()], json!({"Cmd": ["/bin/sh"]}));
    let hash = upload(&server, ACME, &evil).await;
    let refused = build(
        &server,
        ACME,
        json!({"name": "evil", "from": {"type": "upload", "hash": hash}}),
    )
    .await;
    assert_eq!(refused["status"], "error", "{refused}");
    let f = &refused["failure"];
    assert_eq!(f["instruction"], "base", "{refused}");
    let message = f["message"].as_str().unwrap();
    assert!(
        message.contains("\"../escaped.txt\"") && message.contains("refused"),
        "{message}"
    );
    let everything = files_under(&dir);
    assert!(
        !everything.iter().any(|p| p.ends_with("escaped.txt")),
        "{everything:?}"
    );
    assert!(
        files_under(&builds_dir.join("work")).is_empty(),
        "scratch left"
    );
    assert_eq!(server.fake.state.lock().unwrap().installs.len(), 4);

    // The credentials are nowhere: not in the records, logs or caches.
    for path in files_under(&builds_dir) {
        let bytes = std::fs::read(&path).unwrap();
        assert!(
            !bytes
                .windows(PASSWORD.len())
                .any(|w| w == PASSWORD.as_bytes()),
            "{} holds the password",
            path.display()
        );
    }

    // Bad input is refused at once.
    for (body, status, says) in [
        (
            json!({"name": "x", "from": {"type": "image", "reference": "UPPER/Case"}}),
            422,
            "UPPER/Case",
        ),
        (
            json!({"name": "x", "from": {"type": "upload", "hash": "ab".repeat(32)}}),
            422,
            "never uploaded",
        ),
    ] {
        let r = call(
            &server,
            ACME,
            "POST",
            "/v1/builds",
            Some(body.to_string().as_bytes()),
        )
        .await;
        assert_eq!(r.status, status, "{body}: {}", r.text());
        assert!(r.text().contains(says), "{body}: {}", r.text());
    }
    server.shutdown().await.unwrap();

    // A server given no guest kernel or agent: 501, naming what it lacks.
    let bare = Server::start_with(ApiConfig {
        tenants_file: Some(tenants_file(&dir, &[("acme", ACME)])),
        ..Server::config()
    })
    .await;
    let r = call(
        &bare,
        ACME,
        "POST",
        "/v1/builds",
        Some(spec(PASSWORD, false).to_string().as_bytes()),
    )
    .await;
    let error = r.assert_error(501, "unsupported");
    assert!(
        error["message"].as_str().unwrap().contains("guest kernel"),
        "{error}"
    );
    bare.shutdown().await.unwrap();
    drop(registry);
}
