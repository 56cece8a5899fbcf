//! Finding processes in the console (issue 23, item 4): one search by every key a person holds,
//! keyset pages that say "N of M" and never cut, counts by status, every filter, and refusals of
//! filters and cursors that are none; in the API and in a real browser.

use super::*;
use std::collections::HashSet;

/// Starts `n` order processes (keys `k-<i>`, input `order_id` `ord-<i>`) of kind `kind` whose
/// charge's remote is `remote`; returns their ids in start order. No worker runs them.
async fn start_many(c: &Console, kind: &str, remote: processes::Remote, n: usize) -> Vec<Uuid> {
    let d = fx::order(kind, remote, 1, &c.db.pool, &fx::Failpoint::default());
    let mut ids = Vec::with_capacity(n);
    for i in 0..n {
        let input = json!({"amount": 5, "card": CARD, "charge": "ok", "order_id": format!("ord-{kind}-{i}")});
        let started = processes::start(&c.db.pool, &d, &format!("k-{kind}-{i}"), &input)
            .await
            .unwrap();
        ids.push(started.id);
    }
    ids
}

/// Puts process `id` in manual review as a worker would after its charge's outcome was `class`
/// (the test arranges the rows; the database's transition rules still apply).
async fn charge_in_review(c: &Console, id: Uuid, class: &str) {
    let mut tx = c.db.pool.begin().await.unwrap();
    sqlx::query(
        "UPDATE outbox.process_steps SET status = 'manual_review', error_class = $2, \
         error_message = 'timed out', last_reason = 'charge outcome ' || $2 \
         WHERE process_id = $1 AND name = 'charge' AND role = 'forward'",
    )
    .bind(id)
    .bind(class)
    .execute(&mut *tx)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE outbox.processes SET status = 'manual_review', last_reason = 'charge in doubt' WHERE id = $1",
    )
    .bind(id)
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
}

/// `GET path` as `token`, a 200 with a JSON body.
async fn page(c: &Console, token: &str, path: &str) -> Value {
    let (s, body) = c.get(token, path).await;
    assert_eq!(s, StatusCode::OK, "{path}: {body}");
    serde_json::from_str(&body).unwrap()
}

/// The ids of a page.
fn ids_of(page: &Value) -> Vec<Uuid> {
    page["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["id"].as_str().unwrap().parse().unwrap())
        .collect()
}

/// `GET /api/processes?<query>` finds exactly `want`, and says so in `total`.
async fn finds(c: &Console, token: &str, query: &str, want: &[Uuid]) {
    let p = page(c, token, &format!("/api/processes?limit=500&{query}")).await;
    let mut got = ids_of(&p);
    got.sort();
    let mut want = want.to_vec();
    want.sort();
    assert_eq!(got, want, "{query}");
    assert_eq!(p["total"], json!(want.len()), "{query}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_fifty_processes_are_paged_each_exactly_once_with_n_of_m_and_no_cut() {
    let c = Console::start().await;
    let viewer = c.user("vera", Role::Viewer).await;
    let ids = start_many(&c, "order_key", processes::Remote::HonoursKey, 250).await;

    let mut seen = Vec::new();
    let mut path = "/api/processes?limit=40".to_string();
    let mut pages = 0;
    loop {
        let p = page(&c, &viewer, &path).await;
        pages += 1;
        assert_eq!(p["total"], json!(250), "every page says how many in all");
        let got = ids_of(&p);
        assert!(got.len() <= 40);
        seen.extend(got);
        match p["next"].as_str() {
            Some(next) => path = format!("/api/processes?limit=40&after={next}"),
            None => break,
        }
    }
    assert_eq!(pages, 7, "250 in pages of 40");
    assert_eq!(seen.len(), 250, "no id twice, none left out");
    let unique: HashSet<Uuid> = seen.iter().copied().collect();
    assert_eq!(unique, ids.iter().copied().collect::<HashSet<_>>());
    assert!(seen.windows(2).all(|w| w[0] > w[1]), "newest first");

    // The page says "showing 1–50 of 250", links the next page, and that says "51–100".
    let cookie = login(&c, &viewer).await;
    let first = c.web.web_get(&cookie, "/processes").await;
    let html = first.text().await.unwrap();
    assert!(html.contains("of <span id=\"total\">250</span>"), "{html}");
    let next = html
        .split("id=\"next\" href=\"")
        .nth(1)
        .unwrap()
        .split('"')
        .next()
        .unwrap()
        .replace("&amp;", "&");
    let second = c.web.web_get(&cookie, &next).await;
    assert_eq!(second.status(), StatusCode::OK);
    let html = second.text().await.unwrap();
    assert!(
        html.contains("<span id=\"first-row\">51</span>–<span id=\"last-row\">100</span>"),
        "{html}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_search_finds_a_process_by_each_key_and_every_filter_narrows() {
    let c = Console::start().await;
    let op = c.user("olga", Role::Operator).await;
    let keyed = start_many(&c, "order_key", processes::Remote::HonoursKey, 6).await;
    let queried = start_many(&c, "order_query", processes::Remote::Queryable, 3).await;
    let target = keyed[4];
    let (operation,): (Uuid,) = sqlx::query_as(
        "SELECT operation_id FROM outbox.process_steps WHERE process_id = $1 AND name = 'charge'",
    )
    .bind(target)
    .fetch_one(&c.db.pool)
    .await
    .unwrap();
    sqlx::query("UPDATE outbox.process_steps SET remote_ref = 'ch_remote_4' WHERE process_id = $1 AND name = 'charge'")
        .bind(target)
        .execute(&c.db.pool)
        .await
        .unwrap();

    // Each key finds the one process; a secret of its input finds nothing (only the redacted
    // input is searched).
    for key in [
        target.to_string(),
        "k-order_key-4".to_string(),
        "ord-order_key-4".to_string(),
        operation.to_string(),
        "ch_remote_4".to_string(),
    ] {
        finds(
            &c,
            &op,
            &format!("q={}", console::web::url_encode(&key)),
            &[target],
        )
        .await;
    }
    for nothing in [CARD, "k-order_key", "ord-", &Uuid::now_v7().to_string()] {
        finds(&c, &op, &format!("q={nothing}"), &[]).await;
    }

    // Three in manual review (two unknown, one transient), one paused.
    charge_in_review(&c, keyed[0], "unknown").await;
    charge_in_review(&c, keyed[1], "transient").await;
    charge_in_review(&c, queried[0], "unknown").await;
    sqlx::query("UPDATE outbox.processes SET paused = true, last_reason = 'hold' WHERE id = $1")
        .bind(keyed[2])
        .execute(&c.db.pool)
        .await
        .unwrap();

    // Counts by status, as stored.
    let p = page(&c, &op, "/api/processes").await;
    let stored: Vec<(String, i64)> = sqlx::query_as(
        "SELECT status, count(*) FROM outbox.processes GROUP BY status ORDER BY status",
    )
    .fetch_all(&c.db.pool)
    .await
    .unwrap();
    let mut shown: Vec<(String, i64)> = p["counts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["status"].as_str().unwrap().to_string(),
                c["count"].as_i64().unwrap(),
            )
        })
        .collect();
    shown.sort();
    assert_eq!(shown, stored);
    assert_eq!(p["total"], json!(9));

    let in_review = [keyed[0], keyed[1], queried[0]];
    finds(&c, &op, "status=manual_review", &in_review).await;
    finds(&c, &op, "error_class=unknown", &[keyed[0], queried[0]]).await;
    finds(&c, &op, "error_class=transient", &[keyed[1]]).await;
    finds(&c, &op, "error_class=permanent", &[]).await;
    finds(&c, &op, "step=charge", &in_review).await;
    finds(&c, &op, "step=reserve", &[]).await;
    finds(
        &c,
        &op,
        "step=charge&error_class=unknown&remote=honours_key",
        &[keyed[0]],
    )
    .await;
    finds(&c, &op, "remote=queryable", &[queried[0]]).await;
    finds(&c, &op, "paused=true", &[keyed[2]]).await;
    finds(&c, &op, "paused=false&status=manual_review", &in_review).await;
    finds(&c, &op, "kind=order_query", &queried).await;
    finds(&c, &op, "in_review_longer_than=1h", &[]).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    finds(&c, &op, "in_review_longer_than=10ms", &in_review).await;
    finds(
        &c,
        &op,
        "in_review_longer_than=1ms&error_class=unknown",
        &[keyed[0], queried[0]],
    )
    .await;

    // A filter or cursor that is none is a 400 with only `error`, in the API and the page.
    let cookie = login(&c, &op).await;
    for bad in [
        "after=garbage",
        &format!("after={}", target),
        "after=p0123",
        "status=parked",
        "error_class=maybe",
        "remote=sometimes",
        "paused=yes",
        "in_review_longer_than=soon",
        "q=a%00b",
        "step=x%01",
    ] {
        let (s, body) = c.get(&op, &format!("/api/processes?{bad}")).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{bad}: {body}");
        let err: Value = serde_json::from_str(&body).unwrap();
        assert!(
            err["error"].is_string() && err.as_object().unwrap().len() == 1,
            "{bad}: {err}"
        );
        let r = c.web.web_get(&cookie, &format!("/processes?{bad}")).await;
        assert_eq!(r.status(), StatusCode::BAD_REQUEST, "page {bad}");
    }
    // Without a valid token: 401 before any filter is read.
    let (s, _) = c.get("ct_nobody", "/api/processes?status=parked").await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_real_browser_an_operator_and_a_viewer_search_and_page_through_processes() {
    let c = Console::start().await;
    let op = c.user("operator-olivia", Role::Operator).await;
    let ids = start_many(&c, "order_key", processes::Remote::HonoursKey, 120).await;
    charge_in_review(&c, ids[7], "unknown").await;
    let (_driver, b) = chromedriver().await;
    log_in(&b, &c.web.base, &op).await;

    // The list: counts by status, the first 50 of 120, a Next link.
    b.goto(&format!("{}/processes", c.web.base)).await.unwrap();
    wait_for(&b, "processes").await;
    let counts = wait_for(&b, "status-counts").await.text().await.unwrap();
    assert!(
        counts.contains("manual_review 1") && counts.contains("pending 119"),
        "{counts}"
    );
    let paging = wait_for(&b, "paging").await.text().await.unwrap();
    assert!(paging.contains("showing 1–50 of 120"), "{paging}");
    follow(&b, "next").await;
    let paging = wait_for(&b, "paging").await.text().await.unwrap();
    assert!(paging.contains("showing 51–100 of 120"), "{paging}");
    follow(&b, "next").await;
    let paging = wait_for(&b, "paging").await.text().await.unwrap();
    assert!(paging.contains("showing 101–120 of 120"), "{paging}");
    assert!(
        b.find(fantoccini::Locator::Id("next")).await.is_err(),
        "no Next on the last page"
    );

    // A count filters.
    follow(&b, "count-manual_review").await;
    wait_for(&b, &format!("process-{}", ids[7])).await;
    let paging = wait_for(&b, "paging").await.text().await.unwrap();
    assert!(paging.contains("showing 1–1 of 1"), "{paging}");

    // The search box finds a process by its order id.
    b.goto(&format!("{}/processes", c.web.base)).await.unwrap();
    type_into(&b, "search", "ord-order_key-42").await;
    follow(&b, "filter").await;
    wait_for(&b, &format!("process-{}", ids[42])).await;
    let paging = wait_for(&b, "paging").await.text().await.unwrap();
    assert!(paging.contains("showing 1–1 of 1"), "{paging}");
    let source = b.source().await.unwrap();
    assert!(!source.contains(CARD));
    b.screenshot().await.unwrap();

    // Acting on what a filter selects: the dry run lists it, one request asks one approval.
    b.goto(&format!(
        "{}/processes?status=manual_review&error_class=unknown",
        c.web.base
    ))
    .await
    .unwrap();
    wait_for(&b, &format!("process-{}", ids[7])).await;
    type_into(&b, "bulk-step", "charge").await;
    type_into(&b, "bulk-reason", "provider recovered, INC-7").await;
    follow(&b, "bulk-dry-run").await;
    let plan = wait_for(&b, "bulk-plan").await.text().await.unwrap();
    assert!(plan.contains(&ids[7].to_string()), "{plan}");
    assert_eq!(
        wait_for(&b, "bulk-selected").await.text().await.unwrap(),
        "1"
    );
    assert_eq!(c.approvals().await, 0, "a dry run asks nobody");
    follow(&b, "bulk-submit").await;
    let notice = wait_for(&b, "notice").await.text().await.unwrap();
    assert!(notice.contains("approval request"), "{notice}");
    assert_eq!(c.approvals().await, 1);
    b.screenshot().await.unwrap();

    // A viewer searches and pages the same list, and is offered no bulk form.
    let viewer = c.user("viewer-vic", Role::Viewer).await;
    log_out(&b).await;
    log_in(&b, &c.web.base, &viewer).await;
    b.goto(&format!("{}/processes", c.web.base)).await.unwrap();
    let paging = wait_for(&b, "paging").await.text().await.unwrap();
    assert!(paging.contains("showing 1–50 of 120"), "{paging}");
    type_into(&b, "search", "ord-order_key-42").await;
    follow(&b, "filter").await;
    wait_for(&b, &format!("process-{}", ids[42])).await;
    assert!(
        b.find(fantoccini::Locator::Id("bulk-form")).await.is_err(),
        "no bulk form for a viewer"
    );
    screenshot_and_close(b, "console-find-search.png").await;
}

/// How many transitions of process `id` an operator's `action` recorded.
async fn acted(c: &Console, id: Uuid, action: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM outbox.process_history WHERE process_id = $1 AND reason LIKE $2 || ':%' AND step_seq IS NOT NULL",
    )
    .bind(id)
    .bind(action)
    .fetch_one(&c.db.pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_rerun_by_filter_is_dry_run_approved_once_and_acts_on_exactly_the_frozen_versions() {
    let c = Console::start().await;
    let op = c.user("olga", Role::Operator).await;
    let ap = c.user("arthur", Role::Approver).await;
    let viewer = c.user("vera", Role::Viewer).await;
    let keyed = start_many(&c, "order_key", processes::Remote::HonoursKey, 5).await;
    let queried = start_many(&c, "order_query", processes::Remote::Queryable, 2).await;
    for id in [keyed[0], keyed[1], keyed[2], queried[0]] {
        charge_in_review(&c, id, "unknown").await;
    }
    charge_in_review(&c, keyed[3], "transient").await;
    let path = "/api/processes/actions/rerun_step";
    let filter =
        json!({"status": "manual_review", "error_class": "unknown", "remote": "honours_key"});
    let body = |dry: bool| json!({"filter": filter, "step": "charge", "reason": "provider recovered, INC-7", "dry_run": dry});

    // A viewer is refused first and audited, whatever the filter says.
    let (s, _, _) = c
        .post(
            &viewer,
            path,
            json!({"filter": {"error_class": "maybe"}, "step": "charge", "reason": "x"}),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    assert_eq!(
        c.audit_count("vera", "process.rerun_step", "denied").await,
        1
    );
    // Filters that are none, actions that need evidence per process (asked by an approver, who
    // may ask for them one by one), a step action without its step: 400 with only `error`.
    for (p, b) in [
        (
            path,
            json!({"filter": {"error_class": "maybe"}, "step": "charge", "reason": "x"}),
        ),
        (
            path,
            json!({"filter": {"in_review_longer_than": "soon"}, "step": "charge", "reason": "x"}),
        ),
        (path, json!({"filter": filter, "reason": "x"})),
        (
            "/api/processes/actions/resolve_failed",
            json!({"filter": filter, "step": "charge", "reason": "x"}),
        ),
        (
            "/api/processes/actions/resolve_succeeded",
            json!({"filter": filter, "step": "charge", "reason": "x"}),
        ),
        (
            "/api/processes/actions/run_compensation",
            json!({"filter": filter, "step": "charge", "reason": "x"}),
        ),
    ] {
        let (s, err, _) = c.post(&ap, p, b.clone(), None).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{p} {b}: {err}");
        assert!(
            err["error"].is_string() && err.as_object().unwrap().len() == 1,
            "{err}"
        );
    }

    // The dry run lists exactly the matching processes with their versions; nothing changes.
    let want: HashSet<Uuid> = keyed[..3].iter().copied().collect();
    let plan = c
        .post_expect(&op, path, body(true), None, StatusCode::OK)
        .await;
    let listed: HashSet<Uuid> = plan["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["id"].as_str().unwrap().parse().unwrap())
        .collect();
    assert_eq!(listed, want, "{plan}");
    for i in plan["items"].as_array().unwrap() {
        let id: Uuid = i["id"].as_str().unwrap().parse().unwrap();
        assert_eq!(i["version"], json!(c.process_state(id).await.2));
        assert_eq!(i["allowed"], json!(true));
    }
    assert_eq!(c.approvals().await, 0, "a dry run asks nobody");

    // One request, one reason, one approval; asking again answers with it.
    let asked = c
        .post_expect(&op, path, body(false), Some("bulk-1"), StatusCode::ACCEPTED)
        .await;
    assert_eq!(asked["selected"], json!(3));
    let (s, again, _) = c.post(&op, path, body(false), Some("bulk-2")).await;
    assert_eq!(s, StatusCode::ACCEPTED);
    assert_eq!(
        (again["approval"].clone(), again["existing"].clone()),
        (asked["approval"].clone(), json!(true))
    );
    assert_eq!(c.approvals().await, 1);
    for id in &keyed {
        assert_eq!(
            acted(&c, *id, "rerun_step").await,
            0,
            "nothing runs before approval"
        );
    }
    // The approver's card says what it does in business terms: the action and step, how many
    // processes, the filter with a link to what it selects now, and each process at its version.
    let cookie = login(&c, &ap).await;
    let card = c.web.web_get(&cookie, "/").await.text().await.unwrap();
    assert!(
        card.contains("rerun step of step charge on 3 processes a filter selected"),
        "{card}"
    );
    assert!(card.contains("error_class=unknown"), "{card}");
    assert!(
        card.contains("class=\"bulk-filter\" href=\"/processes?"),
        "{card}"
    );
    for i in plan["items"].as_array().unwrap() {
        let id = i["id"].as_str().unwrap();
        assert!(
            card.contains(&format!(
                "<a href=\"/processes/{id}\"><code>{id}</code></a> at version {}",
                i["version"]
            )),
            "{id} at its version on the card: {card}"
        );
    }

    // One of them moves on before the approval: it is skipped and reported, never acted on.
    let moved = keyed[1];
    let v = c.process_state(moved).await.2;
    c.post_expect(
        &op,
        &format!("/api/processes/{moved}/actions/pause"),
        json!({"reason": "hold it", "version": v}),
        None,
        StatusCode::OK,
    )
    .await;

    let approval = asked["approval"].as_str().unwrap();
    let (s, done) = c.try_approve(&ap, approval, "checked the provider").await;
    assert_eq!(s, StatusCode::OK, "{done}");
    let skipped = done["result"]["skipped"].as_array().unwrap();
    assert_eq!(skipped.len(), 1, "{done}");
    assert_eq!(skipped[0]["id"], json!(moved));
    assert_eq!(
        done["result"]["done"].as_array().unwrap().len(),
        2,
        "{done}"
    );
    for id in [keyed[0], keyed[2]] {
        assert_eq!(
            acted(&c, id, "rerun_step").await,
            1,
            "{id} rerun exactly once"
        );
        assert_ne!(c.process_state(id).await.0, "manual_review");
    }
    for id in [moved, keyed[3], keyed[4], queried[0], queried[1]] {
        assert_eq!(
            acted(&c, id, "rerun_step").await,
            0,
            "{id} not selected or moved on"
        );
    }
    // Approving again changes nothing.
    let (s, _) = c.try_approve(&ap, approval, "again").await;
    assert_eq!(s, StatusCode::CONFLICT);
    for id in [keyed[0], keyed[2]] {
        assert_eq!(acted(&c, id, "rerun_step").await, 1);
    }
}

/// Walks every page of `path` (a list answering `{items, total, next}`, `?` already in it) as
/// `token`; asserts each page says `total`; returns the items in order.
async fn walk(c: &Console, token: &str, path: &str, total: usize) -> Vec<Value> {
    let mut items = Vec::new();
    let mut next: Option<String> = None;
    loop {
        let url = match &next {
            Some(n) => format!("{path}&after={n}"),
            None => path.to_string(),
        };
        let p = page(c, token, &url).await;
        assert_eq!(p["total"], json!(total), "{url}: {p}");
        items.extend(p["items"].as_array().unwrap().iter().cloned());
        match p["next"].as_str() {
            Some(n) => next = Some(n.to_string()),
            None => return items,
        }
    }
}

/// A 400 with only `error`.
async fn refused(c: &Console, token: &str, path: &str) {
    let (s, body) = c.get(token, path).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{path}: {body}");
    let err: Value = serde_json::from_str(&body).unwrap();
    assert!(
        err["error"].is_string() && err.as_object().unwrap().len() == 1,
        "{path}: {err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_rows_and_the_audit_log_are_paged_with_n_of_m_and_all_dead_rows_are_requeued_after_one_approval()
 {
    let c = Console::start().await;
    let op = c.user("olga", Role::Operator).await;
    let ap = c.user("arthur", Role::Approver).await;
    let viewer = c.user("vera", Role::Viewer).await;
    // More than an approval's target can list one by one (it is in a unique index).
    let ids = c.dead_rows(120).await;

    // Every dead row exactly once, oldest first, each page saying 120.
    let rows = walk(&c, &viewer, "/api/outbox/dead?limit=50", 120).await;
    let seen: Vec<Uuid> = rows
        .iter()
        .map(|r| r["id"].as_str().unwrap().parse().unwrap())
        .collect();
    assert_eq!(
        seen.iter().copied().collect::<HashSet<_>>(),
        ids.iter().copied().collect::<HashSet<_>>()
    );
    assert_eq!(seen.len(), 120);
    assert!(
        rows.windows(2)
            .all(|w| w[0]["seq"].as_i64() < w[1]["seq"].as_i64())
    );
    assert!(
        !rows.iter().any(|r| r.to_string().contains(CARD)),
        "redacted"
    );
    for bad in ["after=zzz", "after=a5", "after=d-1", "after=d1%00"] {
        refused(&c, &viewer, &format!("/api/outbox/dead?{bad}")).await;
    }

    // "All that match": a viewer is refused and audited; the dry run names every row; one
    // request freezes all 120 in one approval; its approval requeues them all.
    let path = "/api/outbox/dead/actions/requeue";
    let (s, _, _) = c
        .post(&viewer, path, json!({"reason": "all", "all": true}), None)
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    assert_eq!(c.audit_count("vera", "outbox.requeue", "denied").await, 1);
    let plan = c
        .post_expect(
            &op,
            path,
            json!({"reason": "gateway fixed", "all": true, "dry_run": true}),
            None,
            StatusCode::OK,
        )
        .await;
    assert_eq!(plan["items"].as_array().unwrap().len(), 120, "{plan}");
    assert!(
        ids.iter()
            .all(|id| plan.to_string().contains(&id.to_string()))
    );
    c.post_expect(
        &op,
        path,
        json!({"reason": "x", "all": true, "items": [{"id": ids[0], "version": 1}]}),
        None,
        StatusCode::BAD_REQUEST,
    )
    .await;
    let asked = c
        .post_expect(
            &op,
            path,
            json!({"reason": "gateway fixed", "all": true}),
            None,
            StatusCode::ACCEPTED,
        )
        .await;
    for id in &ids {
        assert_eq!(c.state(*id).await, "dead", "nothing before the approval");
    }
    let approval = asked["approval"].as_str().unwrap();
    c.approve(&ap, approval).await;
    for id in &ids {
        assert_ne!(c.state(*id).await, "dead", "{id} requeued");
    }
    assert_eq!(
        page(&c, &viewer, "/api/outbox/dead").await["total"],
        json!(0)
    );

    // The audit log, newest first, every entry exactly once, each page saying how many.
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox.console_audit")
        .fetch_one(&c.db.pool)
        .await
        .unwrap();
    let entries = walk(&c, &viewer, "/api/audit?limit=7", stored as usize).await;
    let seqs: Vec<i64> = entries.iter().map(|e| e["seq"].as_i64().unwrap()).collect();
    assert_eq!(seqs.len() as i64, stored);
    assert!(
        seqs.windows(2).all(|w| w[0] > w[1]),
        "newest first, none twice"
    );
    let denied = walk(&c, &viewer, "/api/audit?limit=1&outcome=denied", 1).await;
    assert_eq!(denied.len(), 1);
    for bad in ["after=p1", "after=a", "after=a1x", "after=q3"] {
        refused(&c, &viewer, &format!("/api/audit?{bad}")).await;
    }
    // The audit page says "of M" and links the next page.
    let cookie = login(&c, &viewer).await;
    let html = c
        .web
        .web_get(&cookie, "/audit?limit=2")
        .await
        .text()
        .await
        .unwrap();
    assert!(html.contains("id=\"paging\""), "{html}");
    let r = c.web.web_get(&cookie, "/audit?after=zzz").await;
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_paged_by_the_queue_depth_and_all_that_match_are_replayed_after_one_approval()
 {
    let dl = DeadLetters::declare("console.find.dlq", "console.find.events", None).await;
    let name = &dl.name;
    let c = Console::start_with(5, &[name]).await;
    let op = c.user("dora", Role::Operator).await;
    let ap = c.user("dan", Role::Approver).await;
    let viewer = c.user("vera", Role::Viewer).await;
    let ids: Vec<String> = (0..7).map(|_| Uuid::new_v4().to_string()).collect();
    let headers = [
        (consumer::message::headers::DEAD_LETTER_KIND, "permanent"),
        (
            consumer::message::headers::DEAD_LETTER_REASON,
            "handler refused",
        ),
        (
            consumer::message::headers::DEAD_LETTERED_AT,
            "2026-12-01T10:00:00Z",
        ),
    ];
    for id in &ids {
        dl.publish(id, "payment.captured", &headers, br#"{"amount": 5}"#)
            .await;
    }

    // Pages of 3 from the head: 7 in all, each exactly once, left in place.
    let letters = walk(
        &c,
        &viewer,
        &format!("/api/dead-letters?consumer={name}&limit=3"),
        7,
    )
    .await;
    let seen: Vec<&str> = letters
        .iter()
        .map(|l| l["message_id"].as_str().unwrap())
        .collect();
    assert_eq!(
        seen,
        ids.iter().map(String::as_str).collect::<Vec<_>>(),
        "oldest first, none twice"
    );
    for bad in ["after=zzz", "after=p3", "after=q-1", "after=q"] {
        refused(
            &c,
            &viewer,
            &format!("/api/dead-letters?consumer={name}&{bad}"),
        )
        .await;
    }

    // "All that match": refused for a viewer (audited), a dry run of all 7, one approval.
    let path = format!("/api/dead-letters/{name}/actions/replay");
    let (s, _, _) = c
        .post(&viewer, &path, json!({"reason": "all", "all": true}), None)
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    assert_eq!(c.audit_count("vera", "dlq.replay", "denied").await, 1);
    let plan = c
        .post_expect(
            &op,
            &path,
            json!({"reason": "fixed", "all": true, "dry_run": true}),
            None,
            StatusCode::OK,
        )
        .await;
    assert_eq!(plan["items"].as_array().unwrap().len(), 7, "{plan}");
    let asked = c
        .post_expect(
            &op,
            &path,
            json!({"reason": "handler fixed", "all": true}),
            None,
            StatusCode::ACCEPTED,
        )
        .await;
    let approval = asked["approval"].as_str().unwrap();
    c.approve(&ap, approval).await;
    dl.wait_replayed(7).await;
    assert_eq!(c.audit_count("dora", "dlq.replay", "succeeded").await, 7);
    assert_eq!(
        page(&c, &viewer, &format!("/api/dead-letters?consumer={name}")).await["total"],
        json!(0)
    );
    dl.close().await;
}

/// The overview's dead rows are a list like the others: 200 a page, "showing 1–200 of 230" and a
/// Next link whose page holds the other 30, every row once; a bad cursor is a 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_overview_pages_its_dead_rows_with_n_of_m_and_a_next_link() {
    let c = Console::start().await;
    let viewer = c.user("vera", Role::Viewer).await;
    let ids = c.dead_rows(230).await;
    let cookie = login(&c, &viewer).await;
    let get = |path: String| {
        let req = c
            .web
            .http
            .get(format!("{}{path}", c.web.base))
            .header("cookie", &cookie);
        async move {
            let r = req.send().await.unwrap();
            (r.status(), r.text().await.unwrap())
        }
    };
    let shown = |html: &str| -> Vec<Uuid> {
        ids.iter()
            .copied()
            .filter(|id| html.contains(&format!("href=\"/outbox/dead/{id}\">{id}</a>")))
            .collect()
    };
    let (status, first) = get("/".into()).await;
    assert_eq!(status, StatusCode::OK);
    assert!(first.contains("showing <span id=\"first-row\">1</span>–<span id=\"last-row\">200</span> of <span id=\"total\">230</span>"), "{first}");
    let next = first
        .split("id=\"next\" href=\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .expect("a Next link")
        .replace("&amp;", "&");
    let (status, second) = get(next).await;
    assert_eq!(status, StatusCode::OK);
    assert!(second.contains("<span id=\"first-row\">201</span>–<span id=\"last-row\">230</span> of <span id=\"total\">230</span>"), "{second}");
    assert!(!second.contains("id=\"next\""), "the last page has no Next");
    let (a, b) = (shown(&first), shown(&second));
    assert_eq!(a.len(), 200);
    assert_eq!(b.len(), 30);
    assert!(a.iter().all(|id| !b.contains(id)), "no row on both pages");
    let (status, _) = get("/?after=zzz".into()).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}

/// Dead rows nothing can read as they are (an upgrade leaves such rows dead: the door refuses
/// them since) are listed like the others, by the API and on the overview page: a `created_at`
/// that is not a finite time as no time, headers nested deeper than a JSON reader goes as a text
/// saying why they are not shown; the aggregate's page lists them too. A requeue of one is refused
/// by the rule it breaks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_rows_nothing_can_read_are_listed_and_their_requeue_refused_by_their_rule() {
    let c = Console::start().await;
    let viewer = c.user("vera", Role::Viewer).await;
    let op = c.user("olga", Role::Operator).await;
    let ids = c.dead_rows(2).await;
    let odd: Uuid = sqlx::query_scalar(
        "INSERT INTO outbox.messages (aggregate_type, aggregate_id, event_type, payload, state, attempts, created_at) \
         VALUES ('payment', 'p-odd', 'payment.captured', '{}', 'dead', 5, 'infinity') RETURNING id",
    )
    .fetch_one(&c.db.pool)
    .await
    .unwrap();
    let deep: Uuid = sqlx::query_scalar(
        "INSERT INTO outbox.messages (aggregate_type, aggregate_id, event_type, payload, headers, state, attempts) \
         VALUES ('payment', 'p-deep', 'payment.captured', '{}', \
                 ('{\"deep\": ' || repeat('[', 300) || repeat(']', 300) || '}')::jsonb, 'dead', 5) RETURNING id",
    )
    .fetch_one(&c.db.pool)
    .await
    .unwrap();
    let listed = page(&c, &viewer, "/api/outbox/dead").await;
    assert_eq!(listed["total"], json!(4), "{listed}");
    let listed_row = |id: Uuid| {
        listed["items"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["id"] == json!(id))
            .cloned()
            .unwrap_or_else(|| panic!("{id} not listed: {listed}"))
    };
    let deep_row = listed_row(deep);
    assert!(
        deep_row["headers"]
            .as_str()
            .is_some_and(|h| h.starts_with("(not shown:") && h.contains("recursion limit")),
        "{deep_row}"
    );
    let row = listed_row(odd);
    assert_eq!(row["created_at"], Value::Null, "{row}");
    assert_eq!(
        row["unpublishable"],
        json!("created_at must be a finite time"),
        "{row}"
    );
    assert!(ids_of(&listed).contains(&ids[0]));
    let cookie = login(&c, &viewer).await;
    let r = c.web.web_get(&cookie, "/").await;
    assert_eq!(r.status(), StatusCode::OK);
    let html = r.text().await.unwrap();
    assert!(html.contains(&odd.to_string()) && html.contains(&deep.to_string()));
    // The aggregate's own page too.
    let r = c
        .web
        .web_get(&cookie, "/messages?aggregate_id=p-deep")
        .await;
    assert_eq!(r.status(), StatusCode::OK);
    let html = r.text().await.unwrap();
    assert!(html.contains(&format!("message-{deep}")), "{html}");
    let version: i64 = row["version"].as_i64().unwrap();
    let (s, body, _) = c
        .post(
            &op,
            &format!("/api/outbox/dead/{odd}/actions/requeue"),
            json!({"reason": "try", "version": version}),
            None,
        )
        .await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert!(
        body["error"]
            .as_str()
            .is_some_and(|e| e.contains("created_at must be a finite time")),
        "{body}"
    );
    assert_eq!(c.state(odd).await, "dead");
}

/// Item 1 of the console issue, in a real browser for each role: a charge whose outcome is unknown
/// (a key-honouring remote) opens with "the remote may have acted" and its safe action (rerun
/// with the same key) first. A viewer reads and can do nothing; an operator is offered the safe
/// action first; an approver who asks to resolve it as failed without saying what was checked at
/// the remote is refused, and nothing changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_real_browser_each_role_meets_an_unknown_outcome_as_the_safe_decision_needs() {
    use fantoccini::Locator;
    let c = Console::start().await;
    let viewer = c.user("vera", Role::Viewer).await;
    let op = c.user("olga", Role::Operator).await;
    let ap = c.user("arthur", Role::Approver).await;
    let id = start_many(&c, "order_key", processes::Remote::HonoursKey, 1).await[0];
    charge_in_review(&c, id, "unknown").await;
    let view = c.process_view(&op, id).await;
    let doubt = &view["unknown_outcomes"][0];
    assert_eq!(doubt["safe_action"], json!("rerun_step"), "{view}");
    let seq = doubt["step"].as_i64().unwrap();
    let before = c.process_state(id).await;

    let (_driver, b) = chromedriver().await;
    for (token, role) in [(&viewer, "viewer"), (&op, "operator"), (&ap, "approver")] {
        log_in(&b, &c.web.base, token).await;
        b.goto(&format!("{}/processes/{id}", c.web.base))
            .await
            .unwrap();
        let warning = text_of(&b, &format!("unknown-outcome-{seq}")).await;
        assert!(
            warning.contains("The remote may have acted") && warning.contains("Safe action first"),
            "{role}: {warning}"
        );
        let forms = b
            .find_all(Locator::Css("form.process-action"))
            .await
            .unwrap();
        let first = b
            .find(Locator::Css("#actions > *"))
            .await
            .unwrap()
            .attr("id")
            .await
            .unwrap()
            .unwrap_or_default();
        match role {
            "viewer" => {
                assert!(forms.is_empty(), "a viewer gets no form");
                assert!(text_of(&b, "actions").await.contains("Viewers read only."));
            }
            _ => assert_eq!(
                first,
                format!("form-rerun_step-{seq}"),
                "{role}: the safe action comes first"
            ),
        }
        if role == "approver" {
            let slug = format!("resolve_failed-{seq}");
            assert_eq!(
                text_of(&b, &format!("action-{slug}")).await,
                "Request resolve as failed"
            );
            type_into(&b, &format!("reason-{slug}"), "I think it failed").await;
            follow(&b, &format!("action-{slug}")).await;
            let refused = wait_for(&b, "error").await.text().await.unwrap();
            assert!(refused.starts_with("400"), "{refused}");
            screenshot_keep(&b, "console-unknown-outcome-refused.png").await;
        }
        log_out(&b).await;
    }
    b.close().await.unwrap();
    assert_eq!(c.process_state(id).await, before, "nothing changed");
    assert_eq!(c.approvals().await, 0, "no approval was asked for");
}

/// Saves the page as `target/<file>` (a PNG), leaving the browser open.
async fn screenshot_keep(b: &fantoccini::Client, file: &str) {
    let png = b.screenshot().await.unwrap();
    assert!(png.starts_with(b"\x89PNG"));
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../target")
        .join(file);
    std::fs::write(path, &png).unwrap();
}
