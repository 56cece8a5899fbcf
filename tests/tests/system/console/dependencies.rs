//! Dependencies in the console (issue 38): the overview says first which remote is down, since
//! when and how many processes wait for it; an operator holds a circuit open or closes it with a
//! reason, audited with the circuit before and after; a viewer may not. The processes are real:
//! a worker parks them on the held-open circuit and resumes them when it is closed.

use super::*;
use processes::{Definition, Done, ExternalStep, Remote, Step, StepContext, StepFuture};
use system_tests::workers::InProcessWorker;

const KIND: &str = "dep_payment";

/// An audit entry: actor, action, outcome, reason, before, after.
type AuditRow = (String, String, String, String, Option<Value>, Option<Value>);

/// A remote call that always succeeds when it is made.
struct Call;
impl ExternalStep for Call {
    fn call<'a>(&'a self, ctx: &'a StepContext) -> StepFuture<'a, Done> {
        Box::pin(async move { Ok(Done::new(format!("ref-{}", ctx.business_key))) })
    }
}

fn definition(provider: &breaker::Dependency) -> Definition {
    Definition::new(KIND, 1)
        .step(Step::external("charge", Remote::HonoursKey, Call).needs(provider.clone()))
}

#[tokio::test]
async fn the_overview_says_which_remote_is_down_and_an_operator_closes_its_circuit_audited() {
    let c = Console::start().await;
    let operator = c.user("olga", Role::Operator).await;
    let viewer = c.user("vic", Role::Viewer).await;
    let schema = Schema::default();
    let provider = breaker::Dependency::new(
        "provider",
        breaker::Policy::default().cache_for(Duration::ZERO),
    )
    .unwrap();
    provider.circuit(&c.db.pool, &schema).await.unwrap();

    // An operator holds the circuit open (a maintenance): the API, audited.
    let r = c
        .web
        .api_post(
            &operator,
            "/api/dependencies/provider/actions/open",
            &json!({"reason": "provider maintenance until 03:00"}),
            None,
        )
        .await;
    assert_eq!(r.status(), StatusCode::OK, "{:?}", r.text().await);
    // Payments started meanwhile wait for it: not called, not failed.
    let def = definition(&provider);
    for n in 0..3 {
        processes::start(&c.db.pool, &def, &format!("pay-{n}"), &json!({}))
            .await
            .unwrap();
    }
    let registry = processes::Registry::new().with(def).unwrap();
    let worker = InProcessWorker::start(&c.db.pool, "dep-worker", registry);
    wait_until(
        "three payments wait for the provider",
        Duration::from_secs(30),
        || async {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM outbox.process_steps WHERE waiting_for = 'provider'",
            )
            .fetch_one(&c.db.pool)
            .await
            .unwrap();
            (n == 3).then_some(())
        },
    )
    .await;

    // The overview's first line, and the table.
    let cookie = login(&c, &viewer).await;
    let page = c.web.web_get(&cookie, "/").await.text().await.unwrap();
    let line_at = page
        .find("id=\"dependency-down-provider\"")
        .expect("a line for the provider");
    assert!(
        line_at < page.find("Dependencies").unwrap_or(usize::MAX),
        "the line comes before the rest of the overview"
    );
    let line = &page[line_at..line_at + page[line_at..].find("</p>").unwrap()];
    assert!(line.contains("provider down</b> since "), "{line}");
    assert!(line.contains("circuit held open by an operator"), "{line}");
    assert!(line.contains("3 dep_payment processes waiting"), "{line}");
    assert!(!page.contains("Close the circuit"), "a viewer gets no form");
    let listed: Value = c
        .web
        .api_get(&viewer, "/api/dependencies")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(listed[0]["circuit"]["name"], json!("provider"));
    assert_eq!(listed[0]["waiting"][0]["count"], json!(3));

    // A viewer may not close it (refused and audited); a reason is required.
    let r = c
        .web
        .api_post(
            &viewer,
            "/api/dependencies/provider/actions/close",
            &json!({"reason": "x"}),
            None,
        )
        .await;
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    let r = c
        .web
        .api_post(
            &operator,
            "/api/dependencies/provider/actions/close",
            &json!({"reason": " "}),
            None,
        )
        .await;
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let r = c
        .web
        .api_post(
            &operator,
            "/api/dependencies/nobody/actions/close",
            &json!({"reason": "x"}),
            None,
        )
        .await;
    assert_eq!(r.status(), StatusCode::NOT_FOUND);

    // The operator closes it through the page's form: the payments resume and succeed.
    let op_cookie = login(&c, &operator).await;
    let page = c.web.web_get(&op_cookie, "/").await.text().await.unwrap();
    assert!(
        page.contains("Close the circuit"),
        "an operator gets the form"
    );
    let csrf = page
        .split("name=\"csrf\" value=\"")
        .nth(1)
        .and_then(|s| s.split('"').next())
        .expect("a CSRF token")
        .to_string();
    let r = c
        .web
        .web_post(
            &op_cookie,
            "/ui/dependencies/provider",
            &[
                ("csrf", csrf.as_str()),
                ("idempotency_key", &Uuid::new_v4().to_string()),
                ("action", "close"),
                ("reason", "maintenance over"),
            ],
        )
        .await;
    assert_eq!(r.status(), StatusCode::SEE_OTHER, "{:?}", r.text().await);
    wait_until("the payments succeed", Duration::from_secs(30), || async {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM outbox.processes WHERE kind = $1 AND status = 'succeeded'",
        )
        .bind(KIND)
        .fetch_one(&c.db.pool)
        .await
        .unwrap();
        (n == 3).then_some(())
    })
    .await;
    worker.stop().await;

    // Audited: who, what, why, the circuit before and after; the viewer's refusal too.
    let audit: Vec<AuditRow> = sqlx::query_as(
        "SELECT actor_name, action, outcome, reason, before, after FROM outbox.console_audit \
         WHERE target = 'dependency:provider' ORDER BY seq",
    )
    .fetch_all(&c.db.pool)
    .await
    .unwrap();
    let summary: Vec<(&str, &str, &str)> = audit
        .iter()
        .map(|a| (a.0.as_str(), a.1.as_str(), a.2.as_str()))
        .collect();
    assert_eq!(
        summary,
        [
            ("olga", "dependency.open", "succeeded"),
            ("vic", "dependency.close", "denied"),
            ("olga", "dependency.close", "succeeded"),
        ]
    );
    let closed = &audit[2];
    assert_eq!(closed.3, "maintenance over");
    assert_eq!(closed.4.as_ref().unwrap()["forced_open"], json!(true));
    assert_eq!(closed.5.as_ref().unwrap()["forced_open"], json!(false));
}
