//! The one dispatch (`torpor_api::dispatch`, `SandboxApi::operate`'s
//! default) on the in-memory backend: each operation, as a cluster's pod
//! worker reads it off its queue, answers its own reply or its error.

mod common;

use common::Fake;
use serde_json::json;
use torpor_api::service::{CreateSandbox, ServiceError};
use torpor_api::{Lifecycle, SandboxApi};
use torpor_sandbox_api::{Operation, Reply};
use torpor_scheduler::model::{Sandbox, SandboxState};

fn sandbox(reply: Reply) -> (Sandbox, bool) {
    match reply {
        Reply::Sandbox { sandbox, resumed } => (*sandbox, resumed),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn each_operation_answers_its_reply() {
    let fake = Fake::new();
    let create = Operation::Create {
        request: Box::new(CreateSandbox {
            template: common::TEMPLATE_ID.into(),
            pod: Some(torpor_scheduler::model::PodId::new("elsewhere")),
            ..Default::default()
        }),
        tenant: "acme".into(),
        admin: false,
    };
    // The caller is the operation's; a pod it names is this one.
    let (made, _) = sandbox(fake.operate(create).await.unwrap());
    assert_eq!(made.tenant.as_deref(), Some("acme"));
    assert_eq!(made.state, SandboxState::Running);
    let id = made.id.clone();

    let (paused, resumed) = sandbox(
        fake.operate(Operation::lifecycle(id.clone(), Lifecycle::Pause))
            .await
            .unwrap(),
    );
    assert_eq!((paused.state, resumed), (SandboxState::Paused, false));
    // As the queue carries it: its own kind.
    let hibernate: Operation =
        serde_json::from_value(json!({"kind": "hibernate_filesystem", "sandbox": id})).unwrap();
    let (slept, _) = sandbox(fake.operate(hibernate).await.unwrap());
    assert_eq!(slept.state, SandboxState::Hibernated);
    let (woken, resumed) = sandbox(
        fake.operate(Operation::lifecycle(id.clone(), Lifecycle::Connect))
            .await
            .unwrap(),
    );
    assert_eq!((woken.state, resumed), (SandboxState::Running, true));

    // Checkpoints are the pod's own service's: this backend has none.
    let take: Operation = serde_json::from_value(
        json!({"kind": "checkpoint", "sandbox": id, "request": {"name": "one"}}),
    )
    .unwrap();
    assert!(matches!(
        fake.operate(take).await,
        Err(ServiceError::Unsupported(_))
    ));
    let forks: Operation =
        serde_json::from_value(json!({"kind": "fork", "sandbox": id, "request": {"count": 0}}))
            .unwrap();
    assert!(matches!(
        fake.operate(forks).await,
        Err(ServiceError::Invalid(_))
    ));

    let gone = fake
        .operate(Operation::Delete {
            sandbox: id.clone(),
        })
        .await;
    assert!(matches!(gone, Ok(Reply::Deleted { sandbox }) if sandbox == id));
    let again = fake
        .operate(Operation::lifecycle(id, Lifecycle::Resume))
        .await;
    assert!(again.is_err());
}
