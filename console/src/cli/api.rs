//! The console's API as typed calls, one per CLI command: the paths, query strings and bodies are
//! built here, so `main` only dispatches. Every action is sent with a fresh Idempotency-Key.

use super::args::{OrderedAct, ProcessAct, Selection};
use super::client::{Client, ClientError};
use crate::text::url_encode;
use anyhow::Context;
use serde_json::{Value, json};
use uuid::Uuid;

/// A fresh Idempotency-Key for one command.
fn key() -> String {
    Uuid::new_v4().to_string()
}

impl Client {
    /// `GET /api/outbox/dead`.
    pub async fn dead_rows(&self) -> Result<Value, ClientError> {
        self.get("/api/outbox/dead").await
    }

    /// Requeues dead rows given as `ID:VERSION` (more than one: an approval request).
    pub async fn requeue_dead(&self, s: &Selection) -> anyhow::Result<(u16, Value)> {
        let mut parsed = Vec::new();
        for i in &s.items {
            let (id, version) = i
                .split_once(':')
                .with_context(|| format!("{i:?}: expected ID:VERSION"))?;
            let version = version.parse::<i64>().context("VERSION is a number")?;
            parsed.push(json!({"id": id, "version": version}));
        }
        let body = json!({"reason": s.reason, "dry_run": s.dry_run, "items": parsed});
        Ok(self
            .post("/api/outbox/dead/actions/requeue", &body, &key())
            .await?)
    }

    /// `GET /api/dead-letters?consumer=...`.
    pub async fn dead_letters(&self, consumer: &str) -> Result<Value, ClientError> {
        self.get(&format!(
            "/api/dead-letters?consumer={}",
            url_encode(consumer)
        ))
        .await
    }

    /// Replays dead letters given as `MESSAGE_ID=VERSION` (more than one: an approval request).
    pub async fn replay(&self, consumer: &str, s: &Selection) -> Result<(u16, Value), ClientError> {
        let parsed: Vec<Value> = s
            .items
            .iter()
            .map(|i| {
                let (id, version) = i.split_once('=').unwrap_or((i.as_str(), ""));
                json!({"message_id": id, "version": version})
            })
            .collect();
        let body = json!({"reason": s.reason, "dry_run": s.dry_run, "items": parsed});
        let path = format!("/api/dead-letters/{}/actions/replay", url_encode(consumer));
        self.post(&path, &body, &key()).await
    }

    /// `GET /api/approvals[?status=...]`.
    pub async fn approvals(&self, status: Option<&str>) -> Result<Value, ClientError> {
        match status {
            Some(s) => {
                self.get(&format!("/api/approvals?status={}", url_encode(s)))
                    .await
            }
            None => self.get("/api/approvals").await,
        }
    }

    /// Approves (`approve`) or rejects a request of someone else.
    pub async fn decide(
        &self,
        id: Uuid,
        approve: bool,
        reason: &str,
        version: i32,
    ) -> Result<(u16, Value), ClientError> {
        let verb = if approve { "approve" } else { "reject" };
        let body = json!({"reason": reason, "version": version});
        self.post(&format!("/api/approvals/{id}/{verb}"), &body, &key())
            .await
    }

    /// `GET /api/processes` with the filters given.
    pub async fn processes(
        &self,
        kind: Option<&str>,
        status: Option<&str>,
        older_than_seconds: Option<i64>,
    ) -> Result<Value, ClientError> {
        let mut q = Vec::new();
        if let Some(k) = kind {
            q.push(format!("kind={}", url_encode(k)));
        }
        if let Some(s) = status {
            q.push(format!("status={}", url_encode(s)));
        }
        if let Some(o) = older_than_seconds {
            q.push(format!("older_than_seconds={o}"));
        }
        self.get(&format!("/api/processes?{}", q.join("&"))).await
    }

    /// `GET /api/processes/{id}`.
    pub async fn process(&self, id: Uuid) -> Result<Value, ClientError> {
        self.get(&format!("/api/processes/{id}")).await
    }

    /// An action on a process.
    pub async fn process_act(&self, a: &ProcessAct) -> Result<(u16, Value), ClientError> {
        let mut body = json!({"reason": a.reason, "version": a.version, "step": a.step, "evidence": a.evidence});
        if let (Some(checked), Some(answer)) = (&a.checked, &a.answer) {
            body["remote_check"] = json!({"checked": checked, "answer": answer});
        }
        let path = format!("/api/processes/{}/actions/{}", a.id, url_encode(&a.action));
        self.post(&path, &body, &key()).await
    }

    /// `GET /api/consumers/{consumer}/ordered`.
    pub async fn ordered(&self, consumer: &str) -> Result<Value, ClientError> {
        self.get(&format!("/api/consumers/{}/ordered", url_encode(consumer)))
            .await
    }

    /// An action on an ordered consumer's stuck aggregate.
    pub async fn ordered_act(&self, a: &OrderedAct) -> Result<(u16, Value), ClientError> {
        let body = json!({"aggregate_type": a.aggregate_type, "aggregate_id": a.aggregate_id,
            "version": a.version, "reason": a.reason, "dry_run": a.dry_run});
        let path = format!(
            "/api/consumers/{}/ordered/actions/{}",
            url_encode(&a.consumer),
            url_encode(&a.action)
        );
        self.post(&path, &body, &key()).await
    }

    /// The audit log as JSON lines, oldest first (since a time, if given).
    pub async fn audit_export(&self, since: Option<&str>) -> Result<String, ClientError> {
        let mut q = "/api/audit?format=jsonl".to_string();
        if let Some(s) = since {
            q.push_str(&format!("&since={}", url_encode(s)));
        }
        self.get_text(&q).await
    }
}
