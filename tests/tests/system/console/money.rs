//! Money shown right (issue 40, bug 1): amounts are stored in minor units and every place that
//! shows a process shows them in the currency's major units, by its ISO 4217 exponent: the
//! process page's summary and input, the API's view, the CLI's `process show` and `approvals
//! list`. Before, the page showed the input as stored ("amount":6396) and the CLI nothing, and a
//! card read "6396 EUR". The definition says which input fields are money, in any shape.

use super::*;
use processes::{Definition, Done, LocalStep, Step, StepContext, StepFuture};
use sqlx::PgConnection;

struct Fine;
impl LocalStep for Fine {
    fn run<'a>(&'a self, _: &'a StepContext, _: &'a mut PgConnection) -> StepFuture<'a, Done> {
        Box::pin(async { Ok(Done::new("fine")) })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amounts_are_shown_in_major_units_on_the_page_in_the_api_and_in_the_cli() {
    let c = Console::start().await;
    let token = c.user("mona", Role::Operator).await;
    // A charge in euros (the currency in an input field), a fee always in yen (no minor unit)
    // at a nested path, a refund in dinars (three decimals), and a definition that declares
    // nothing though its input has an `amount`.
    let declared = Definition::new("money_order", 1)
        .money("amount", "currency")
        .money_in("fees.minor", "JPY")
        .money("refund", "refund_currency")
        .step(Step::local("fine", Fine));
    let undeclared = Definition::new("money_legacy", 1).step(Step::local("fine", Fine));
    let id = processes::start(
        &c.db.pool,
        &declared,
        "money-1",
        &json!({"amount": 6396, "currency": "EUR", "fees": {"minor": 500},
                "refund": 1250, "refund_currency": "BHD"}),
    )
    .await
    .unwrap()
    .id;
    let legacy = processes::start(
        &c.db.pool,
        &undeclared,
        "money-2",
        &json!({"amount": 12405, "currency": "EUR"}),
    )
    .await
    .unwrap()
    .id;

    // The API's view carries the declared amounts as stored at start.
    let view = c.process_view(&token, id).await;
    let shown: Vec<&str> = view["money"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["shown"].as_str().unwrap())
        .collect();
    assert_eq!(shown, ["63.96 EUR", "500 JPY", "1.250 BHD"], "{view}");
    assert_eq!(view["money"][0]["minor"], json!(6396));

    // The page: the summary and the input, each amount in major units.
    let cookie = login(&c, &token).await;
    let page = c
        .web
        .web_get(&cookie, &format!("/processes/{id}"))
        .await
        .text()
        .await
        .unwrap();
    let summary = page
        .split("id=\"process-money\"")
        .nth(1)
        .and_then(|rest| rest.split("</td>").next())
        .unwrap_or_else(|| panic!("no money in the summary: {page}"));
    for part in [
        "amount <b class=\"amount\">63.96 EUR</b>",
        "fees.minor <b class=\"amount\">500 JPY</b>",
        "refund <b class=\"amount\">1.250 BHD</b>",
    ] {
        assert!(summary.contains(part), "{part} in {summary}");
    }
    assert!(!summary.contains("6396 EUR"), "{summary}");
    let input = page
        .split("id=\"input-money\"")
        .nth(1)
        .and_then(|rest| rest.split("</ul>").next())
        .unwrap_or_else(|| panic!("no money above the input: {page}"));
    assert!(
        input.contains("amount 63.96 EUR (6396 minor units)"),
        "{input}"
    );
    // Without a declaration the product's convention is read, and the page says so.
    let page = c
        .web
        .web_get(&cookie, &format!("/processes/{legacy}"))
        .await
        .text()
        .await
        .unwrap();
    assert!(
        page.contains(
            "amount 124.05 EUR (12405 minor units) [by convention: the definition declares no money]"
        ),
        "{page}"
    );

    // The CLI's process show.
    let out = c.cli(&token, &["process", "show", &id.to_string()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    for line in [
        "money: amount 63.96 EUR (6396 minor units)",
        "money: fees.minor 500 JPY (500 minor units)",
        "money: refund 1.250 BHD (1250 minor units)",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} in {text}");
    }
}

/// A definition that names a currency ISO does not know, or declares an amount both money and
/// redacted, is refused before anything is stored: a guessed exponent shows a wrong amount.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_money_field_without_a_known_currency_or_also_redacted_is_refused_at_start() {
    let db = TestDb::new().await;
    for (d, want) in [
        (
            Definition::new("money_bad", 1)
                .money_in("amount", "EURO")
                .step(Step::local("fine", Fine)),
            "ISO 4217",
        ),
        (
            Definition::new("money_bad", 1)
                .money("amount", "currency")
                .redact("amount")
                .step(Step::local("fine", Fine)),
            "also declared redacted",
        ),
    ] {
        let e = processes::start(&db.pool, &d, "k", &json!({"amount": 1}))
            .await
            .unwrap_err();
        assert!(e.to_string().contains(want), "{e}");
        assert!(
            processes::Registry::new().with(d).is_err(),
            "the registry refuses it too"
        );
    }
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox.processes")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(n, 0);
}
