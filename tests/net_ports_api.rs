//! Sandbox networking through the HTTP API, in process over real probe
//! VMMs, the service's "host" namespace one the test creates: a policy at
//! create and its change at run time (tenant-scoped: another tenant's id
//! is 404), exposed ports listed on the sandbox, and a connection to the
//! exposed port of a hibernated sandbox waking it (auto-resume on
//! traffic). The probe has no network device, so the woken sandbox's
//! connection is closed after the wake: what is shown is the wake; the
//! forwarding itself is shown in `net_policy.rs`. Needs root, nft and
//! /dev/net/tun (tests/needs).

mod common;

use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use common::http::{request, request_with, HttpResponse, InProcessApi};
use common::netns::Ns;
use common::serve::DataDir;
use serde_json::{json, Value};
use torpor_scheduler::net::{EgressPolicy, NetConfig};
use torpor_scheduler::service::{SandboxNetworking, Service, ServiceConfig, PROBE_TEMPLATE};

const ADMIN: &str = "net-admin-token-0123456789";

struct Api {
    addr: String,
}

impl Api {
    /// An E2B route with the key in `X-API-KEY`.
    fn e2b(&self, key: &str, method: &str, path: &str, body: Value) -> HttpResponse {
        let body = (!body.is_null()).then(|| body.to_string());
        request_with(
            &self.addr,
            method,
            path,
            &[("X-API-KEY", key)],
            body.as_deref(),
        )
    }

    fn call(&self, token: &str, method: &str, path: &str, body: Value) -> HttpResponse {
        let body = (!body.is_null()).then(|| body.to_string());
        request(&self.addr, method, path, Some(token), body.as_deref())
    }
}

#[test]
fn policies_and_exposed_ports_through_the_api_wake_on_traffic() {
    let mut pod = Pod::start("tna", "10.205.0.0/24", EgressPolicy::default());
    let (alice, bob) = (pod.tenant("alice"), pod.tenant("bob"));

    // A policy at create: what is left out is the pod default's.
    let r = pod.api.call(
        &alice,
        "POST",
        "/v1/sandboxes",
        json!({"template": PROBE_TEMPLATE, "network": {"allow_out": ["PyPI.org"]}}),
    );
    assert_eq!(r.status, 201, "{}", r.body);
    let id = r.json()["id"].as_str().unwrap().to_string();
    let path = format!("/v1/sandboxes/{id}");
    assert_eq!(
        r.json()["network"]["policy"],
        json!({"allow_internet": true, "allow_out": ["pypi.org"], "deny_out": []})
    );
    for bad in [
        json!({"allow_out": ["not a name!"]}),
        json!({}),
        json!({"nope": 1}),
    ] {
        let r = pod
            .api
            .call(&alice, "PATCH", &format!("{path}/network"), bad.clone());
        assert_eq!(r.status, 400, "{bad}: {}", r.body);
    }
    let r = pod.api.call(
        &alice,
        "PATCH",
        &format!("{path}/network"),
        json!({"allow_internet": false, "deny_out": ["10.0.0.0/8"]}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        r.json()["network"]["policy"],
        json!({"allow_internet": false, "allow_out": ["pypi.org"], "deny_out": ["10.0.0.0/8"]})
    );

    // Another tenant's sandbox is not there.
    for (method, sub, body) in [
        ("PATCH", "/network", json!({"allow_internet": true})),
        ("GET", "/ports", Value::Null),
        ("POST", "/ports", json!({"guest_port": 80})),
        ("DELETE", "/ports/80", Value::Null),
    ] {
        let r = pod.api.call(&bob, method, &format!("{path}{sub}"), body);
        assert_eq!(r.status, 404, "{method} {sub} as bob: {}", r.body);
    }

    // Expose a port: listed on the sandbox.
    let r = pod.api.call(
        &alice,
        "POST",
        &format!("{path}/ports"),
        json!({"guest_port": 8080}),
    );
    assert_eq!(r.status, 201, "{}", r.body);
    let address: SocketAddr = r.json()["address"].as_str().unwrap().parse().unwrap();
    assert!(address.ip().is_loopback());
    let r = pod.api.call(
        &alice,
        "POST",
        &format!("{path}/ports"),
        json!({"guest_port": 8080}),
    );
    assert_eq!(r.status, 409, "{}", r.body);
    let r = pod.api.call(
        &alice,
        "POST",
        &format!("{path}/ports"),
        json!({"guest_port": 0}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    let r = pod
        .api
        .call(&alice, "GET", &format!("{path}/ports"), Value::Null);
    assert_eq!(
        r.json()["ports"],
        json!([{"guest_port": 8080, "address": address.to_string()}])
    );
    let r = pod.api.call(&alice, "GET", &path, Value::Null);
    assert_eq!(r.json()["network"]["ports"][0]["guest_port"], 8080);

    // Hibernate it; a connection to its port wakes it.
    let r = pod
        .api
        .call(&alice, "POST", &format!("{path}/hibernate"), Value::Null);
    assert_eq!(r.status, 200, "{}", r.body);
    let r = pod.api.call(&alice, "GET", &path, Value::Null);
    assert_eq!(r.json()["state"], "hibernated", "{}", r.body);
    let mut c = pod
        .host
        .enter(|| TcpStream::connect_timeout(&address, Duration::from_secs(5)).unwrap());
    c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    // The probe has no network device: after the wake the proxy closes.
    let _ = c.read_to_end(&mut Vec::new());
    let r = pod.api.call(&alice, "GET", &path, Value::Null);
    assert_eq!(r.json()["state"], "running", "woken by traffic: {}", r.body);

    // Removed: no longer listed, no longer listening.
    let r = pod
        .api
        .call(&alice, "DELETE", &format!("{path}/ports/8080"), Value::Null);
    assert_eq!(r.status, 204, "{}", r.body);
    let r = pod
        .api
        .call(&alice, "DELETE", &format!("{path}/ports/8080"), Value::Null);
    assert_eq!(r.status, 404, "{}", r.body);
    assert!(pod
        .host
        .enter(|| TcpStream::connect_timeout(&address, Duration::from_secs(2)))
        .is_err());
    // And with the sandbox.
    let r = pod.api.call(
        &alice,
        "POST",
        &format!("{path}/ports"),
        json!({"guest_port": 9090}),
    );
    assert_eq!(r.status, 201, "{}", r.body);
    let again: SocketAddr = r.json()["address"].as_str().unwrap().parse().unwrap();

    // A restarted service listens again on the stored port, and the
    // policy is still the sandbox's.
    pod.restart();
    let r = pod
        .api
        .call(&alice, "GET", &format!("{path}/ports"), Value::Null);
    assert_eq!(
        r.json()["ports"],
        json!([{"guest_port": 9090, "address": again.to_string()}])
    );
    let r = pod.api.call(&alice, "GET", &path, Value::Null);
    assert_eq!(
        r.json()["network"]["policy"]["deny_out"],
        json!(["10.0.0.0/8"])
    );
    assert!(pod
        .host
        .enter(|| TcpStream::connect_timeout(&again, Duration::from_secs(5)))
        .is_ok());

    let r = pod.api.call(&alice, "DELETE", &path, Value::Null);
    assert_eq!(r.status, 204, "{}", r.body);
    assert!(pod
        .host
        .enter(|| TcpStream::connect_timeout(&again, Duration::from_secs(2)))
        .is_err());

    e2b_network(&pod.api, &alice, &bob);
}

/// Attack 10 of issue 24: a connection to an exposed port wakes a
/// hibernated sandbox only as its tenant's quota admits (the gate's
/// `WakeGate`, as a resume through the API): at its running-sandboxes
/// quota the connection is closed and the sandbox stays hibernated; with
/// room again, the same traffic wakes it.
#[test]
fn port_traffic_wakes_only_within_the_tenants_quota() {
    let pod = Pod::start("tnq", "10.208.0.0/24", EgressPolicy::default());
    let alice = pod.tenant("alice");
    let r = pod.api.call(
        ADMIN,
        "PUT",
        "/v1/tenants/alice/quota",
        json!({"running_sandboxes": 1}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let create = || {
        let r = pod.api.call(
            &alice,
            "POST",
            "/v1/sandboxes",
            json!({ "template": PROBE_TEMPLATE }),
        );
        assert_eq!(r.status, 201, "{}", r.body);
        r.json()["id"].as_str().unwrap().to_string()
    };
    let sleeper = create();
    let path = format!("/v1/sandboxes/{sleeper}");
    let r = pod.api.call(
        &alice,
        "POST",
        &format!("{path}/ports"),
        json!({"guest_port": 8080}),
    );
    assert_eq!(r.status, 201, "{}", r.body);
    let address: SocketAddr = r.json()["address"].as_str().unwrap().parse().unwrap();
    let r = pod
        .api
        .call(&alice, "POST", &format!("{path}/hibernate"), Value::Null);
    assert_eq!(r.status, 200, "{}", r.body);
    let busy = create(); // alice is at her quota now
    let knock = || {
        let mut c = pod
            .host
            .enter(|| TcpStream::connect_timeout(&address, Duration::from_secs(5)).unwrap());
        c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let _ = c.read_to_end(&mut Vec::new());
    };
    knock();
    let r = pod.api.call(&alice, "GET", &path, Value::Null);
    assert_eq!(
        r.json()["state"],
        "hibernated",
        "woken past the quota: {}",
        r.body
    );
    // A resume through the API is refused the same way.
    let r = pod
        .api
        .call(&alice, "POST", &format!("{path}/resume"), Value::Null);
    assert_eq!(r.status, 429, "{}", r.body);

    let r = pod.api.call(
        &alice,
        "DELETE",
        &format!("/v1/sandboxes/{busy}"),
        Value::Null,
    );
    assert_eq!(r.status, 204, "{}", r.body);
    knock();
    let r = pod.api.call(&alice, "GET", &path, Value::Null);
    assert_eq!(
        r.json()["state"],
        "running",
        "woken within the quota: {}",
        r.body
    );
}

/// The service and its API in process, networked in a "host" namespace
/// of the test's own, `egress` the operator's pod policy; closed on drop.
struct Pod {
    api: Api,
    /// `None` only while restarting.
    service: Option<Arc<Service>>,
    server: Option<InProcessApi>,
    config: ServiceConfig,
    api_config: torpor_api::ApiConfig,
    _data: DataDir,
    host: Ns,
}

impl Pod {
    fn start(name: &str, pool: &str, egress: EgressPolicy) -> Pod {
        // SAFETY: geteuid has no preconditions.
        assert!(unsafe { libc::geteuid() } == 0, "needs root");
        let tag = format!("{:x}", std::process::id() & 0xffff);
        let host = Ns::new(format!("{name}-host-{tag}"));
        host.ip(&["link", "set", "lo", "up"]);
        let data = DataDir::new(&format!("net-api-{name}"));
        let mut config = ServiceConfig::new(
            data.0.clone(),
            PathBuf::from(env!("CARGO_BIN_EXE_torpor-vmm")),
        );
        config.policy_interval_ms = 0;
        config.net = Some(SandboxNetworking {
            names: NetConfig {
                netns_prefix: format!("{name}-{tag}-"),
                veth_prefix: format!("{}{tag}v", &name[2..3]),
                table: format!("torpor_{name}"),
                host_netns: Some(host.0.clone()),
                pool: pool.parse().unwrap(),
                dns_port: None,
                host_allow: Vec::new(),
            },
            egress,
            ..SandboxNetworking::default()
        });
        let service = Service::open(config.clone()).expect("open the service");
        let api_config = torpor_api::ApiConfig {
            tokens: vec![ADMIN.into()],
            tenants_file: Some(data.0.join("tokens.json")),
            ..Default::default()
        };
        let server = InProcessApi::start(service.clone(), api_config.clone());
        Pod {
            api: Api {
                addr: server.addr.clone(),
            },
            service: Some(service),
            server: Some(server),
            config,
            api_config,
            _data: data,
            host,
        }
    }

    /// Stops the API and the service, and opens both again.
    fn restart(&mut self) {
        drop(self.server.take());
        if let Some(old) = self.service.take() {
            old.close();
        }
        let service = Service::open(self.config.clone()).expect("open the service again");
        let server = InProcessApi::start(service.clone(), self.api_config.clone());
        self.api.addr = server.addr.clone();
        self.service = Some(service);
        self.server = Some(server);
    }

    fn tenant(&self, name: &str) -> String {
        let r = self
            .api
            .call(ADMIN, "POST", "/v1/tokens", json!({ "tenant": name }));
        assert_eq!(r.status, 201, "{}", r.body);
        r.json()["token"].as_str().unwrap().to_string()
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        drop(self.server.take());
        if let Some(service) = self.service.take() {
            service.close();
        }
    }
}

/// Attack 8 of issue 24: the operator's pod policy (`serve --no-internet
/// --allow-out .. --deny-out ..`) is a ceiling. A tenant's create, PATCH
/// and E2B PUT that ask for internet, for more networks and for no denies
/// get the intersection: internet stays off, the operator's denies stay,
/// `allow_out` only narrows.
#[test]
fn a_tenants_policy_cannot_widen_the_operators_through_the_api() {
    let ceiling: EgressPolicy = serde_json::from_value(json!({
        "allow_internet": false,
        "allow_out": ["10.1.0.0/16", "pypi.org"],
        "deny_out": ["10.1.9.0/24"],
    }))
    .unwrap();
    let pod = Pod::start("tnw", "10.207.0.0/24", ceiling.clone());
    let alice = pod.tenant("alice");
    let widest = json!({"allow_internet": true, "allow_out": ["0.0.0.0/0", "evil.example"],
                        "deny_out": []});
    let ceiling_json = serde_json::to_value(&ceiling).unwrap();

    // At create.
    let r = pod.api.call(
        &alice,
        "POST",
        "/v1/sandboxes",
        json!({"template": PROBE_TEMPLATE, "network": widest}),
    );
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(r.json()["network"]["policy"], ceiling_json, "{}", r.body);
    let id = r.json()["id"].as_str().unwrap().to_string();
    let path = format!("/v1/sandboxes/{id}");

    // Narrowing works: internet is off already; fewer allowed, more denied.
    let r = pod.api.call(
        &alice,
        "PATCH",
        &format!("{path}/network"),
        json!({"allow_out": ["10.1.2.0/24"], "deny_out": ["10.1.2.3"]}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        r.json()["network"]["policy"],
        json!({"allow_internet": false, "allow_out": ["10.1.2.0/24"],
               "deny_out": ["10.1.9.0/24", "10.1.2.3/32"]})
    );
    // Widening at run time does not.
    for patch in [
        widest.clone(),
        json!({"allow_internet": true}),
        json!({"deny_out": []}),
        json!({"allow_out": ["0.0.0.0/0", "pypi.org", "files.pypi.org"]}),
    ] {
        let r = pod
            .api
            .call(&alice, "PATCH", &format!("{path}/network"), patch.clone());
        assert_eq!(r.status, 200, "{patch}: {}", r.body);
        let policy = &r.json()["network"]["policy"];
        assert_eq!(policy["allow_internet"], json!(false), "{patch}: {policy}");
        assert!(
            policy["deny_out"]
                .as_array()
                .unwrap()
                .contains(&json!("10.1.9.0/24")),
            "{patch}: {policy}"
        );
        for entry in policy["allow_out"].as_array().unwrap() {
            let entry = entry.as_str().unwrap();
            assert!(
                ["10.1.0.0/16", "10.1.2.0/24", "pypi.org", "files.pypi.org"].contains(&entry),
                "{patch}: {entry} is wider than the pod allows"
            );
        }
    }
    // Stored so: what a wake builds its rules from.
    let r = pod.api.call(&alice, "GET", &path, Value::Null);
    assert_eq!(
        r.json()["network"]["policy"]["allow_internet"],
        json!(false)
    );

    // E2B's update replaces the whole policy: still within the ceiling.
    let r = pod.api.e2b(
        &alice,
        "PUT",
        &format!("/sandboxes/{id}/network"),
        json!({"allow_internet_access": true}),
    );
    assert_eq!(r.status, 204, "{}", r.body);
    let r = pod.api.call(&alice, "GET", &path, Value::Null);
    assert_eq!(r.json()["network"]["policy"], ceiling_json, "{}", r.body);
}

/// E2B's egress settings land in the sandbox's policy with E2B's meaning
/// (allowed entries take precedence): at create (`network`,
/// `allow_internet_access`) and through `PUT /sandboxes/{id}/network`,
/// which replaces the whole policy; what cannot be kept exactly is 400.
fn e2b_network(api: &Api, alice: &str, bob: &str) {
    let r = api.e2b(
        alice,
        "POST",
        "/v2/sandboxes",
        json!({"templateID": PROBE_TEMPLATE, "timeout": 600,
               "network": {"denyOut": ["0.0.0.0/0"], "allowOut": ["192.0.2.7", "PyPI.org"]}}),
    );
    assert_eq!(r.status, 201, "{}", r.body);
    let id = r.json()["sandboxID"].as_str().unwrap().to_string();
    let policy = |api: &Api| {
        let r = api.call(alice, "GET", &format!("/v1/sandboxes/{id}"), Value::Null);
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["network"]["policy"].clone()
    };
    assert_eq!(
        policy(api),
        json!({"allow_internet": false, "allow_out": ["192.0.2.7/32", "pypi.org"], "deny_out": []})
    );
    // A partial deny list with an allowed hole: the hole is cut out of it.
    let path = format!("/sandboxes/{id}/network");
    let r = api.e2b(
        alice,
        "PUT",
        &path,
        json!({"denyOut": ["10.0.0.0/14"], "allowOut": ["10.1.0.0/16"]}),
    );
    assert_eq!(r.status, 204, "{}", r.body);
    assert_eq!(
        policy(api),
        json!({"allow_internet": true, "allow_out": ["10.1.0.0/16"],
               "deny_out": ["10.0.0.0/16", "10.2.0.0/15"]})
    );
    // What is left out is cleared; allow_internet_access false denies all.
    let r = api.e2b(alice, "PUT", &path, json!({"allow_internet_access": false}));
    assert_eq!(r.status, 204, "{}", r.body);
    assert_eq!(
        policy(api),
        json!({"allow_internet": false, "allow_out": [], "deny_out": []})
    );
    for bad in [
        json!({"denyOut": ["example.com"]}),
        json!({"denyOut": ["10.0.0.0/8"], "allowOut": ["pypi.org"]}),
        json!({"egressProxy": {"address": "socks5://127.0.0.1:1080"}}),
        json!({"allowOut": ["not a host!"]}),
    ] {
        let r = api.e2b(alice, "PUT", &path, bad.clone());
        assert_eq!(r.status, 400, "{bad}: {}", r.body);
        assert_eq!(r.json()["code"], 400, "{}", r.body);
    }
    // The policy is unchanged by the refusals; another tenant's key is 404.
    assert_eq!(policy(api)["allow_internet"], json!(false));
    let r = api.e2b(bob, "PUT", &path, json!({}));
    assert_eq!(r.status, 404, "{}", r.body);
    let r = api.e2b(alice, "DELETE", &format!("/sandboxes/{id}"), Value::Null);
    assert_eq!(r.status, 204, "{}", r.body);
}
