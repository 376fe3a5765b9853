//! [`Operation`] and [`Reply`] on the wire: each kind as replicas, pods
//! and their journals of earlier builds wrote it.

use serde_json::json;

use super::*;

#[test]
fn lifecycle_operations_keep_their_kind_on_the_wire() {
    for op in Lifecycle::ALL {
        let sent = json!({"kind": op.name(), "sandbox": "sb_1"});
        let operation: Operation = serde_json::from_value(sent.clone()).unwrap();
        assert!(matches!(
            &operation,
            Operation::Lifecycle(LifecycleCall { sandbox, op: o }) if sandbox.as_str() == "sb_1" && *o == op
        ));
        assert_eq!(operation.kind(), op.name());
        assert_eq!(serde_json::to_value(&operation).unwrap(), sent);
    }
    let delete = json!({"kind": "delete", "sandbox": "sb_1"});
    let operation: Operation = serde_json::from_value(delete.clone()).unwrap();
    assert!(matches!(operation, Operation::Delete { .. }));
    assert_eq!(serde_json::to_value(&operation).unwrap(), delete);
    let unknown = json!({"kind": "lifecycle", "sandbox": "sb_1", "op": "pause"});
    assert!(serde_json::from_value::<Operation>(unknown).is_err());
    let extra = json!({"kind": "pause", "sandbox": "sb_1", "op": "pause"});
    assert!(serde_json::from_value::<Operation>(extra).is_err());
    let extra = json!({"kind": "delete", "sandbox": "sb_1", "x": 1});
    assert!(serde_json::from_value::<Operation>(extra).is_err());
}

#[test]
fn a_fork_carries_its_request_and_count() {
    let sent = json!({
        "kind": "fork",
        "sandbox": "sb_1",
        "request": {"count": 3, "metadata": {"k": "v"}, "timeout_ms": 5000},
    });
    let operation: Operation = serde_json::from_value(sent).unwrap();
    assert_eq!(operation.kind(), "fork");
    assert_eq!(operation.sandbox().map(|s| s.as_str()), Some("sb_1"));
    let Operation::Fork { request, .. } = &operation else {
        panic!("{operation:?}");
    };
    assert_eq!(request.count, Some(3));
    assert_eq!(request.timeout_ms, Some(5000));
    assert_eq!(request.metadata["k"], "v");
    let back = serde_json::to_value(&operation).unwrap();
    assert_eq!(back["kind"], "fork");
    assert_eq!(back["request"]["count"], 3);
    // A request field the pod does not know is refused, not dropped.
    let odd = json!({"kind": "fork", "sandbox": "sb_1", "request": {"cnt": 2}});
    assert!(serde_json::from_value::<Operation>(odd).is_err());
    let reply: Reply = serde_json::from_value(json!({"sandboxes": {"sandboxes": []}})).unwrap();
    assert!(matches!(reply, Reply::Sandboxes { sandboxes } if sandboxes.is_empty()));
}

#[test]
fn template_operations_carry_their_request_owner_and_id() {
    let sent = json!({
        "kind": "template_build",
        "request": {"name": "t1", "kind": "probe", "mem_mib": 64, "vcpus": 1, "cmdline": null},
        "tenant": "acme",
        "admin": false,
    });
    let operation: Operation = serde_json::from_value(sent.clone()).unwrap();
    assert_eq!(operation.kind(), "template_build");
    assert!(operation.sandbox().is_none() && operation.template().is_none());
    let Operation::TemplateBuild {
        request, tenant, ..
    } = &operation
    else {
        panic!("{operation:?}");
    };
    assert_eq!((request.name.as_str(), request.mem_mib), ("t1", 64));
    assert_eq!(tenant, "acme");
    assert_eq!(serde_json::to_value(&operation).unwrap(), sent);

    let delete = json!({"kind": "template_delete", "template": "tpl_1"});
    let operation: Operation = serde_json::from_value(delete.clone()).unwrap();
    assert_eq!(operation.kind(), "template_delete");
    assert_eq!(operation.template().map(|t| t.as_str()), Some("tpl_1"));
    assert_eq!(serde_json::to_value(&operation).unwrap(), delete);
    // A pod refuses what it does not know, as an older pod refuses these
    // (upgrade replicas, then pods).
    let odd = json!({"kind": "template_delete", "template": "tpl_1", "pod": "p"});
    assert!(serde_json::from_value::<Operation>(odd).is_err());
    let gone = json!({"template_deleted": {"template": {
        "id": "tpl_1", "name": "t1", "kernel": "builtin:probe", "rootfs": null,
        "snapshot_dir": null, "mem_mib": 64, "vcpus": 1, "kind": "probe",
        "created_at": 5, "state": "deleted", "tenant": "acme",
    }}});
    let reply: Reply = serde_json::from_value(gone.clone()).unwrap();
    let Reply::TemplateDeleted { template } = &reply else {
        panic!("{reply:?}");
    };
    assert_eq!(template.id.as_str(), "tpl_1");
    assert_eq!(template.tenant.as_deref(), Some("acme"));
    assert_eq!(serde_json::to_value(&reply).unwrap(), gone);
}

#[test]
fn checkpoint_operations_name_their_sandbox() {
    let take = json!({"kind": "checkpoint", "sandbox": "sbx_1", "request": {"name": "one"}});
    let operation: Operation = serde_json::from_value(take.clone()).unwrap();
    assert_eq!(operation.kind(), "checkpoint");
    assert_eq!(operation.sandbox().map(|s| s.as_str()), Some("sbx_1"));
    assert!(matches!(&operation, Operation::Checkpoint { request, .. } if request.name == "one"));
    assert_eq!(serde_json::to_value(&operation).unwrap(), take);
    let delete = json!({"kind": "checkpoint_delete", "sandbox": "sbx_1", "name": "one"});
    let operation: Operation = serde_json::from_value(delete.clone()).unwrap();
    assert_eq!(operation.kind(), "checkpoint_delete");
    assert_eq!(operation.sandbox().map(|s| s.as_str()), Some("sbx_1"));
    assert_eq!(serde_json::to_value(&operation).unwrap(), delete);
    let odd = json!({"kind": "checkpoint", "sandbox": "sbx_1", "request": {"name": "one", "x": 1}});
    assert!(serde_json::from_value::<Operation>(odd).is_err());

    let taken = json!({"checkpoint": {"checkpoint": {
        "id": "ckp_1", "sandbox": "sbx_1", "name": "one", "snapshot_dir": "/d",
        "parent": null, "created_at": 5,
    }}});
    let reply: Reply = serde_json::from_value(taken.clone()).unwrap();
    assert!(matches!(&reply, Reply::Checkpoint { checkpoint } if checkpoint.name == "one"));
    assert_eq!(serde_json::to_value(&reply).unwrap(), taken);
    let gone = json!({"checkpoint_deleted": {"sandbox": "sbx_1", "name": "one"}});
    let reply: Reply = serde_json::from_value(gone.clone()).unwrap();
    assert_eq!(serde_json::to_value(&reply).unwrap(), gone);
}

#[test]
fn a_reply_on_a_pod_names_it() {
    let pod = PodId::new("pod1");
    let gone = Reply::Deleted {
        sandbox: SandboxId::new("sbx_1"),
    };
    assert!(matches!(gone.on_pod(&pod), Reply::Deleted { .. }));
    let forks = Reply::Sandboxes { sandboxes: vec![] }.on_pod(&pod);
    assert!(matches!(forks, Reply::Sandboxes { sandboxes } if sandboxes.is_empty()));
}
